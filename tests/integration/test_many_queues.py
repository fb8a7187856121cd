"""One consumer of many queues: every message once, wake-ups of queues found empty, and
claims whose size does not grow with the number of queues."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from kombu import Connection, Consumer, Producer, Queue

from pg_transport.store import Store, claim_params
from tests.integration.conftest import Peek
from tests.integration.test_plans import generic_plan, walk

PREFETCH = 5


class Counting:
    """Wraps an engine's session: the queues each claim it sends names."""

    def __init__(self, engine: Any) -> None:
        self.claims: list[list[str]] = []
        self._send = engine.session.send
        engine.session.send = self.send

    def send(self, name: str, params: dict[str, Any]) -> None:
        if name in ("claim", "lean_claim"):
            self.claims.append(list(params["queues"]))
        self._send(name, params)


@contextlib.contextmanager
def consumer_of(
    broker_url: str, schema: str, queues: list[str], got: list[Any]
) -> Iterator[Connection]:
    """A consumer of ``queues`` (prefetch PREFETCH, acking each message into ``got``);
    the poll 60 s away: only a notification wakes it within a test."""
    options = {"schema": schema, "polling_interval": 60}
    with Connection(broker_url, transport_options=options) as conn:

        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            message.ack()

        consumer = Consumer(conn, [Queue(q, routing_key=q) for q in queues], callbacks=[on_message])
        consumer.qos(prefetch_count=PREFETCH)
        with consumer:
            yield conn


def drain(conn: Connection, got: list[Any], count: int) -> None:
    """Until ``count`` messages came, each within a wake-up's reach (10 s)."""
    while len(got) < count:
        conn.drain_events(timeout=10)


def until_waiting(conn: Connection) -> None:
    """Until the consumer found every queue empty and waits (a bound, not a delay)."""
    engine = conn.transport.engine
    deadline = time.monotonic() + 10
    while not engine.waiting:
        assert time.monotonic() < deadline, "the consumer never came to wait"
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.05)


def test_a_consumer_of_100_queues_gets_every_message_once_and_wakes_for_empty_ones(
    broker_url: str, schema: str, rows: Peek, conn: Connection
) -> None:
    # Uneven: one deep queue, 49 with one message each, 50 empty. A claim names a few
    # queues and takes a share of each: the deep one must not be taken for empty when
    # the claim comes back short.
    queues = [f"mq{n:03d}" for n in range(100)]
    for q in queues:
        Queue(q, routing_key=q)(conn.default_channel).declare()
    producer = Producer(conn)
    sent = [{"q": queues[0], "n": n} for n in range(30)]
    sent += [{"q": q, "n": 0} for q in queues[1:50]]
    for body in sent:
        producer.publish(body, routing_key=body["q"])
    got: list[Any] = []
    with consumer_of(broker_url, schema, queues, got) as consumer:
        counting = Counting(consumer.transport.engine)
        drain(consumer, got, len(sent))
        until_waiting(consumer)
        assert sorted(map(str, got)) == sorted(map(str, sent))  # each once
        # A queue the consumer found empty gets a message: its notification wakes it.
        late = {"q": queues[75], "n": 1}
        producer.publish(late, routing_key=late["q"])
        drain(consumer, got, len(sent) + 1)
        assert got[-1] == late
        assert counting.claims
        assert max(len(c) for c in counting.claims) <= PREFETCH
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_a_claim_names_no_more_queues_than_it_has_room_for(
    broker_url: str, schema: str, conn: Connection
) -> None:
    # 100 queues, each with a message: every claim asks PREFETCH queues, one message of
    # each (about PREFETCH rows locked, not PREFETCH of every queue).
    queues = [f"wide{n:03d}" for n in range(100)]
    for q in queues:
        Queue(q, routing_key=q)(conn.default_channel).declare()
    producer = Producer(conn)
    for q in queues:
        producer.publish({"q": q}, routing_key=q)
    got: list[Any] = []
    with consumer_of(broker_url, schema, queues, got) as consumer:
        counting = Counting(consumer.transport.engine)
        drain(consumer, got, len(queues))
        assert sorted(b["q"] for b in got) == queues
        assert counting.claims
        assert max(len(c) for c in counting.claims) <= PREFETCH
        # Each queue named about once: the rotation goes on where the last claim stopped.
        named = sum(len(c) for c in counting.claims)
        assert named <= 2 * len(queues)
        # Kicks after the first do not look up a wake-up channel per queue consumed.
        engine = consumer.transport.engine
        looked_up: list[str] = []
        lookup = engine.channel
        engine.channel = lambda q: looked_up.append(q) or lookup(q)
        claims = len(counting.claims)
        producer.publish({"q": queues[7]}, routing_key=queues[7])
        drain(consumer, got, len(queues) + 1)
        assert len(counting.claims) > claims
        assert looked_up == []


