"""Hand-off: a publish gives its message straight to a consumer that waits for one.

Consumers here are real consumer sessions (:class:`~pg_transport.session.Session`:
the advisory lock, the LISTEN on their own channel) driven statement by statement;
publishers are real connections. Where two transactions must overlap, the first is
held open by the test, and a statement that would wait for it fails fast on a
``lock_timeout`` instead of hanging.
"""

from __future__ import annotations

import json
import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from pg_transport import metrics
from pg_transport import status as status_report
from pg_transport.connection import Connector
from pg_transport.gate import HandoffGate
from pg_transport.session import Reply, Session
from pg_transport.store import (
    HANDOFF_LIMIT,
    Claimed,
    Store,
    Waiting,
    claim_params,
    decode_claimed,
    decode_handed,
    unwaited,
)
from tests.clock import Clock
from tests.integration.conftest import Peek
from tests.integration.test_event_loop import consume, sent_statements, turn_until

VT = 30.0
PAYLOAD = {"body": "{}", "content-type": "application/json", "headers": {}, "properties": {}}


class Consumer:
    """A consumer session that claims (and so comes to wait) when told to."""

    def __init__(self, pg_url: str, schema: str) -> None:
        self.connector = Connector(pg_url)
        self.session = Session(self.connector, schema, listen=True, prepare=True)
        self.session.open()
        self.seen = Reply()

    @property
    def token(self) -> int:
        assert self.session.token is not None
        return self.session.token

    @property
    def pid(self) -> int:
        conn = self.session._conn
        assert conn is not None
        return int(conn.info.backend_pid)

    def claim(self, queues: list[str], limit: int = 4, *, unwait: bool = False) -> list[Claimed]:
        """Claim as the hub does: waiting on ``queues`` if it comes back empty, or (with
        ``unwait``, as a consumer that waits already) stopping the wait if it does not."""
        waiting = (Waiting(self.token, unwait=True) if unwait
                   else Waiting(self.token, queues, [VT] * len(queues)))
        params = claim_params(queues, [VT] * len(queues), limit, None, [], waiting)
        self.session.send("claim", params)
        reply = self.session.finish(10.0, into=self.seen)
        assert reply is not None and reply.rows is not None
        self.unwaited = unwaited(reply.rows)
        return [decode_claimed(row) for row in reply.rows]

    def handed(self, count: int, timeout: float = 10.0) -> list[Claimed]:
        """Wait for ``count`` hand-offs in all."""
        deadline = time.monotonic() + timeout
        while len(self.seen.handed) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"{len(self.seen.handed)} of {count} hand-offs arrived"
            select.select([self.session.fileno()], [], [], left)
            self.seen.merge(self.session.read())
        return [decode_handed(text) for text in self.seen.handed]

    def round_trip(self) -> None:
        """Read whatever reached the session before a statement sent now."""
        self.session.send("ping", {})
        assert self.session.finish(10.0, into=self.seen) is not None

    def close(self) -> None:
        self.session.close()
        self.connector.close()


class Consumers:
    """Makes consumers on the test schema; closes them at the end of the test."""

    def __init__(self, pg_url: str, schema: str) -> None:
        self.pg_url, self.schema = pg_url, schema
        self.made: list[Consumer] = []

    def __call__(self) -> Consumer:
        self.made.append(Consumer(self.pg_url, self.schema))
        return self.made[-1]


@pytest.fixture
def consumers(pg_url: str, schema: str, store: Store) -> Iterator[Consumers]:
    made = Consumers(pg_url, schema)
    yield made
    for c in made.made:
        c.close()


@pytest.fixture
def consumer(consumers: Consumers) -> Consumer:
    return consumers()


def waiters(peek: Peek) -> list[tuple[Any, ...]]:
    return peek("SELECT consumer, queue FROM {schema}.waiter ORDER BY id")


