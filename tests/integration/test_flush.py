"""A durable publish that tries a hand-off: the consumer has the message before its WAL
flush, and the publisher is answered only once the flush is done.

The publisher's second transaction (the ``flush_wal`` query) is observed through
:class:`Observed`, and held at will by an advisory lock the test holds; everything else
is real: consumer sessions, the server's WAL positions, ``pg_terminate_backend``.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pg_transport.connection import Connector
from pg_transport.gate import HandoffGate
from pg_transport.schema import ensure_schema
from pg_transport.store import Store
from pg_transport.wire import Row, Statement
from tests.integration import test_handoff, test_wake
from tests.integration.conftest import Peek
from tests.integration.test_handoff import PAYLOAD, Consumer, Consumers

# The hand-off tests' consumers (real consumer sessions), as fixtures here too.
consumers = test_handoff.consumers
consumer = test_handoff.consumer
listener = test_wake.listener


class Observed(Statement):
    """One of the store's statements (``flush_wal``, ``settle``), the backend of each of
    its runs recorded (run alone or sent with the publish). With a ``hold`` key, it first
    waits for that advisory lock (shared), so a test holding it keeps it from
    committing."""

    def __init__(self, real: Statement, hold: int | None) -> None:
        text = real.text.decode()
        if hold is not None:  # (its target list runs in order: the lock, then the rest)
            text = f"SELECT pg_advisory_xact_lock_shared({hold}), ({text})"
        super().__init__(f"{real.name}_observed", text)
        self.params = real.params
        self.backends: list[int] = []

    def execute(
        self, conn: psycopg.Connection[Any], params: Any, *, prepare: bool
    ) -> list[Row]:
        self.backends.append(conn.info.backend_pid)
        return super().execute(conn, params, prepare=prepare)

    def send(self, conn: psycopg.Connection[Any], params: Any, *, prepare: bool) -> None:
        self.backends.append(conn.info.backend_pid)
        super().send(conn, params, prepare=prepare)


def observe(store: Store, name: str = "flush_wal", hold: int | None = None) -> Observed:
    observed = Observed(store.wire[name], hold)
    store.wire[name] = observed
    return observed


@pytest.fixture
def held(peek: Peek) -> Iterator[int]:
    """An advisory lock key, locked by ``peek``'s session until the test unlocks it."""
    key = random.getrandbits(62)
    peek("SELECT pg_advisory_lock(%s)", key)
    yield key
    peek("SELECT pg_advisory_unlock_all()")


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




def waiter(peek: Peek, key: int, failure: str) -> int:
    """The backend waiting for advisory lock ``key``, once one does."""
    query = ("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
             " AND (classid::bigint << 32 | objid::bigint) = %s")
    peek.wait_until(f"SELECT EXISTS ({query})", key, failure=failure)
    [(pid,)] = peek(query, key)
    return int(pid)


def publishing(send: Callable[[], None]) -> tuple[threading.Thread, threading.Event]:
    returned = threading.Event()

    def publish() -> None:
        send()
        returned.set()

    thread = threading.Thread(target=publish)
    thread.start()
    return thread, returned


@pytest.mark.parametrize("send", [publish_direct, publish_routed])
def test_the_consumer_has_the_message_before_the_flush_the_publisher_waits_for(
    consumer: Consumer, durable: Store, peek: Peek, held: int,
    send: Callable[[Store, int], None],
) -> None:
    flush = observe(durable, "settle", held)
    consumer.claim(["q"])
    publisher, returned = publishing(lambda: send(durable, 1))
    try:
        [handed] = consumer.handed(1)
        # The publisher waits in its flush, and the consumer has the message.
        assert waiter(peek, held, "the publisher never reached its flush") == flush.backends[0]
        committed = insert_lsn(peek)  # past the hand-off's commit record
        assert (handed.queue, handed.read_ct, handed.payload["n"]) == ("q", 1, 1)
        assert peek("SELECT id, read_ct FROM {schema}.message") == [(handed.id, 1)]
        assert not returned.is_set()
    finally:
        peek("SELECT pg_advisory_unlock(%s)", held)
        publisher.join(10)
    assert returned.is_set()
    # Answered only after a flush that covers the hand-off's commit.
    assert flushed_past(peek, committed)
    assert len(flush.backends) == 1


