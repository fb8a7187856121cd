"""The worker's settles of atomic deliveries (consume/settles.py): gathered into one
statement, each still fenced by its lease, sent at once when the consumer stops, and
never on the event loop's thread. Real transport, real Postgres; the loop turned by
hand (tests/integration/test_event_loop.py's helpers)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from kombu import Connection
from kombu.asynchronous import Hub

from pg_transport.atomic.run import _q
from pg_transport.consume.settles import Settles
from pg_transport.message.rows import Lease
from tests.integration.conftest import Peek
from tests.integration.test_event_loop import engine, hub, started, turn_until

__all__ = ["hub"]  # (the fixture, imported for this module's tests)


def token(message: Any) -> Lease:
    ident, lease = message.delivery_info["pgq_token"]
    return Lease(int(ident), int(lease), message.delivery_info["pgq_queue"], None)


def complete(pg_url: str, schema: str, lease: Lease) -> None:
    """What a committed atomic run does to its delivery: the fence, committed."""
    with psycopg.connect(pg_url) as conn:
        xid = conn.execute("SELECT pg_current_xact_id()::text").fetchone()
        assert xid is not None
        params = {"id": lease.id, "lease": lease.lease, "queue": lease.queue, "xid": xid[0]}
        conn.execute(_q(schema)["complete"], params)


def test_the_settles_of_many_atomic_deliveries_go_as_one_statement(
    conn: Connection,
    hub: Hub,
    rows: Peek,
    pg_url: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight atomic deliveries acked on the loop's thread: three committed by their run
    (gone: their settle finds nothing), five not (released at once by the settle, lease
    + 1). One settle statement for the eight, where each was a statement of its own."""
    sent, got = started(conn, hub, monkeypatch, "settles", prefetch=8, messages=8)
    turn_until(hub, lambda: len(got) == 8)
    qos = got[0].channel.qos
    for message in got:
        qos.settle_on_ack(message.delivery_tag)
    done = got[:3]
    for message in done:
        complete(pg_url, schema, token(message))
    for message in got:
        hub.call_soon(message.ack)
    hub.run_once()  # the eight acks, on the loop's thread
    deadline = time.monotonic() + 10
    while sent.settled < 8:
        assert time.monotonic() < deadline, "the settles never landed"
        time.sleep(0.01)
    assert (sent.settle, sent.settled) == (1, 8)
    released = sorted((token(m).id, token(m).lease + 1) for m in got[3:])
    assert (
        rows("SELECT id, lease FROM {schema}.message WHERE visible_at <= now() ORDER BY id")
        == released
    )


def test_a_stopping_consumer_sends_its_pending_settles_at_once(
    conn: Connection,
    hub: Hub,
    rows: Peek,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, got = started(conn, hub, monkeypatch, "settles-close", prefetch=2, messages=2)
    turn_until(hub, lambda: len(got) == 2)
    qos = got[0].channel.qos
    for message in got:
        qos.settle_on_ack(message.delivery_tag)
        message.ack()
    eng = engine(conn)
    # However long the window, closing sends what is pending and does not wait it out.
    monkeypatch.setattr(eng._settles, "_gather", 60.0)
    started_at = time.monotonic()
    eng.close()
    assert time.monotonic() - started_at < 30.0
    assert rows("SELECT count(*) FROM {schema}.message WHERE visible_at <= now()") == [(2,)]
    # Closed: a late settle is made by its caller, here and now.
    assert eng.settle(token(got[0])) is False


def test_settles_wait_for_the_window_or_for_the_most_a_statement_takes() -> None:
    """The rule (without Postgres: what is sent, in which batches, and when)."""
    batches: list[list[int]] = []
    landed = threading.Event()

    def send(tokens: list[Lease]) -> None:
        batches.append([t.id for t in tokens])
        landed.set()

    # Cut short by the most: four go at once though the window is a minute.
    settles = Settles(send, gather=60.0, most=4)
    for ident in range(4):
        assert settles.add(Lease(ident, 1, "q", None))
    assert landed.wait(10)
    assert batches == [[0, 1, 2, 3]]
    # One alone waits for its window, then goes (a short window: measured against it).
    landed.clear()
    settles._gather = 0.2
    added = time.monotonic()
    settles.add(Lease(9, 1, "q", None))
    assert landed.wait(10)
    assert time.monotonic() - added >= 0.2
    assert batches == [[0, 1, 2, 3], [9]]
    settles.close()
    assert settles.add(Lease(10, 1, "q", None)) is False


def test_a_failed_settle_is_logged_and_the_next_ones_still_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[list[int]] = []
    failed, landed = threading.Event(), threading.Event()

    def send(tokens: list[Lease]) -> None:
        calls.append([t.id for t in tokens])
        if len(calls) == 1:
            failed.set()
            raise psycopg.OperationalError("server closed the connection")
        landed.set()

    settles = Settles(send, gather=60.0, most=1)
    settles.add(Lease(1, 1, "q", None))
    assert failed.wait(10)
    settles.add(Lease(2, 1, "q", None))
    assert landed.wait(10)
    settles.close()
    assert calls == [[1], [2]]
    assert "visibility timeout lapses" in caplog.text
