"""A durable publish handed to a waiting consumer: the consumer has the message before
its WAL flush, and the publisher is answered only once the flush is done.

The publisher's second transaction (the ``flush_wal`` query) is observed, and held at
will, through :class:`Observed`; everything else is real: consumer sessions, the
server's WAL positions, ``pg_terminate_backend``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pg_transport.connection import Connector
from pg_transport.schema import ensure_schema
from pg_transport.store import Store
from pg_transport.wire import Row, Statement
from tests.integration import test_handoff
from tests.integration.conftest import Peek
from tests.integration.test_handoff import PAYLOAD, Consumer, Consumers

# The hand-off tests' consumers (real consumer sessions), as fixtures here too.
consumers = test_handoff.consumers
consumer = test_handoff.consumer

Hook = Callable[[psycopg.Connection[Any]], None]


class Observed(Statement):
    """The store's ``flush_wal`` statement, with ``before`` run ahead of each execution
    (on the publisher's thread) and the backend of each execution recorded."""

    def __init__(self, real: Statement, before: Hook) -> None:
        self.__dict__.update(real.__dict__)
        self.before = before
        self.backends: list[int] = []

    def execute(
        self, conn: psycopg.Connection[Any], params: Any, *, prepare: bool
    ) -> list[Row]:
        self.backends.append(conn.info.backend_pid)
        self.before(conn)
        return super().execute(conn, params, prepare=prepare)


def observe(store: Store, before: Hook = lambda conn: None) -> Observed:
    observed = Observed(store.wire["flush_wal"], before)
    store.wire["flush_wal"] = observed
    return observed


@pytest.fixture
def durable(pg_url: str, schema: str, store: Store) -> Iterator[Store]:
    """A publisher as the transport makes it with ``durable_publish`` on."""
    connector = Connector(pg_url)
    yield Store(connector, schema, deliver_before_flush=True)
    connector.close()


def insert_lsn(peek: Peek) -> str:
    [(lsn,)] = peek("SELECT pg_current_wal_insert_lsn()::text")
    return str(lsn)


def flushed_past(peek: Peek, lsn: str) -> bool:
    [(done,)] = peek("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", lsn)
    return bool(done)


def publish_direct(store: Store, n: int) -> None:
    store.publish("q", {**PAYLOAD, "n": n}, publish_key=f"k{n}")


def publish_routed(store: Store, n: int) -> None:
    """Through an exchange, to the one queue bound with the routing key."""
    store.declare_exchange("tasks", "direct")
    store.bind("tasks", "q", "k", "")
    assert store.publish_routed("tasks", "k", {**PAYLOAD, "n": n}, publish_tag=f"t{n}") == (
        "direct", 1,
    )


@pytest.mark.parametrize("send", [publish_direct, publish_routed])
def test_the_consumer_has_the_message_before_the_flush_the_publisher_waits_for(
    consumer: Consumer, durable: Store, peek: Peek, send: Callable[[Store, int], None]
) -> None:
    reached, release, returned = threading.Event(), threading.Event(), threading.Event()
    committed: list[str] = []

    def hold(conn: psycopg.Connection[Any]) -> None:
        # The hand-off has committed: WAL up to here holds its commit record.
        committed.append(insert_lsn(peek))
        reached.set()
        assert release.wait(10), "the test never let the flush go"

    flush = observe(durable, hold)
    consumer.claim(["q"])

    def publish() -> None:
        send(durable, 1)
        returned.set()

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        assert reached.wait(10), "a hand-off was published without a flush after it"
        # The publisher is held before its flush, and the consumer has the message.
        [handed] = consumer.handed(1)
        assert (handed.queue, handed.read_ct, handed.payload["n"]) == ("q", 1, 1)
        assert peek("SELECT id, read_ct FROM {schema}.message") == [(handed.id, 1)]
        assert not returned.is_set()
    finally:
        release.set()
        publisher.join(10)
    assert returned.is_set()
    # Answered only after a flush that covers the hand-off's commit.
    assert flushed_past(peek, committed[0])
    assert len(flush.backends) == 1


def test_only_a_handoff_commits_unflushed(
    consumers: Consumers, durable: Store, store: Store, peek: Peek
) -> None:
    flush = observe(durable)
    # Nobody waits: the publish commits flushed, in one statement.
    durable.publish("q", {**PAYLOAD, "n": 1})
    assert flush.backends == []
    # A message due later is not handed over, nor flushed apart.
    consumers().claim(["q"])
    durable.publish("q", {**PAYLOAD, "n": 2}, delay=60)
    assert flush.backends == []
    # Copies routed to two queues are handed to nobody, though "q" has a waiter.
    durable.declare_exchange("fan", "fanout")
    for queue in ("q", "s"):
        durable.bind("fan", queue, "", "")
    assert durable.publish_routed("fan", "", {**PAYLOAD, "n": 3}) == ("fanout", 2)
    assert flush.backends == []
    assert peek("SELECT read_ct FROM {schema}.message WHERE queue IN ('q', 's')"
                " AND payload->>'n' = '3'") == [(0,), (0,)]
    # Without the option, a hand-off commits flushed, as every publish does.
    observe(store)
    waiting = consumers()
    waiting.claim(["r"])
    store.publish("r", {**PAYLOAD, "n": 4})
    assert [m.payload["n"] for m in waiting.handed(1)] == [4]
    assert store.wire["flush_wal"].backends == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("send", [publish_direct, publish_routed])
def test_a_publisher_cut_off_before_its_flush_flushes_on_its_retry(
    consumer: Consumer, durable: Store, peek: Peek, pg_url: str,
    send: Callable[[Store, int], None],
) -> None:
    committed: list[str] = []

    def cut_off_once(conn: psycopg.Connection[Any]) -> None:
        if committed:
            return
        committed.append(insert_lsn(peek))
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", [conn.info.backend_pid])

    flush = observe(durable, cut_off_once)
    consumer.claim(["q"])
    # The hand-off committed, then its session died: the retry inserts nothing (the
    # publish key, or tag, is there) and still flushes, on a new session, before returning.
    send(durable, 1)
    assert len(flush.backends) == 2 and flush.backends[0] != flush.backends[1]
    assert flushed_past(peek, committed[0])
    assert [m.payload["n"] for m in consumer.handed(1)] == [1]
    assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]


