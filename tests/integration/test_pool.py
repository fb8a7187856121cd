"""A process's pools: shared by its kombu connections, capped, idle sessions closed."""

from __future__ import annotations

import os
import time
import uuid
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest
from kombu import Connection

from pg_transport.db.pool import Connector, shared, url_to_conninfo
from pg_transport.errors import BrokerUnavailable
from tests.acceptance.harness import wait_for
from tests.pg import to_broker_url


def sessions_named(pg_url: str, name: str) -> int:
    with psycopg.connect(pg_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name]
        ).fetchone()
    return int(row[0]) if row else 0


def test_kombu_connections_of_a_process_share_its_pools(broker_url: str, schema: str) -> None:
    options: dict[str, Any] = {"schema": schema, "pool_size": 3, "pool_idle_timeout": 7}
    with ExitStack() as stack:
        transports = [
            stack.enter_context(Connection(broker_url, transport_options=options)).transport
            for _ in range(5)
        ]
        assert len({id(t.connector) for t in transports}) == 1
        assert len({id(t.relaxed) for t in transports}) == 1
        pool = transports[0].connector
        assert (pool.max_size, pool.idle_timeout) == (3, 7.0)
        # Other settings, another pool.
        other = stack.enter_context(
            Connection(broker_url, transport_options={**options, "pool_size": 4})
        )
        assert other.transport.connector is not pool


def test_shared_gives_one_connector_per_settings(pg_url: str) -> None:
    first = shared(pg_url, application_name="pgq-t-shared", max_size=2)
    assert shared(pg_url, application_name="pgq-t-shared", max_size=2) is first
    assert shared(pg_url, application_name="pgq-t-shared", max_size=3) is not first
    first.close()
    assert shared(pg_url, application_name="pgq-t-shared", max_size=2) is not first


def test_an_idle_pooled_session_is_closed_after_the_idle_timeout(pg_url: str) -> None:
    name = "pgq-t-idle-" + uuid.uuid4().hex[:6]
    pool = Connector(pg_url, application_name=name, idle_timeout=0.3)
    try:
        with pool.connection() as conn:
            conn.execute("SELECT 1")
        assert sessions_named(pg_url, f"{name}:{os.getpid()}") == 1
        wait_for(
            lambda: sessions_named(pg_url, f"{name}:{os.getpid()}") == 0,
            5,
            "the reaper to close the idle session",
        )
        assert pool.idle_count == 0
        with pool.connection() as conn:  # and the pool goes on
            assert conn.execute("SELECT 2").fetchone() == (2,)
    finally:
        pool.close()


def test_a_session_in_use_is_never_reaped(pg_url: str) -> None:
    name = "pgq-t-busy-" + uuid.uuid4().hex[:6]
    pool = Connector(pg_url, application_name=name, idle_timeout=0.1)
    other = Connector(pg_url, application_name=name + "-o", idle_timeout=0.1)
    try:
        with pool.connection() as conn:
            with other.connection():
                pass  # an idle one elsewhere keeps the reaper going
            wait_for(lambda: other.idle_count == 0, 5, "the other pool's idle session to close")
            assert conn.execute("SELECT 3").fetchone() == (3,)
    finally:
        pool.close()
        other.close()


def test_the_pool_is_capped(pg_url: str) -> None:
    pool = Connector(pg_url, max_size=2, wait_timeout=0.3)
    try:
        with (
            pool.connection(),
            pool.connection(),
            pytest.raises(BrokerUnavailable, match="all 2 connections"),
            pool.connection(),
        ):
            pass
    finally:
        pool.close()


def test_the_reaper_sleeps_between_turns(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It wakes every idle_timeout/4 at most (a busy loop would starve a gevent worker)."""
    turns: list[float] = []
    real = Connector.reap

    def counted(self: Connector) -> None:
        if any(self is pool for pool in pools):  # (other tests' pools may be idle too)
            turns.append(time.monotonic())
        real(self)

    monkeypatch.setattr(Connector, "reap", counted)
    pools = [Connector(pg_url, idle_timeout=2.0) for _ in range(2)]  # two new pools: woken twice
    try:
        for pool in pools:
            with pool.connection():
                pass
        time.sleep(1.2)
        assert len(turns) <= 2 * 3, len(turns)  # (every 0.5 s, for each pool)
    finally:
        for pool in pools:
            pool.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_talks_on_a_session_it_inherited(pg_url: str) -> None:
    """What pgq's own pool is kept for (db/pool.py's docstring): a session idle in the
    pool when the process forks (a prefork worker's children) is not handed to the
    child, whose first connection is a session of its own, and the parent's session
    still answers after the child exits (the child never sent a byte on it, not even
    the Terminate of a close). psycopg_pool, measured, hands the child the parent's."""
    connector = Connector(url_to_conninfo(to_broker_url(pg_url)), max_size=2)
    with connector.connection() as conn:
        parent_backend = conn.info.backend_pid
    assert connector.idle_count == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the backend it was given, then exit at once
        code = 1
        try:
            with connector.connection() as conn:
                os.write(write, str(conn.info.backend_pid).encode())
            connector.close()  # closes what it holds, never the inherited session
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child_backend = int(os.read(read, 64) or b"0")
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_backend not in (0, parent_backend), "the child talked on the parent's session"
    with connector.connection() as conn:
        assert conn.info.backend_pid == parent_backend, "the parent's idle session was lost"
        assert conn.execute("SELECT 1").fetchone() == (1,)
    connector.close()
