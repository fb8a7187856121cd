"""Every session pgq opens over TCP asks the kernel to notice a vanished peer: keepalive
probes after 15 s of silence, 5 s apart, three of them, and a 30 s bound on data left
unacknowledged (what ``pg_transport.db.pool.KEEPALIVES`` promises), read back from the
real sockets of a publishing and consuming kombu connection, a result backend's and the
operator commands' sessions. A URL that sets its own values keeps them."""

from __future__ import annotations

import socket
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict

from pg_transport.db.pool import KEEPALIVES, Connector, url_to_conninfo

TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def tcp_url(broker_url: str) -> str:
    params = conninfo_to_dict(url_to_conninfo(broker_url))
    if str(params.get("host", "")).startswith("/") or not params.get("host"):
        pytest.skip("the test server is reached over a unix socket: TCP options do not apply")
    return broker_url


def socket_options(conn: psycopg.Connection[Any]) -> dict[str, int]:
    sock = socket.socket(fileno=conn.pgconn.socket)
    try:
        return {
            "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "tcp_user_timeout": sock.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT),
        }
    finally:
        sock.detach()


EXPECTED = {key: int(value) for key, value in KEEPALIVES.items()}


def test_a_transport_session_has_keepalives_and_a_user_timeout(
    broker_url: str, schema: str
) -> None:
    url = tcp_url(broker_url)
    with Connection(url, transport_options={"schema": schema}) as conn:
        queue = conn.SimpleQueue("keepalive-q")
        queue.put({"n": 1})
        assert queue.get(timeout=10).payload == {"n": 1}
        connector = conn.transport.connector
        with connector.connection() as session:
            assert socket_options(session) == EXPECTED
        queue.close()


def test_a_result_backend_session_has_them_too(broker_url: str, schema: str) -> None:
    url = tcp_url(broker_url)
    app = Celery("keepalive", broker=url, backend=url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.result_backend_transport_options = {"schema": schema}
    backend = app.backend
    backend.store_result("keepalive-task", 42, "SUCCESS")
    with backend.connector.connection() as session:
        assert socket_options(session) == EXPECTED
    assert app.AsyncResult("keepalive-task").get(timeout=10) == 42


def test_a_url_keeps_its_own_values(broker_url: str) -> None:
    url = tcp_url(broker_url)
    sep = "&" if "?" in url else "?"
    own = f"{url}{sep}keepalives_idle=42&tcp_user_timeout=7000"
    connector = Connector(url_to_conninfo(own), display_url="test")
    try:
        with connector.connection() as session:
            found = socket_options(session)
    finally:
        connector.close()
    assert found == {**EXPECTED, "keepalives_idle": 42, "tcp_user_timeout": 7000}