@pytest.fixture
def no_flush_role(pg_url: str) -> Iterator[str]:
    """A libpq URL for a role that owns a database of its own, where nobody but a
    superuser may run ``pg_logical_emit_message``."""
    tag = uuid.uuid4().hex[:8]
    role, database = f"pgq_noflush_{tag}", f"pgq_noflush_{tag}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
            sql.Identifier(database), sql.Identifier(role)))
    url = make_conninfo(pg_url, dbname=database)
    try:
        with psycopg.connect(url, autocommit=True) as there:
            # Each database has its own catalog: this changes nothing elsewhere.
            for (signature,) in there.execute(
                "SELECT p.oid::regprocedure::text FROM pg_proc AS p"
                " WHERE p.proname = 'pg_logical_emit_message'"
            ).fetchall():
                there.execute(f"REVOKE EXECUTE ON FUNCTION {signature} FROM PUBLIC")
        yield make_conninfo(url, user=role)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(database)))
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_a_role_that_may_not_flush_hands_over_flushed(
    no_flush_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    connector = Connector(no_flush_role)
    schema = "pgq_noflush"
    ensure_schema(connector, schema, auto_migrate=True)
    publisher = Store(connector, schema, deliver_before_flush=True)
    flush = observe(publisher)
    waiting = Consumer(no_flush_role, schema)
    try:
        waiting.claim(["q"])
        with caplog.at_level(logging.WARNING, logger="pg_transport.store"):
            publisher.publish("q", {**PAYLOAD, "n": 1})
        # Handed over all the same, committed flushed: no second transaction.
        assert [m.payload["n"] for m in waiting.handed(1)] == [1]
        assert flush.backends == []
        assert "may not run pg_logical_emit_message" in caplog.text
    finally:
        waiting.close()
        connector.close()