def test_a_claim_takes_a_share_of_each_queue_and_says_which_are_empty(store: Store) -> None:
    for n in range(5):
        store.publisher.publish("deep", {"n": n})
    store.publisher.publish("shallow", {"n": 0})
    claimed = store.claim(["deep", "shallow"], [30.0, 30.0], 4, per_queue=2)
    # Two of the deep queue (its share: it may hold more), one of the shallow (fewer
    # than its share: empty).
    assert sorted(c.queue for c in claimed) == ["deep", "deep", "shallow"]
    store.ack([c.token for c in claimed])
    rest = store.claim(["deep", "shallow"], [30.0, 30.0], 4)
    assert sorted(c.queue for c in rest) == ["deep", "deep", "deep"]


def locked_rows(plan: dict[str, Any]) -> int:
    """Rows the claim's candidate scans locked (every loop of every LockRows node)."""
    return sum(
        int(node["Actual Rows"] * node["Actual Loops"])
        for node in walk(plan)
        if node["Node Type"] == "LockRows"
    )


def test_a_claim_over_100_full_queues_locks_about_its_limit_of_rows(
    store: Store, peek: Peek
) -> None:
    # 100 queues of 20 ready messages each; a claim of 10 over all of them. Asking 10 of
    # each queue would lock 1,000 rows to take 10; a share of each locks one a queue.
    peek(
        "INSERT INTO {schema}.message (queue, payload)"
        " SELECT 'q' || (n %% 100), '{{}}' FROM generate_series(1, 2000) AS n"
    )
    peek("ANALYZE {schema}.message")
    queues = [f"q{n}" for n in range(100)]
    params = claim_params(queues, [30.0] * 100, 10, [5] * 100, [], per_queue=1)
    plan = generic_plan(store, "claim", params, analyze=True)
    assert locked_rows(plan) <= len(queues)
    assert plan["Actual Rows"] == 10


def test_over_deep_queues_a_claim_names_fewer_of_them(
    broker_url: str, schema: str, conn: Connection, rows: Peek
) -> None:
    # 20 queues of 10 messages each: the first claim (PREFETCH queues, one of each)
    # comes back full; the next ones name the square root of their room, each for a
    # larger share, and still drain every message once.
    queues = [f"deep{n:02d}" for n in range(20)]
    for q in queues:
        Queue(q, routing_key=q)(conn.default_channel).declare()
    rows(
        "INSERT INTO {schema}.message (queue, payload)"
        " SELECT q, json_build_object('body', '{{}}', 'content-type', 'application/json',"
        " 'content-encoding', 'utf-8', 'headers', '{{}}'::json, 'properties',"
        " json_build_object('delivery_tag', gen_random_uuid()::text, 'body_encoding',"
        " NULL, 'delivery_info', '{{}}'::json))"
        " FROM unnest(%s::text[]) AS q, generate_series(1, 10)",
        queues,
    )
    got: list[Any] = []
    with consumer_of(broker_url, schema, queues, got) as consumer:
        counting = Counting(consumer.transport.engine)
        drain(consumer, got, 200)
        until_waiting(consumer)
        assert len(got) == 200
        assert len(counting.claims[0]) == PREFETCH
        assert max(len(c) for c in counting.claims[1:5]) <= 2  # isqrt(PREFETCH)
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]
