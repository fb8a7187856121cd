"""Publish, consume, ack, requeue, purge: what every transport must do."""

from __future__ import annotations

from typing import Any

import kombu
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue


class BasicFunctionality:
    def test_connect(self, connection: Connection) -> None:
        assert connection.connected

    def test_publish_consume(self, connection: Connection) -> None:
        queue = Queue("basic", Exchange("basic"), "basic")
        got: list[Any] = []
        with Consumer(
            connection,
            [queue],
            accept=["json"],
            callbacks=[lambda body, msg: (got.append(body), msg.ack())],
        ):
            Producer(connection).publish(
                {"hello": 1}, exchange=queue.exchange, routing_key="basic", declare=[queue]
            )
            connection.drain_events(timeout=10)
        assert got == [{"hello": 1}]

    def test_simple_queue_fifo_and_size(self, connection: Connection) -> None:
        queue = connection.SimpleQueue("fifo")
        for n in range(5):
            queue.put({"n": n})
        assert queue.qsize() == 5
        got = []
        for _ in range(5):
            message = queue.get(timeout=10)
            got.append(message.payload["n"])
            message.ack()
        assert got == [0, 1, 2, 3, 4]
        assert queue.qsize() == 0
        queue.close()

    def test_requeue_redelivers(self, connection: Connection) -> None:
        queue = connection.SimpleQueue("requeue")
        queue.put({"n": 1})
        queue.get(timeout=10).requeue()
        again = queue.get(timeout=10)
        assert again.payload == {"n": 1}
        assert again.delivery_info.get("redelivered") or again._raw.get("redelivered")
        again.ack()
        queue.close()

    def test_purge_returns_count(self, connection: Connection) -> None:
        queue = connection.SimpleQueue("purge")
        for n in range(3):
            queue.put({"n": n})
        assert queue.clear() == 3
        assert queue.qsize() == 0
        queue.close()

    def test_passive_declare_of_a_missing_queue_fails(self, connection: Connection) -> None:
        with pytest.raises(kombu.exceptions.ChannelError, match="NOT_FOUND"):
            connection.default_channel.queue_declare("never-declared", passive=True)
