"""The transport inside kombu's event loop (the hub Celery runs its workers on).

Each test registers a real transport with a real ``Hub`` and turns the loop by hand,
so what happens between two iterations is what the test says, not what a timer did.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue
from kombu.asynchronous import Hub

from pg_transport.consume.engine import Engine
from pg_transport.consume.source import Statements
from pg_transport.store import Lease
from tests.integration.conftest import Peek


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


def turn_until(hub: Hub, done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the event loop never got there"
        hub.run_once()


def consume(conn: Connection, queue: str, prefetch: int) -> list[Any]:
    got: list[Any] = []
    consumer = Consumer(conn.channel(), [Queue(queue)], callbacks=[lambda _b, m: got.append(m)])
    consumer.qos(prefetch_count=prefetch)
    consumer.consume()
    return got


def engine(conn: Connection) -> Engine:
    """The connection's consumer engine (what every pool's consumer runs)."""
    found: Engine = conn.transport.engine
    return found


def started(
    conn: Connection,
    hub: Hub,
    monkeypatch: pytest.MonkeyPatch,
    queue: str,
    prefetch: int,
    messages: int,
) -> tuple[Statements, list[Any]]:
    """A consumer of ``queue`` with ``messages`` published, registered with the loop,
    no housekeeping thread (only the loop lands acks): (statements sent, deliveries)."""
    monkeypatch.setattr(conn.transport, "_ensure_renewer", lambda: None)
    sent = engine(conn).statements
    got = consume(conn, queue, prefetch)
    producer = Producer(conn.channel(), routing_key=queue)
    for n in range(messages):
        producer.publish({"n": n})
    conn.transport.register_with_event_loop(conn.connection, hub)
    return sent, got


def test_an_ack_rides_on_the_next_claim(
    conn: Connection, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent, got = started(conn, hub, monkeypatch, "rides", prefetch=1, messages=2)
    turn_until(hub, lambda: len(got) == 1)
    first = got[0]
    first.ack()
    # Buffered, not deleted yet: the loop has not turned since.
    assert rows("SELECT count(*) FROM {schema}.message") == [(2,)]
    turn_until(hub, lambda: len(got) == 2)
    assert [m.payload for m in got] == [{"n": 0}, {"n": 1}]
    # The claim of the second message deleted the first: no statement of its own.
    assert (sent.claim, sent.acks_riding, sent.ack) == (2, 1, 0)
    assert rows("SELECT read_ct FROM {schema}.message") == [(1,)]


def test_after_a_short_claim_acks_land_alone_and_a_publish_wakes_a_claim(
    conn: Connection, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No poll during the test: it would claim (and carry acks) of its own accord.
    monkeypatch.setattr(conn.transport, "polling_interval", 600)
    sent, got = started(conn, hub, monkeypatch, "short", prefetch=4, messages=2)
    turn_until(hub, lambda: len(got) == 2)
    # The claim came back short (2 of 4): the queue is known to be empty, and the
    # consumer waits for a wake-up.
    turn_until(hub, lambda: engine(conn).waiting)
    claims = sent.claim
    second = got[1].delivery_info["pgq_token"][0]
    got[0].ack()
    turn_until(hub, lambda: rows("SELECT id FROM {schema}.message") == [(second,)])
    # Nothing to claim: the ack went alone.
    assert (sent.claim, sent.ack, sent.acks_alone) == (claims, 1, 1)
    got[1].ack()
    turn_until(hub, lambda: rows("SELECT count(*) FROM {schema}.message") == [(0,)])
    assert (sent.claim, sent.ack, sent.acks_alone) == (claims, 2, 2)
    # The next publish's wake-up (a NOTIFY on the queue's channel, with nothing in it)
    # brings a claim, and the claim the message.
    turn_until(hub, lambda: engine(conn).waiting)
    Producer(conn.channel(), routing_key="short").publish({"n": 2})
    turn_until(hub, lambda: len(got) == 3)
    assert got[2].payload == {"n": 2}
    assert sent.claim == claims + 1
    assert rows("SELECT read_ct FROM {schema}.message") == [(1,)]


def test_a_stalled_loop_does_not_keep_acks_from_landing(
    conn: Connection, hub: Hub, rows: Peek
) -> None:
    got = consume(conn, "stalled", prefetch=4)
    Producer(conn.channel(), routing_key="stalled").publish({"n": 1})
    conn.transport.register_with_event_loop(conn.connection, hub)
    turn_until(hub, lambda: len(got) == 1)
    got[0].ack()
    # The loop never turns again (a task running inline, say): the housekeeping thread
    # lands the ack within its cycle (2 s at most).
    deadline = time.monotonic() + 10
    while rows("SELECT count(*) FROM {schema}.message") != [(0,)]:
        assert time.monotonic() < deadline, "the buffered ack never landed"
        time.sleep(0.05)


def test_closing_lands_buffered_acks(broker_url: str, schema: str, hub: Hub, rows: Peek) -> None:
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()
        c.transport._ensure_renewer = lambda: None
        got = consume(c, "closing", prefetch=4)
        producer = Producer(c.channel(), routing_key="closing")
        producer.publish({"n": 1})
        producer.publish({"n": 2})
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until(hub, lambda: len(got) == 2)
        got[0].ack()
        assert rows("SELECT count(*) FROM {schema}.message") == [(2,)]
    # Closed: the buffered ack landed with the close; the unacked one was handed back.
    assert rows("SELECT read_ct, visible_at <= now() FROM {schema}.message") == [(1, True)]


def test_a_notify_wakes_the_loop_not_the_poll(broker_url: str, schema: str, hub: Hub) -> None:
    options = {"schema": schema, "polling_interval": 60}
    with Connection(broker_url, transport_options=options) as c:
        c.connect()
        got = consume(c, "woken", prefetch=4)
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until(hub, lambda: engine(c).waiting)
        with Connection(broker_url, transport_options=options) as other:
            Producer(other.channel(), routing_key="woken").publish({"n": 1})
        started = time.monotonic()
        turn_until(hub, lambda: len(got) == 1, timeout=5)
        assert time.monotonic() - started < 5  # the poll would take 60 s


def test_the_poll_finds_a_delayed_message_that_fell_due(
    broker_url: str, schema: str, hub: Hub, rows: Peek
) -> None:
    options = {"schema": schema, "polling_interval": 0.2}
    with Connection(broker_url, transport_options=options) as c:
        c.connect()
        got = consume(c, "due", prefetch=4)
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until(hub, lambda: engine(c).waiting)
        rows(
            "INSERT INTO {schema}.message (queue, visible_at, payload) VALUES"
            " ('due', now() + interval '300 ms', %s)",
            '{"body": "{}", "content-type": "application/json", "headers": {},'
            ' "properties": {"delivery_info": {}}}',
        )
        turn_until(hub, lambda: len(got) == 1, timeout=5)


def test_a_message_falling_due_while_the_last_claim_was_delivered_is_claimed_at_once(
    broker_url: str, schema: str, hub: Hub, rows: Peek
) -> None:
    """An idle consumer claims A when it falls due; B falls due after that claim looked
    and before the consumer asks when the next message is due (here: while A is being
    delivered). B is due and unclaimed: the consumer claims it at once, not at its next
    poll (60 s). No notification is involved: the rows are inserted directly, and the
    one wake-up sent (for both, before either is due) is long taken when B falls due."""
    options = {"schema": schema, "polling_interval": 60}
    payload = (
        '{"body": "{}", "content-type": "application/json", "headers": {},'
        ' "properties": {"delivery_info": {}}}'
    )
    with Connection(broker_url, transport_options=options) as c:
        c.connect()
        got: list[Any] = []
        due_b: list[int] = []

        def delivered(_body: Any, message: Any) -> None:
            got.append(message)
            if len(got) == 1:  # A: hold the loop here until B is due
                rows.wait_until(
                    "SELECT visible_at <= now() FROM {schema}.message WHERE id = %s",
                    due_b[0],
                    failure="B never fell due",
                )

        consumer = Consumer(c.channel(), [Queue("late")], callbacks=[delivered])
        consumer.qos(prefetch_count=4)
        consumer.consume()
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until(hub, lambda: engine(c).waiting)
        ((_,), (b,)) = rows(
            "INSERT INTO {schema}.message (queue, visible_at, payload) VALUES"
            " ('late', now() + interval '300 ms', %s),"
            " ('late', now() + interval '600 ms', %s) RETURNING id",
            payload,
            payload,
        )
        due_b.append(b)
        rows("SELECT pg_notify(%s, '')", engine(c).channel("late"))
        turn_until(hub, lambda: len(got) == 1, timeout=10)
        turn_until(hub, lambda: len(got) == 2, timeout=10)


def test_a_terminated_session_is_a_connection_error_and_keeps_the_acks(
    conn: Connection, hub: Hub, rows: Peek, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = conn.transport
    _, got = started(conn, hub, monkeypatch, "cut", prefetch=1, messages=2)
    turn_until(hub, lambda: len(got) == 1)
    backend = engine(conn).session.backend_pid
    # The server drops the consumer's session (a restart, a pooler reaping it).
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [backend])
    got[0].ack()
    with pytest.raises(transport.connection_errors):
        turn_until(hub, lambda: False, timeout=10)
    # Celery now collects the transport: the ack still lands, on a fresh session.
    transport._collect(conn.connection)
    assert rows("SELECT count(*), min(read_ct) FROM {schema}.message") == [(1, 0)]


def test_after_a_lost_connection_one_line_says_the_unacked_stay_leased(
    conn: Connection,
    hub: Hub,
    rows: Peek,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = conn.transport
    _, got = started(conn, hub, monkeypatch, "gone", prefetch=1, messages=1)
    turn_until(hub, lambda: len(got) == 1)
    transport._collect(conn.connection)  # Celery, on losing the connection
    with caplog.at_level(logging.INFO):
        got[0].channel.qos.restore_unacked_once()
    said = [r.getMessage() for r in caplog.records]
    # kombu's "Restoring 1 unacknowledged message(s)" would contradict what happens.
    assert not any("Restoring" in line for line in said), said
    (line,) = [line for line in said if "unacknowledged" in line]
    assert "1 unacknowledged message(s) are not restored" in line
    assert "lease lapses" in line
    # And so it is: the message is still leased, not back in the queue.
    assert rows("SELECT read_ct, visible_at > now() FROM {schema}.message") == [(1, True)]


def test_many_acks_from_pool_threads_land_in_few_statements(
    conn: Connection, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent, got = started(conn, hub, monkeypatch, "pool", prefetch=50, messages=200)
    acked = 0
    while acked < 200:
        turn_until(hub, lambda done=acked: len(got) > done)
        batch, acked = got[acked:], len(got)
        # Acked from other threads, as Celery's pool does.
        threads = [threading.Thread(target=m.ack) for m in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    turn_until(hub, lambda: rows("SELECT count(*) FROM {schema}.message") == [(0,)])
    assert [m.payload["n"] for m in got] == list(range(200))
    # Each claim took every ack buffered since the one before.
    assert sent.acks_riding + sent.acks_alone == 200
    assert sent.claim < 20


def test_acks_on_the_loop_s_thread_land_before_it_polls_with_no_wake_up_pipe(
    conn: Connection, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent, got = started(conn, hub, monkeypatch, "inline", prefetch=2, messages=6)
    turn_until(hub, lambda: len(got) == 2 and not engine(conn).busy)
    consumer = engine(conn)
    pipe_wakes: list[int] = []
    real_poke = consumer.poke
    monkeypatch.setattr(consumer, "poke", lambda: pipe_wakes.append(1) or real_poke())
    claims, riding = sent.claim, sent.acks_riding
    # As Celery's prefork and solo pools ack: in callbacks the loop runs, on its thread.
    hub.call_soon(got[0].ack)
    hub.call_soon(got[1].ack)
    hub.run_once()  # runs both (in no set order), then claims before it polls
    assert (sent.claim, sent.acks_riding, sent.ack) == (claims + 1, riding + 2, 0)
    assert pipe_wakes == []
    turn_until(hub, lambda: len(got) == 4 and not engine(conn).busy)
    # An ack on the loop's thread between two turns: the next turn claims.
    got[2].ack()
    hub.run_once()
    assert (sent.claim, sent.acks_riding, sent.ack) == (claims + 2, riding + 3, 0)
    assert pipe_wakes == []
    turn_until(hub, lambda: len(got) == 5)
    # From any other thread an ack wakes the loop through the pipe.
    acker = threading.Thread(target=got[3].ack)
    acker.start()
    acker.join()
    assert pipe_wakes == [1]


def test_a_claim_out_when_the_connection_closes_is_handed_back(
    broker_url: str, schema: str, hub: Hub, rows: Peek
) -> None:
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()
        got = consume(c, "out", prefetch=4)
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until(hub, lambda: engine(c).waiting)
        Producer(c.channel(), routing_key="out").publish({"n": 1})
        engine(c).on_poll()  # the claim goes out; the loop never reads its answer
        assert engine(c).busy
    assert got == []
    # Claimed (read_ct 1) and handed back at once, not after its lease.
    assert rows("SELECT read_ct, visible_at <= now() FROM {schema}.message") == [(1, True)]


@pytest.mark.parametrize(("threshold", "vacuuming"), [(10_000, True), (0, False)])
def test_a_consumer_vacuums_its_table_unless_told_not_to(
    broker_url: str, schema: str, hub: Hub, threshold: int, vacuuming: bool
) -> None:
    options = {"schema": schema, "vacuum_threshold": threshold}
    with Connection(broker_url, transport_options=options) as c:
        c.connect()
        consume(c, "v", prefetch=1)
        c.transport.register_with_event_loop(c.connection, hub)
        vacuumer = c.transport._vacuumer
        assert (vacuumer is not None and vacuumer.is_alive()) is vacuuming
        if vacuumer is not None:
            assert vacuumer.threshold == threshold
    if vacuumer is not None:
        vacuumer.join(5)
        assert not vacuumer.is_alive(), "closing the connection stops it"


def test_a_refill_waits_a_moment_for_more_free_slots(
    conn: Connection, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent, got = started(conn, hub, monkeypatch, "refill", prefetch=8, messages=40)
    turn_until(hub, lambda: len(got) == 8)  # an idle consumer claims its whole window
    assert (sent.claim, sent.acks_riding) == (1, 0)
    got[0].ack()
    hub.run_once()  # the ack's wake-up: one slot of eight free, seven still held
    assert sent.claim == 1, "a single free slot is not worth a claim yet"
    turn_until(hub, lambda: sent.claim > 1)  # ...a moment later it is
    assert (sent.claim, sent.acks_riding) == (2, 1)
    turn_until(hub, lambda: len(got) == 9 and not engine(conn).busy)
    # Half the window free: no waiting.
    for message in got[1:5]:
        message.ack()
    hub.run_once()
    assert (sent.claim, sent.acks_riding) == (3, 5)


def test_the_engine_counts_its_claims_time_and_those_sent_running_low(
    conn: Connection, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the broker benchmark reports per task: how long claims were out, and how
    # many were sent with the pool about to run dry (a quarter of the window or less).
    sent, got = started(conn, hub, monkeypatch, "counted", prefetch=8, messages=12)
    before = time.monotonic()
    turn_until(hub, lambda: len(got) == 8 and not engine(conn).busy)
    assert (sent.claim, sent.claims_low) == (1, 1)  # idle: nothing held
    assert 0 < sent.claim_seconds <= time.monotonic() - before
    for message in got[:4]:
        message.ack()
    turn_until(hub, lambda: len(got) == 12 and not engine(conn).busy)
    assert (sent.claim, sent.claims_low) == (2, 1)  # half the window still held
    out = sent.claim_seconds
    for message in got[4:]:
        message.ack()
    turn_until(hub, lambda: sent.claim == 3 and not engine(conn).busy)
    assert sent.claims_low == 2  # nothing held again
    assert sent.claim_seconds > out


def _claim_blocked_behind(
    conn: Connection, hub: Hub, rows: Peek, admin: psycopg.Connection[Any]
) -> None:
    """Put a claim on the wire that waits (in its ack) for a row ``admin`` holds locked:
    its snapshot is taken, its answer comes only once ``admin`` lets go."""
    transport = conn.transport
    [(ident,)] = rows(
        "INSERT INTO {schema}.message (queue, read_ct, lease, payload)"
        " VALUES ('elsewhere', 1, 1, '{{}}') RETURNING id"
    )
    admin.execute("BEGIN")
    admin.execute(f"SELECT 1 FROM {rows.schema}.message WHERE id = %s FOR UPDATE", [ident])
    transport.engine.ack(Lease(ident, 1, "elsewhere"))
    transport.engine.on_poll()
    assert transport.engine.busy
    rows.wait_for_lock(transport.engine.session.backend_pid, "the claim never waited for the lock")


def _wait_on_socket(conn: Connection, needle: bytes) -> None:
    """Until ``needle`` (a channel name) is in the consumer session's unread bytes."""
    with socket.socket(fileno=os.dup(engine(conn).session.fileno())) as sock:
        sock.settimeout(10)
        deadline = time.monotonic() + 10
        while needle not in sock.recv(1 << 16, socket.MSG_PEEK):
            assert time.monotonic() < deadline, "the notification never came"


