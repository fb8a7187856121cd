"""Queue and exchange names are data, never SQL: odd names work end to end (real Postgres).

Quotes, spaces, unicode, very long names and names that look like SQL injection go
through kombu's SimpleQueue (put/get/ack/requeue/qsize/purge), through a direct
exchange bound to such a queue, and through LISTEN/NOTIFY wake-ups; afterwards the
message table still exists and holds exactly the rows the test left there.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql

from tests.acceptance.harness import wait_for

SCHEMA_PLACEHOLDER = "<schema>"

NAMES: dict[str, str] = {
    "single-quote": "it's",
    "double-quote": 'say "hi"',
    "spaces": "  with   spaces ",
    "unicode": "очередь ✓",
    "emoji-and-cjk": "队列 🚀 キュー",
    "long": "long-" + "q" * 200 + "-ä" * 40,
    "drop-table": "x'); DROP TABLE message; --",
    "drop-schema": f"'\"; DROP SCHEMA {SCHEMA_PLACEHOLDER} CASCADE; --",
    "format-chars": "%(queue)s %s %% {schema} {0}",
    "backslashes": "a\\b\\'c\\\\",
    "dots-dashes": "my.queue-1",
}


def real_name(name: str, schema: str) -> str:
    """Injection-looking names aim at the test's own schema, the one that must survive."""
    return name.replace(SCHEMA_PLACEHOLDER, schema)


class Peek:
    """Direct SQL on the test schema, as the superuser, behind kombu's back."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self.conn = conn
        self.schema = schema

    def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        text = sql.SQL(query).format(schema=sql.Identifier(self.schema))
        return self.conn.execute(text, params).fetchall()

    def tables_intact(self) -> bool:
        found = self.rows(
            "SELECT to_regclass(%s), to_regclass(%s), to_regclass(%s)",
            f"{self.schema}.message",
            f"{self.schema}.queue",
            f"{self.schema}.dead_letter",
        )
        return all(value is not None for value in found[0])

    def messages(self) -> list[tuple[str, Any]]:
        """(queue, decoded body) of every stored message, in arrival order."""
        return [
            (queue, json.loads(payload["body"]))
            for queue, payload in self.rows(
                "SELECT queue, payload FROM {schema}.message ORDER BY id"
            )
        ]


@pytest.fixture
def peek(pg_url: str, schema: str, conn: Connection) -> Iterator[Peek]:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        yield Peek(admin, schema)


def body(message: Any) -> dict[str, Any]:
    payload = message.payload
    assert isinstance(payload, dict)
    return payload


@pytest.mark.parametrize("key", list(NAMES))
def test_simple_queue_round_trip(conn: Connection, peek: Peek, schema: str, key: str) -> None:
    name = real_name(NAMES[key], schema)
    queue = conn.SimpleQueue(name)
    try:
        for i in range(3):
            queue.put({"name": name, "i": i})
        assert queue.qsize() == 3

        first = queue.get_nowait()
        assert body(first) == {"name": name, "i": 0}
        assert first.delivery_info["pgq_queue"] == name
        first.ack()
        assert queue.qsize() == 2

        second = queue.get_nowait()
        assert body(second) == {"name": name, "i": 1}
        second.requeue()
        assert queue.qsize() == 2

        again = queue.get_nowait()
        assert body(again) == {"name": name, "i": 1}
        assert again.delivery_info["redelivered"] is True, "second delivery of the same row"
        assert again.delivery_info["pgq_token"][1] == 3  # claimed, released, claimed
        again.ack()
        assert queue.qsize() == 1

        queue.put({"name": name, "i": 3})
        assert queue.clear() == 2
        assert queue.qsize() == 0

        queue.put({"name": name, "i": "kept"})
    finally:
        queue.close()

    assert peek.tables_intact()
    assert peek.messages() == [(name, {"name": name, "i": "kept"})]
    assert peek.rows("SELECT name FROM {schema}.queue") == [(name,)]


@pytest.mark.parametrize("key", list(NAMES))
def test_consumer_get_with_prefetch(conn: Connection, peek: Peek, schema: str, key: str) -> None:
    """The consuming path (basic_consume + drain_events) with one prefetch slot."""
    name = real_name(NAMES[key], schema)
    queue = conn.SimpleQueue(name)
    try:
        queue.consumer.qos(prefetch_count=1)
        queue.put({"i": 1})
        queue.put({"i": 2})
        message = queue.get(timeout=10)
        assert body(message) == {"i": 1}
        assert queue.qsize() == 1, "one prefetch slot claims one message"
        message.ack()
        message = queue.get(timeout=10)
        assert body(message) == {"i": 2}
        message.ack()
        assert queue.qsize() == 0
    finally:
        queue.close()
    assert peek.tables_intact()
    assert peek.messages() == []


def test_all_names_side_by_side(conn: Connection, peek: Peek, schema: str) -> None:
    """Odd names never collide or leak into each other's queues."""
    names = [real_name(n, schema) for n in NAMES.values()]
    queues = [conn.SimpleQueue(n) for n in names]
    try:
        for name, queue in zip(names, queues, strict=True):
            queue.put({"for": name})
        for name, queue in zip(names, queues, strict=True):
            assert queue.qsize() == 1
            message = queue.get_nowait()
            assert body(message) == {"for": name}
            message.ack()
    finally:
        for queue in queues:
            queue.close()
    assert peek.tables_intact()
    assert peek.messages() == []
    assert sorted(r[0] for r in peek.rows("SELECT name FROM {schema}.queue")) == sorted(names)