def test_a_short_claim_waits_and_the_next_publish_is_handed_over(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    assert consumer.claim(["q"]) == []
    assert waiters(peek) == [(consumer.token, "q")]
    store.publish("q", {**PAYLOAD, "n": 1})
    [handed] = consumer.handed(1)
    assert (handed.queue, handed.read_ct, handed.payload["n"]) == ("q", 1, 1)
    # Leased to that consumer for its visibility timeout, as a claim would have.
    [(ident, read_ct, lease)] = peek(
        "SELECT id, read_ct, extract(epoch FROM visible_at - now()) FROM {schema}.message"
    )
    assert (ident, read_ct) == (handed.id, 1)
    assert VT - 5 < float(lease) <= VT
    # Its waiting row is used up, and nobody else can claim the message.
    assert waiters(peek) == []
    assert store.claim(["q"], [VT], 4) == []
    assert store.ack([(handed.id, handed.read_ct)]) == 1


def test_a_consumer_that_died_is_passed_over_and_swept(
    consumer: Consumer, store: Store, peek: Peek, pg_url: str
) -> None:
    consumer.claim(["q"])
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [consumer.pid])
    store.publish("q", PAYLOAD)
    # Ready for any consumer, not leased to a dead one.
    assert peek("SELECT read_ct, visible_at <= now() FROM {schema}.message") == [(0, True)]
    assert waiters(peek) == [(consumer.token, "q")]
    store.maintain([])
    assert waiters(peek) == []


def test_maintenance_keeps_the_waiters_of_live_consumers(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    consumer.claim(["q"])
    store.maintain([])
    assert waiters(peek) == [(consumer.token, "q")]


def test_status_counts_the_live_consumers_waiting_on_each_queue(
    consumers: Consumers, store: Store, pg_url: str
) -> None:
    first, dead, both = consumers(), consumers(), consumers()
    first.claim(["q"])
    dead.claim(["q"])
    both.claim(["q", "r"])

    def waiting() -> dict[str, int]:
        return {q.queue: q.waiting for q in status_report.collect(store).queues}

    # "r" is declared nowhere: a consumer waiting on it lists it all the same.
    assert waiting() == {"q": 3, "r": 1}
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [dead.pid])
    # Its row is still there until maintenance sweeps it, but it waits no more.
    assert waiting() == {"q": 2, "r": 1}
    # A hand-off ends the wait of the longest-waiting live consumer.
    store.publish("q", PAYLOAD)
    assert len(first.handed(1)) == 1
    report = status_report.collect(store)
    assert {q.queue: q.waiting for q in report.queues} == {"q": 1, "r": 1}
    [family] = [f for f in metrics.families(report) if f.name == "pgq_queue_waiting_consumers"]
    assert dict((labels["queue"], value) for labels, value in family.samples) == {"q": 1, "r": 1}


def test_longest_waiting_consumer_first(consumers: Consumers, store: Store) -> None:
    first, second = consumers(), consumers()
    first.claim(["q"])
    second.claim(["q"])
    store.publish("q", {**PAYLOAD, "n": 1})
    store.publish("q", {**PAYLOAD, "n": 2})
    assert [m.payload["n"] for m in first.handed(1)] == [1]
    assert [m.payload["n"] for m in second.handed(1)] == [2]