def test_a_publish_behind_a_claim_in_flight_is_not_missed(
    broker_url: str, schema: str, hub: Hub, rows: Peek, pg_url: str
) -> None:
    # A claim's snapshot predates a publish and its short answer says "empty"; the
    # publish's NOTIFY comes right behind that answer on the socket and is read with it.
    options = {"schema": schema, "polling_interval": 60}
    with Connection(broker_url, transport_options=options) as c:
        c.connect()
        c.transport._ensure_renewer = lambda: None
        got = consume(c, "race", prefetch=2)
        producer = Producer(c.channel(), routing_key="race")
        for n in range(2):  # the first claim comes back full
            producer.publish({"n": n})
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until(hub, lambda: len(got) == 2 and not engine(c).busy)
        for message in got:
            message.ack()
        with psycopg.connect(pg_url, autocommit=True) as admin:
            _claim_blocked_behind(c, hub, rows, admin)
            with Connection(broker_url, transport_options=options) as other:
                Producer(other.channel(), routing_key="race").publish({"n": 2})
            admin.execute("ROLLBACK")
        _wait_on_socket(c, c.transport.store.channel("race").encode())
        turn_until(hub, lambda: len(got) == 3, timeout=10)  # the poll would take 60 s


@pytest.mark.parametrize("outcome", ["requeue", "reject"])
def test_a_requeue_or_reject_on_the_loop_s_thread_never_waits_for_postgres(
    conn: Connection,
    hub: Hub,
    rows: Peek,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    outcome: str,
) -> None:
    """Celery's prefork and solo pools decide a task's outcome in a callback the loop
    runs: the statement it needs lands off the loop's thread, so the loop turns on even
    while Postgres makes that statement wait (here: a row lock held elsewhere)."""
    _, got = started(conn, hub, monkeypatch, f"out-{outcome}", prefetch=1, messages=1)
    turn_until(hub, lambda: len(got) == 1)
    ident = got[0].delivery_info["pgq_token"][0]
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("BEGIN")
        admin.execute(f"SELECT 1 FROM {rows.schema}.message WHERE id = %s FOR UPDATE", [ident])
        # Should the loop wait for the lock, this breaks the wait after 10 s (and says so).
        turned, broke = threading.Event(), threading.Event()

        def breaker() -> None:
            if not turned.wait(10):
                broke.set()
                with psycopg.connect(pg_url, autocommit=True) as other:
                    other.execute("SELECT pg_terminate_backend(%s)", [admin.info.backend_pid])

        watchdog = threading.Thread(target=breaker)
        watchdog.start()
        hub.call_soon(getattr(got[0], outcome))
        hub.run_once()  # runs the callback on the loop's thread, then polls
        turned.set()
        watchdog.join()
        assert not broke.is_set(), "the loop waited for the locked row"
        # Still waiting for the lock, off the loop's thread: the row is untouched.
        assert rows("SELECT visible_at > now() FROM {schema}.message") == [(True,)]
        admin.execute("ROLLBACK")
    if outcome == "requeue":
        expected = "SELECT visible_at <= now() FROM {schema}.message"
    else:
        expected = "SELECT count(*) = 1 FROM {schema}.dead_letter"
    deadline = time.monotonic() + 10
    while rows(expected) != [(True,)]:
        assert time.monotonic() < deadline, f"the {outcome} never landed"
        time.sleep(0.02)
