"""Message TTL (queue x-message-ttl and per-message expiration) and queue expiry."""

from __future__ import annotations

import time

from kombu import Connection, Exchange, Producer, Queue


class MessageTTL:
    def test_queue_message_ttl(self, connection: Connection) -> None:
        queue = Queue("ttl-q", Exchange("ttl-q"), "ttl-q", message_ttl=0.2)
        queue(connection.default_channel).declare()
        Producer(connection).publish({"n": 1}, exchange=queue.exchange, routing_key="ttl-q")
        time.sleep(0.3)  # letting the TTL pass is the thing under test
        simple = connection.SimpleQueue(queue)
        try:
            message = simple.get(timeout=0.2)
        except simple.Empty:
            message = None
        assert message is None, "an expired message was delivered"

    def test_per_message_expiration(self, connection: Connection) -> None:
        queue = Queue("exp-q", Exchange("exp-q"), "exp-q")
        queue(connection.default_channel).declare()
        producer = Producer(connection)
        producer.publish(
            {"n": "short"}, exchange=queue.exchange, routing_key="exp-q", expiration=0.1
        )
        producer.publish({"n": "long"}, exchange=queue.exchange, routing_key="exp-q", expiration=60)
        time.sleep(0.2)  # letting the TTL pass is the thing under test
        simple = connection.SimpleQueue(queue)
        message = simple.get(timeout=2)
        assert message.payload == {"n": "long"}
        message.ack()
