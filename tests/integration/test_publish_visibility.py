"""A consumer is handed only committed messages: never one whose publish can still fail.

A publish's row is claimable once its transaction has committed (durably, with
``durable_publish`` on: Postgres makes a commit visible after its WAL flush), and the
wake-up is sent after that commit. Here a consumer is made to claim while a publish is
in flight, in a batch whose transaction is still open, and that batch then fails: the
consumer never sees the message. A consumer may well have a message before the
producer's call returns (the producer still has the commit's answer to read); what it
has then can no longer be taken back. A commit whose answer is lost is retried under the
same publish key (tests/integration/test_faults.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

import pg_transport
from pg_transport.sql import queue_channel
from tests.integration.conftest import Peek


class Failed(Exception):
    """What makes the producer's batch fail after its publish was sent."""


class Idle:
    """A consumer of one queue, draining events in a thread, that can be made to claim."""

    def __init__(self, conn: Connection, queue: Queue, peek: Peek, schema: str) -> None:
        self.conn, self.queue, self.peek, self.schema = conn, queue, peek, schema
        self.got: list[Any] = []
        self.consumer = Consumer(
            conn, [queue], accept=["json"], callbacks=[lambda b, m: (self.got.append(b), m.ack())]
        )
        self.consumer.consume()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain)
        self.thread.start()
        self._until_waiting()

    def _drain(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)

    def _until_waiting(self) -> None:
        deadline = time.monotonic() + 10
        while not self.conn.transport.engine.waiting:
            assert time.monotonic() < deadline, "the consumer never came to wait"
            time.sleep(0.005)

    def claim_now(self) -> None:
        """Wake the consumer (a notification of our own) and return once its claim has
        been answered and it waits again."""
        engine = self.conn.transport.engine
        before = engine.statements.claim
        self.peek("SELECT pg_notify(%s, '')", queue_channel(self.schema, self.queue.name))
        deadline = time.monotonic() + 10
        while engine.statements.claim == before or not engine.waiting:
            assert time.monotonic() < deadline, "the woken consumer never claimed"
            time.sleep(0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def idle(broker_url: str, schema: str, rows: Peek, conn: Connection) -> Iterator[Idle]:
    queue = Queue("vis", Exchange("vis"), "vis")
    queue(conn.default_channel).declare()
    with Connection(broker_url, transport_options={"schema": schema}) as consumer_conn:
        consumer = Idle(consumer_conn, queue, rows, schema)
        try:
            yield consumer
        finally:
            consumer.close()


def test_a_publish_that_fails_after_its_insert_is_never_delivered(
    conn: Connection, rows: Peek, idle: Idle
) -> None:
    producer = Producer(conn, exchange=Exchange(""))
    with pytest.raises(Failed), pg_transport.batch():
        producer.publish({"n": "never"}, routing_key="vis")
        # The row is inserted, its transaction open: a claim now must not see it.
        idle.claim_now()
        assert idle.got == []
        raise Failed
    idle.claim_now()
    assert idle.got == []
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_a_publish_is_delivered_once_it_has_committed(
    conn: Connection, rows: Peek, idle: Idle
) -> None:
    producer = Producer(conn, exchange=Exchange(""))
    with pg_transport.batch():
        producer.publish({"n": "later"}, routing_key="vis")
        idle.claim_now()
        assert idle.got == []
    deadline = time.monotonic() + 10
    while not idle.got:  # woken by the publish's own wake-up, sent after its commit
        assert time.monotonic() < deadline, "the committed message was never delivered"
        time.sleep(0.005)
    assert idle.got == [{"n": "later"}]