@pytest.mark.parametrize("send", [publish_direct, publish_routed])
def test_a_try_that_finds_nobody_wakes_its_listeners_once_its_commit_is_done(
    durable: Store, peek: Peek, held: int, listener: psycopg.Connection[Any],
    send: Callable[[Store, int], None],
) -> None:
    settle = observe(durable, "settle", held)
    flush = observe(durable)
    publisher, returned = publishing(lambda: send(durable, 1))
    try:
        assert waiter(peek, held, "the publisher never sent its wake-up") == settle.backends[0]
        # Committed and visible, not handed over; nobody woken yet.
        assert peek("SELECT read_ct FROM {schema}.message") == [(0,)]
        assert list(listener.notifies(timeout=0.0)) == []
        assert not returned.is_set()
    finally:
        peek("SELECT pg_advisory_unlock(%s)", held)
        publisher.join(10)
    assert returned.is_set()
    [wake] = list(listener.notifies(timeout=10.0, stop_after=1))
    assert (wake.channel, wake.payload) == (durable.channel, "q")
    assert flush.backends == []  # committed flushed: nothing to flush apart
    assert len(settle.backends) == 1


def test_only_a_handoff_commits_unflushed(
    consumers: Consumers, durable: Store, store: Store, peek: Peek,
    listener: psycopg.Connection[Any],
) -> None:
    flush, settle = observe(durable), observe(durable, "settle")
    # A publish the gate lets try no hand-off commits flushed, and wakes apart (wake).
    durable.gate = HandoffGate(misses=1, pause=3600.0)
    durable.gate.tried("q", handed=False)
    durable.publish("q", {**PAYLOAD, "n": 1})
    assert (flush.backends, settle.backends) == ([], [])
    # A message due later is not handed over, nor flushed apart.
    consumers().claim(["q"])
    durable.publish("q", {**PAYLOAD, "n": 2}, delay=60)
    assert (flush.backends, settle.backends) == ([], [])
    # Copies routed to two queues are handed to nobody, though "q" has a waiter: they
    # commit flushed, and settle wakes both queues.
    durable.declare_exchange("fan", "fanout")
    for queue in ("q", "s"):
        durable.bind("fan", queue, "", "")
    assert durable.publish_routed("fan", "", {**PAYLOAD, "n": 3}) == ("fanout", 2)
    assert flush.backends == [] and len(settle.backends) == 1
    # (the first publish's wake-up, then these two)
    wakes = listener.notifies(timeout=10.0, stop_after=3)
    assert sorted(wake.payload for wake in wakes) == ["q", "q", "s"]
    assert peek("SELECT read_ct FROM {schema}.message WHERE queue IN ('q', 's')"
                " AND payload->>'n' = '3'") == [(0,), (0,)]
    # Without the option, a hand-off commits flushed, as every publish does.
    flush, settle = observe(store), observe(store, "settle")
    waiting = consumers()
    waiting.claim(["r"])
    store.publish("r", {**PAYLOAD, "n": 4})
    assert [m.payload["n"] for m in waiting.handed(1)] == [4]
    assert (flush.backends, settle.backends) == ([], [])


@pytest.mark.parametrize("send", [publish_direct, publish_routed])
def test_a_publisher_cut_off_before_its_flush_flushes_on_its_retry(
    consumer: Consumer, durable: Store, peek: Peek, held: int,
    send: Callable[[Store, int], None],
) -> None:
    cut_at = observe(durable, "settle", held)
    flush = observe(durable)
    consumer.claim(["q"])
    publisher, returned = publishing(lambda: send(durable, 1))
    try:
        assert [m.payload["n"] for m in consumer.handed(1)] == [1]
        cut = waiter(peek, held, "the publisher never reached its flush")
        assert cut_at.backends == [cut]
        committed = insert_lsn(peek)
        peek("SELECT pg_terminate_backend(%s, 10000)", cut)
    finally:
        peek("SELECT pg_advisory_unlock(%s)", held)
        publisher.join(10)
    # The hand-off committed, then its session died: the retry inserts nothing (the
    # publish key, or tag, is there) and still flushes, on a new session, before returning.
    assert returned.is_set()
    assert flush.backends and flush.backends[-1] != cut
    assert flushed_past(peek, committed)
    assert len(consumer.handed(1)) == 1
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


def test_a_route_that_matched_no_queue_is_published_without_settle_until_it_matches(
    durable: Store, listener: psycopg.Connection[Any]
) -> None:
    settle = observe(durable, "settle")
    durable.declare_exchange("events", "fanout")
    # Nothing bound: the first publish learns it, with settle sent along; the next one
    # is the statement alone.
    for _ in range(2):
        assert durable.publish_routed("events", "", PAYLOAD) == ("fanout", 0)
    assert len(settle.backends) == 1
    durable.bind("events", "monitor", "", "")
    # The next publish finds the queue, waking it from inside its own commit, and the
    # one after it has settle wake it.
    for sent in (1, 2):
        assert durable.publish_routed("events", "", PAYLOAD) == ("fanout", 1)
        assert len(settle.backends) == sent
        [wake] = listener.notifies(timeout=10.0, stop_after=1)
        assert wake.payload == "monitor"