def test_only_an_empty_claim_waits_and_then_on_all_its_queues(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    store.publish("a", PAYLOAD)
    assert len(consumer.claim(["a", "b"])) == 1  # busy with it: no waiting
    assert waiters(peek) == []
    assert consumer.claim(["a", "b"]) == []
    assert waiters(peek) == [(consumer.token, "a"), (consumer.token, "b")]


def test_a_claim_that_brings_messages_stops_the_waiting(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    consumer.claim(["a", "b"])
    store.publish("c", PAYLOAD)  # not handed over: nobody waits on "c"
    assert len(consumer.claim(["c"], unwait=True)) == 1
    assert consumer.unwaited == 2
    assert waiters(peek) == []


def test_one_wait_one_handoff(consumer: Consumer, store: Store, peek: Peek) -> None:
    consumer.claim(["a", "b"])
    store.publish("a", PAYLOAD)
    assert len(consumer.handed(1)) == 1
    # The wait is over on every queue: the next message waits for a claim.
    store.publish("b", PAYLOAD)
    consumer.round_trip()
    assert len(consumer.seen.handed) == 1 and consumer.seen.notified == {"b"}
    assert peek("SELECT queue, read_ct FROM {schema}.message ORDER BY id") == [
        ("a", 1), ("b", 0)
    ]
    assert waiters(peek) == []



def test_publishes_that_keep_finding_nobody_waiting_pause_their_tries(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    clock = Clock()
    store.gate = HandoffGate(misses=3, pause=0.01, clock=clock)
    for n in range(3):  # a backlog builds: three tries in a row find nobody waiting
        store.publish("q", {**PAYLOAD, "n": n})
    taken = consumer.claim(["q"])
    assert store.ack([(m.id, m.read_ct) for m in taken]) == 3
    assert consumer.claim(["q"]) == []
    assert waiters(peek) == [(consumer.token, "q")]
    # Within the pause the publish does not try: the waiting consumer is woken instead,
    # and a claim takes the message. The publish key still makes a repeat a no-op.
    store.publish("q", {**PAYLOAD, "n": 3}, publish_key="k")
    store.publish("q", {**PAYLOAD, "n": 3}, publish_key="k")
    consumer.round_trip()
    assert consumer.seen.handed == [] and consumer.seen.notified == {"q"}
    assert peek("SELECT read_ct, publish_key FROM {schema}.message") == [(0, "k")]
    assert waiters(peek) == [(consumer.token, "q")]
    [claimed] = consumer.claim(["q"], unwait=True)
    assert claimed.payload["n"] == 3 and waiters(peek) == []
    # Once the pause is over the next publish tries, and hands over.
    assert consumer.claim(["q"]) == []
    clock.now += 0.01
    store.publish("q", {**PAYLOAD, "n": 4})
    [handed] = consumer.handed(1)
    assert handed.payload["n"] == 4 and waiters(peek) == []


def test_a_handoff_ends_the_streak_of_tries_that_found_nobody(
    consumer: Consumer, store: Store
) -> None:
    clock = Clock()
    store.gate = HandoffGate(misses=3, pause=0.01, clock=clock)
    for n in range(2):
        store.publish("q", {**PAYLOAD, "n": n})
    for _ in range(2):
        assert len(consumer.claim(["q"], limit=1)) == 1
    assert consumer.claim(["q"]) == []
    store.publish("q", {**PAYLOAD, "n": 2})  # the third try finds the consumer
    assert len(consumer.handed(1)) == 1
    # Two misses after it are not three in a row: the next publish tries again.
    for n in range(3, 5):
        store.publish("q", {**PAYLOAD, "n": n})
    for _ in range(2):
        assert len(consumer.claim(["q"], limit=1)) == 1
    assert consumer.claim(["q"]) == []
    store.publish("q", {**PAYLOAD, "n": 5})
    assert [m.payload["n"] for m in consumer.handed(2)] == [2, 5]


@pytest.mark.parametrize("second_queue", ["a", "b"])
def test_a_consumer_being_handed_a_message_is_not_taken_twice(
    consumer: Consumer, store: Store, peek: Peek, pg_url: str, second_queue: str
) -> None:
    consumer.claim(["a", "b"])
    with psycopg.connect(pg_url, autocommit=True) as first, psycopg.connect(
        pg_url, autocommit=True
    ) as second:
        second.execute("SET lock_timeout TO '2s'")
        with first.transaction():
            store.publish_on(first, "a", PAYLOAD, handoff=True)  # takes the consumer
            # The same queue or another it waits on: passed over, without waiting.
            store.publish_on(second, second_queue, PAYLOAD, handoff=True)
    consumer.handed(1)
    consumer.round_trip()
    assert len(consumer.seen.handed) == 1
    assert peek("SELECT queue, read_ct FROM {schema}.message ORDER BY id") == [
        ("a", 1), (second_queue, 0)
    ]
    assert waiters(peek) == []


def test_a_claim_stopping_the_wait_learns_of_a_handoff_under_way(
    consumer: Consumer, store: Store, peek: Peek, pg_url: str
) -> None:
    consumer.claim(["q"])
    store.publish("other", PAYLOAD)  # not handed over: nobody waits on "other"
    with psycopg.connect(pg_url, autocommit=True) as publisher:
        publisher.execute("BEGIN")
        store.publish_on(publisher, "q", PAYLOAD, handoff=True)  # takes the consumer
        claimed: list[Claimed] = []
        claiming = threading.Thread(
            target=lambda: claimed.extend(consumer.claim(["other"], limit=1, unwait=True)))
        claiming.start()
        # The claim waits for the publisher's rows rather than pass them by.
        peek.wait_for_lock(consumer.pid, "the claim never waited for the publisher")
        publisher.execute("COMMIT")
        claiming.join(10)
    assert len(claimed) == 1
    # None of its rows were left to delete: the hand-off was committed, and follows.
    assert consumer.unwaited == 0
    assert [m.queue for m in consumer.handed(1)] == ["q"]


def test_a_session_waits_for_a_handoff_it_knows_is_committed(
    consumer: Consumer, store: Store
) -> None:
    consumer.claim(["q"])
    store.publish("q", PAYLOAD)
    reply = Reply()
    consumer.session.await_handed(10.0, into=reply)
    assert [decode_handed(text).queue for text in reply.handed] == ["q"]


def test_a_message_too_large_for_a_notify_waits_for_a_claim(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    consumer.claim(["q"])
    store.publish("q", {**PAYLOAD, "body": "x" * HANDOFF_LIMIT})
    assert peek("SELECT read_ct FROM {schema}.message") == [(0,)]
    assert waiters(peek) == [(consumer.token, "q")]
    consumer.round_trip()
    assert consumer.seen.handed == [] and consumer.seen.notified == {"q"}


def test_the_longest_message_that_fits_is_handed_over(
    consumer: Consumer, store: Store
) -> None:
    queue = "q\x01"  # JSON escapes a control character in 6 bytes: the worst case
    consumer.claim([queue])
    frame = len(json.dumps({**PAYLOAD, "body": ""}))
    body = "x" * (HANDOFF_LIMIT - 64 - 6 * len(queue) - frame)
    store.publish(queue, {**PAYLOAD, "body": body})
    [handed] = consumer.handed(1)
    assert handed.payload["body"] == body


def test_a_delayed_message_is_not_handed_over(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    consumer.claim(["q"])
    store.publish("q", PAYLOAD, delay=60)
    assert peek("SELECT read_ct FROM {schema}.message") == [(0,)]
    assert waiters(peek) == [(consumer.token, "q")]


def test_a_publish_inside_a_larger_transaction_is_not_handed_over(
    consumer: Consumer, store: Store, peek: Peek, pg_url: str
) -> None:
    # The barrier publishes its callback in its own transaction: a lease counted from
    # the insert could lapse before that transaction commits.
    consumer.claim(["q"])
    with psycopg.connect(pg_url, autocommit=True) as conn, conn.transaction():
        store.publish_on(conn, "q", PAYLOAD)
    assert peek("SELECT read_ct FROM {schema}.message") == [(0,)]
    assert waiters(peek) == [(consumer.token, "q")]


def test_a_routed_publish_to_one_queue_is_handed_over(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    store.declare_exchange("tasks", "direct")
    store.bind("tasks", "q", "k", "")
    consumer.claim(["q"])
    assert store.publish_routed("tasks", "k", PAYLOAD, publish_tag="t1") == ("direct", 1)
    assert [m.queue for m in consumer.handed(1)] == ["q"]
    assert peek("SELECT read_ct FROM {schema}.message") == [(1,)]


def test_a_routed_publish_to_several_queues_is_not_handed_over(
    consumer: Consumer, store: Store, peek: Peek
) -> None:
    # Copies for two queues one consumer waits on would be two hand-offs for one wait.
    store.declare_exchange("fan", "fanout")
    for queue in ("one", "two"):
        store.bind("fan", queue, "", "")
    consumer.claim(["one", "two"])
    assert store.publish_routed("fan", "", PAYLOAD, publish_tag="t1") == ("fanout", 2)
    consumer.round_trip()
    assert consumer.seen.handed == [] and consumer.seen.notified == {"one", "two"}
    assert peek("SELECT queue, read_ct FROM {schema}.message ORDER BY queue") == [
        ("one", 0), ("two", 0)
    ]
    assert len(waiters(peek)) == 2


# -- the consumer inside the event loop ---------------------------------------------


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


def test_an_idle_consumer_starts_the_task_without_a_claim(
    conn: Connection, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch, broker_url: str,
    schema: str,
) -> None:
    monkeypatch.setattr(conn.transport, "_ensure_renewer", lambda: None)
    sent = sent_statements(conn, monkeypatch)
    got = consume(conn, "idle", prefetch=4)
    transport = conn.transport
    transport.register_with_event_loop(conn.connection, hub)
    turn_until_waiting(hub, transport, "idle")
    claims = len(sent)
    with Connection(broker_url, transport_options={"schema": schema}) as other:
        Producer(other.channel(), routing_key="idle").publish({"n": 1})
    delivered_after: list[int] = []
    real = transport.deliver

    def deliver(payload: dict[str, Any], queue: str) -> None:
        delivered_after.append(len(sent))
        real(payload, queue)

    monkeypatch.setattr(transport, "deliver", deliver)
    turn_until(hub, lambda: len(got) == 1)
    assert delivered_after == [claims], "a statement went out before the delivery"
    assert got[0].payload == {"n": 1} and got[0].delivery_info["pgq_token"][1] == 1
    got[0].ack()
    turn_until(hub, lambda: rows("SELECT count(*) FROM {schema}.message") == [(0,)])


def turn_until_waiting(hub: Hub, transport: Any, queue: str) -> None:
    """Until the consumer ``transport`` runs on ``hub`` waits on ``queue``, idle, with no
    statement out."""
    consuming = transport.hub
    turn_until(hub, lambda: queue in consuming.waiting and not consuming.session.busy)


@contextmanager
def idle_consumer(broker_url: str, schema: str, hub: Hub, queue: str) -> Iterator[Connection]:
    """A kombu consumer of ``queue`` on ``hub``, waiting (idle) with no statement out;
    the connection closes (the consumer leaves) at the end of the block."""
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()
        c.transport._ensure_renewer = lambda: None
        consume(c, queue, prefetch=4)
        c.transport.register_with_event_loop(c.connection, hub)
        turn_until_waiting(hub, c.transport, queue)
        yield c


def test_a_consumer_leaving_gives_back_what_was_just_handed_to_it(
    broker_url: str, schema: str, hub: Hub, rows: Peek
) -> None:
    with idle_consumer(broker_url, schema, hub, "leaving"):
        with Connection(broker_url, transport_options={"schema": schema}) as other:
            Producer(other.channel(), routing_key="leaving").publish({"n": 1})
        assert rows("SELECT read_ct FROM {schema}.message") == [(1,)]
    # The loop never read the hand-off: closing read it and gave the message back.
    assert rows("SELECT read_ct, visible_at <= now() FROM {schema}.message") == [(1, True)]
    assert rows("SELECT count(*) FROM {schema}.waiter") == [(0,)]


def test_a_consumer_leaving_while_a_publisher_hands_over_gives_that_back_too(
    broker_url: str, schema: str, hub: Hub, rows: Peek, pg_url: str
) -> None:
    with idle_consumer(broker_url, schema, hub, "racing") as c:
        session = c.transport.hub.session
        backend = session._conn.info.backend_pid
        store = c.transport.store
        with psycopg.connect(pg_url, autocommit=True) as publisher:
            publisher.execute("BEGIN")
            store.publish_on(publisher, "racing", PAYLOAD, handoff=True)
            leaving = threading.Thread(target=c.transport.hub.unregister)
            leaving.start()
            # Step on only once the consumer's unwait waits for the publisher's row.
            rows.wait_for_lock(backend, "unwait never waited for the publisher")
            assert leaving.is_alive()
            publisher.execute("COMMIT")
            leaving.join(10)
            assert not leaving.is_alive()
    assert rows("SELECT read_ct, visible_at <= now() FROM {schema}.message") == [(1, True)]


def test_a_consumer_leaving_waits_for_a_handoff_notify_that_lags_its_commit(
    broker_url: str, schema: str, hub: Hub, rows: Peek, pg_url: str
) -> None:
    """A publisher's NOTIFY goes out after its locks are released: the consumer's
    unwait can answer before it. Rows gone that the consumer did not delete say a
    hand-off is committed; leaving waits for it and gives the message back."""
    with idle_consumer(broker_url, schema, hub, "lagging") as c:
        session = c.transport.hub.session
        backend = session._conn.info.backend_pid
        with psycopg.connect(pg_url, autocommit=True) as publisher:
            # The hand-off's commit, its NOTIFY held back by the test.
            with publisher.transaction():
                publisher.execute(f"DELETE FROM {schema}.waiter WHERE consumer = %s",
                                  (session.token,))
                handoff = publisher.execute(
                    f"INSERT INTO {schema}.message (queue, visible_at, read_ct, payload)"
                    " VALUES ('lagging', clock_timestamp() + interval '30 s', 1, %s)"
                    " RETURNING json_build_array(id, queue, priority, payload)::text",
                    (json.dumps(PAYLOAD),)).fetchone()
            assert handoff is not None
            leaving = threading.Thread(target=c.transport.hub.unregister)
            leaving.start()
            rows.wait_for_backend(backend, "state = 'idle' AND query LIKE '%%gone%%'",
                                  "the consumer never left its waiting")
            assert leaving.is_alive(), "left without the hand-off it was taken for"
            publisher.execute("SELECT pg_notify(%s, %s)",
                              (session._handoff_channel, handoff[0]))
            leaving.join(10)
            assert not leaving.is_alive()
    assert rows("SELECT read_ct, visible_at <= now() FROM {schema}.message") == [(1, True)]


def test_a_message_handed_for_a_queue_no_longer_consumed_is_given_back(
    conn: Connection, hub: Hub, rows: Peek, broker_url: str, schema: str
) -> None:
    conn.transport._ensure_renewer = lambda: None
    queue = Queue("gone", Exchange("gone"), "gone")
    got: list[Any] = []
    consumer = kombu.Consumer(conn.channel(), [queue], callbacks=[lambda _b, m: got.append(m)])
    consumer.consume()
    transport = conn.transport
    transport.register_with_event_loop(conn.connection, hub)
    turn_until_waiting(hub, transport, "gone")
    consumer.cancel()
    with Connection(broker_url, transport_options={"schema": schema}) as other:
        Producer(other.channel(), exchange=queue.exchange, routing_key="gone").publish({"n": 1})
    turn_until(hub, lambda: rows("SELECT visible_at <= now() FROM {schema}.message")
               == [(True,)])
    assert got == []


def _handoff_behind_a_claim(
    conn: Connection, hub: Hub, rows: Peek, pg_url: str, queue: str
) -> list[Any]:
    """A consumer of ``queue`` waiting; a message there falls due; a publisher takes the
    consumer while the claim for that message stops its waiting. Returns deliveries;
    the loop has not read the answer yet."""
    transport = conn.transport
    got = consume(conn, queue, prefetch=4)
    transport.register_with_event_loop(conn.connection, hub)
    session = transport.hub.session
    turn_until_waiting(hub, transport, queue)
    store = transport.store
    store.publish(queue, {**PAYLOAD, "body": json.dumps({"n": "due"})}, delay=60)
    rows("UPDATE {schema}.message SET visible_at = now()")  # fell due: for a claim
    with psycopg.connect(pg_url, autocommit=True) as publisher:
        publisher.execute("BEGIN")
        store.publish_on(publisher, queue, {**PAYLOAD, "body": json.dumps({"n": "handed"})},
                         handoff=True)
        transport.drain.exhausted.clear()
        transport.hub.kick()  # the claim that stops the wait, behind the publisher
        rows.wait_for_lock(session._conn.info.backend_pid,
                           "the claim never waited for the publisher")
        publisher.execute("COMMIT")
    return got


def handed_id(rows: Peek) -> int:
    [(ident,)] = rows(
        "SELECT id FROM {schema}.message WHERE payload->>'body' LIKE '%%handed%%'")
    return int(ident)


def test_a_handoff_under_way_is_leased_before_anything_is_delivered(
    conn: Connection, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    # A delivery may run its task inline (the solo pool) and block the loop for longer
    # than a lease: a message handed over meanwhile must already be renewed by then.
    transport = conn.transport
    monkeypatch.setattr(transport, "_ensure_renewer", lambda: None)
    held_at_delivery: list[set[int]] = []
    real = transport.deliver

    def deliver(payload: dict[str, Any], queue: str) -> None:
        held_at_delivery.append({ident for ident, _, _ in transport.held()})
        real(payload, queue)

    monkeypatch.setattr(transport, "deliver", deliver)
    got = _handoff_behind_a_claim(conn, hub, rows, pg_url, "inline")
    turn_until(hub, lambda: len(got) == 2)
    assert [m.payload["n"] for m in got] == ["due", "handed"]
    assert handed_id(rows) in held_at_delivery[0], "handed, yet not leased at the first delivery"


def test_a_handoff_is_given_back_when_the_delivery_before_it_fails(
    conn: Connection, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    transport = conn.transport
    monkeypatch.setattr(transport, "_ensure_renewer", lambda: None)

    def deliver(payload: dict[str, Any], queue: str) -> None:
        raise RuntimeError("the consumer broke")

    monkeypatch.setattr(transport, "deliver", deliver)
    _handoff_behind_a_claim(conn, hub, rows, pg_url, "broken")
    with pytest.raises(RuntimeError, match="the consumer broke"):
        turn_until(hub, lambda: False)
    ident = handed_id(rows)
    # Visible again at once rather than leased to a consumer that will never deliver it.
    assert rows("SELECT read_ct, visible_at <= now() FROM {schema}.message WHERE id = %s",
                ident) == [(1, True)]
    assert ident not in {i for i, _, _ in transport.held()}


def test_after_a_handoff_the_next_claim_waits_for_the_ack(
    broker_url: str, schema: str, hub: Hub, rows: Peek, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The handed task starts with the process to itself; the claim that begins the
    # next wait rides on its ack.
    options = {"schema": schema, "polling_interval": 60}
    with Connection(broker_url, transport_options=options) as c:
        c.connect()
        monkeypatch.setattr(c.transport, "_ensure_renewer", lambda: None)
        sent = sent_statements(c, monkeypatch)
        got = consume(c, "acked", prefetch=4)
        transport = c.transport
        transport.register_with_event_loop(c.connection, hub)
        turn_until_waiting(hub, transport, "acked")
        with Connection(broker_url, transport_options=options) as other:
            Producer(other.channel(), routing_key="acked").publish({"n": 1})
        before = len(sent)
        turn_until(hub, lambda: len(got) == 1)
        assert len(sent) == before and not transport.hub.session.busy
        got[0].ack()
        turn_until(hub, lambda: "acked" in transport.hub.waiting)
        token = got[0].delivery_info["pgq_token"][0]
        assert sent[before:] == [("claim", [token])]
        assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]