@pytest.mark.parametrize(
    ("exchange_key", "queue_key", "routing_key"),
    [
        ("drop-table", "drop-schema", "unicode"),
        ("drop-schema", "single-quote", "drop-table"),
        ("unicode", "long", "format-chars"),
        ("double-quote", "spaces", "backslashes"),
    ],
)
def test_direct_exchange_with_odd_names(
    conn: Connection,
    peek: Peek,
    schema: str,
    exchange_key: str,
    queue_key: str,
    routing_key: str,
) -> None:
    exchange_name = real_name(NAMES[exchange_key], schema)
    queue_name = real_name(NAMES[queue_key], schema)
    key = real_name(NAMES[routing_key], schema)
    exchange = Exchange(exchange_name, type="direct")
    bound = Queue(queue_name, exchange=exchange, routing_key=key)
    with conn.channel() as channel:
        bound(channel).declare()
        producer = Producer(channel)
        producer.publish({"via": exchange_name}, exchange=exchange, routing_key=key)
        producer.publish({"via": "second"}, exchange=exchange, routing_key=key)

    assert peek.messages() == [
        (queue_name, {"via": exchange_name}),
        (queue_name, {"via": "second"}),
    ]

    consumer = conn.SimpleQueue(bound)
    try:
        assert consumer.qsize() == 2
        message = consumer.get_nowait()
        assert body(message) == {"via": exchange_name}
        assert message.delivery_info["exchange"] == exchange_name
        assert message.delivery_info["routing_key"] == key
        message.ack()
        assert consumer.clear() == 1
        assert consumer.qsize() == 0
    finally:
        consumer.close()
    assert peek.tables_intact()
    assert peek.messages() == []


@pytest.mark.parametrize("key", ["drop-table", "unicode", "long", "double-quote"])
def test_waiting_consumer_is_woken_by_a_publish(
    broker_url: str, peek: Peek, schema: str, key: str
) -> None:
    """The odd name's channel (a digest of it: the NOTIFY carries nothing) wakes the
    consumer; a long polling interval rules out the poll."""
    name = real_name(NAMES[key], schema)
    received: list[Any] = []
    failed: list[BaseException] = []
    options = {"schema": schema, "polling_interval": 120}
    connection = Connection(broker_url, transport_options=options)
    # Made here, before the consumer thread: kombu creates a connection's transport on
    # first use without a lock, and two threads racing there would watch two of them.
    transport = connection.transport

    def consume() -> None:
        try:
            queue = connection.SimpleQueue(name)
            message = queue.get(timeout=60)
            received.append(body(message))
            message.ack()
            queue.close()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    try:
        # The consumer LISTENs before its first claim, which finds nothing: from here
        # on, only a wake-up (or the 120 s poll) can deliver the message.
        wait_for(
            lambda: transport.engine.waiting or not thread.is_alive(),
            30,
            "the consumer to wait",
        )
        with Connection(broker_url, transport_options=options) as publisher:
            publisher.SimpleQueue(name).put({"woke": name})
        thread.join(30)
    finally:
        connection.release()
    assert not thread.is_alive(), "the consumer was not woken within 30 s"
    assert failed == []
    assert received == [{"woke": name}]
    assert peek.messages() == []


def test_a_queue_name_over_the_limit_is_refused_by_name(conn: Connection, peek: Peek) -> None:
    name = "é" * 600  # 1200 bytes
    with pytest.raises(ValueError, match="queue name of 1200 bytes is too long for pgq"):
        conn.SimpleQueue(name)
    with pytest.raises(ValueError, match="too long"):
        Producer(conn).publish({"x": 1}, routing_key=name)
    assert peek.rows("SELECT count(*) FROM {schema}.message") == [(0,)]
    assert peek.tables_intact()
