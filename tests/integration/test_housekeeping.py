"""A consumer's housekeeping threads (lease renewal and queue maintenance; vacuuming)
end when its connection closes: none of them is left sending statements to a database
its test, or its application, drops next."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Queue

from tests.pg import (
    create_database,
    drop_database,
    metered_database,
    new_database_name,
    to_broker_url,
)


@pytest.fixture
def own_database(pg_url: str) -> Iterator[str]:
    """A database of this test's own (the session's prefix: cleaned up if interrupted),
    kept by a session of its own while the test runs: named with that session's pid, so
    that no run starting beside this one (another pytest process, a run this suite
    starts) takes it for abandoned."""
    with psycopg.connect(pg_url, autocommit=True) as keeper:
        name = new_database_name(keeper_pid=keeper.info.backend_pid)
        url = create_database(pg_url, name, keeper)
        metered_database(name)
        try:
            yield url
        finally:
            drop_database(pg_url, name)


def consuming(url: str, schema: str) -> tuple[Connection, Consumer]:
    conn = Connection(to_broker_url(url), transport_options={"schema": schema})
    consumer = Consumer(conn, [Queue("kept", Exchange("kept"), "r")], accept=["json"])
    consumer.consume()
    with suppress(TimeoutError):
        conn.drain_events(timeout=0.05)  # starts the housekeeping threads
    return conn, consumer


def threads_of(conn: Connection) -> list[Any]:
    transport = conn.transport
    found = [transport._renewer, transport._vacuumer]
    assert all(t is not None and t.is_alive() for t in found), found
    return found


def test_closing_a_consumer_ends_its_housekeeping_before_the_close_returns(
    own_database: str, schema: str, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    conn, _ = consuming(own_database, schema)
    threads = threads_of(conn)
    conn.close()
    assert [t.name for t in threads if t.is_alive()] == [], "still running after the close"
    # So dropping its database right after cannot make one fail on it.
    drop_database(pg_url, own_database.rsplit("/", 1)[1].split("?")[0])
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
