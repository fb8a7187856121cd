"""Direct, topic and fanout routing, seen from two separate connections."""

from __future__ import annotations

from typing import Any

import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import ChannelError


def drain(connection: Connection, queue: Queue, limit: int = 20) -> list[Any]:
    simple = connection.SimpleQueue(queue)
    out = []
    while len(out) < limit:
        try:
            message = simple.get(timeout=0.5)
        except simple.Empty:
            break
        out.append(message.payload)
        message.ack()
    return out


class ExchangeTypes:
    """A binding made on one connection routes what another publishes."""

    def test_direct(self, connection: Connection, other_connection: Connection) -> None:
        exchange = Exchange("ex.direct", "direct")
        a = Queue("direct-a", exchange, "a")
        b = Queue("direct-b", exchange, "b")
        for q in (a, b):
            q(connection.default_channel).declare()
        producer = Producer(other_connection)
        producer.publish({"to": "a"}, exchange=exchange, routing_key="a")
        producer.publish({"to": "b"}, exchange=exchange, routing_key="b")
        assert drain(connection, a) == [{"to": "a"}]
        assert drain(connection, b) == [{"to": "b"}]

    def test_topic(self, connection: Connection, other_connection: Connection) -> None:
        exchange = Exchange("ex.topic", "topic")
        everything = Queue("topic-all", exchange, "#")
        stock = Queue("topic-stock", exchange, "stock.*")
        for q in (everything, stock):
            q(connection.default_channel).declare()
        producer = Producer(other_connection)
        producer.publish({"k": "stock.usd"}, exchange=exchange, routing_key="stock.usd")
        producer.publish({"k": "news.x"}, exchange=exchange, routing_key="news.x")
        assert drain(connection, everything) == [{"k": "stock.usd"}, {"k": "news.x"}]
        assert drain(connection, stock) == [{"k": "stock.usd"}]

    def test_topic_wildcards_stand_for_words_and_other_words_for_themselves(
        self, connection: Connection, other_connection: Connection
    ) -> None:
        exchange = Exchange("ex.topic.words", "topic")
        keys = {
            "topic-a-any": "a.#",
            "topic-dollar": "price.$",
            "topic-alt": "x|y.*",
            "topic-class": "[ab]+.#",
            "topic-one": "*",
        }
        queues = {name: Queue(name, exchange, key) for name, key in keys.items()}
        for q in queues.values():
            q(connection.default_channel).declare()
        producer = Producer(other_connection)
        for key in ["a", "a.b.c", "ab", "price.$", "price.x", "x|y.z", "x.z", "[ab]+", "aa.b"]:
            producer.publish({"k": key}, exchange=exchange, routing_key=key)
        got = {name: [m["k"] for m in drain(connection, q)] for name, q in queues.items()}
        assert got == {
            "topic-a-any": ["a", "a.b.c"],  # '#' is zero or more words
            "topic-dollar": ["price.$"],  # '$', '|', '[ab]+' are plain characters
            "topic-alt": ["x|y.z"],
            "topic-class": ["[ab]+"],
            "topic-one": ["a", "ab", "[ab]+"],
        }

    def test_a_topic_key_that_is_no_amqp_pattern_is_refused_and_routing_goes_on(
        self, connection: Connection, other_connection: Connection
    ) -> None:
        exchange = Exchange("ex.topic.bad", "topic")
        good = Queue("topic-good", exchange, "stock.*")
        good(connection.default_channel).declare()
        bad = Queue("topic-bad", exchange, "stock.a**")
        with pytest.raises(ChannelError) as info:
            bad(connection.default_channel).declare()
        message = str(info.value)
        assert "PRECONDITION_FAILED" in message and "'stock.a**'" in message
        assert "word 'a**' mixes a wildcard with other characters" in message
        # Refused, not stored: publishing to the exchange still routes.
        Producer(other_connection).publish({"k": 1}, exchange=exchange, routing_key="stock.a")
        assert drain(connection, good) == [{"k": 1}]
        # The same key means nothing special to a direct exchange: bound, matched exactly.
        direct = Exchange("ex.direct.stars", "direct")
        stars = Queue("direct-stars", direct, "a**")
        stars(connection.default_channel).declare()
        producer = Producer(other_connection)
        producer.publish({"k": "aaa"}, exchange=direct, routing_key="aaa")
        producer.publish({"k": "a**"}, exchange=direct, routing_key="a**")
        assert drain(connection, stars) == [{"k": "a**"}]

    def test_fanout(self, connection: Connection, other_connection: Connection) -> None:
        exchange = Exchange("ex.fanout", "fanout")
        queues = [Queue(f"fan-{n}", exchange) for n in range(3)]
        for q in queues:
            q(connection.default_channel).declare()
        Producer(other_connection).publish({"all": True}, exchange=exchange, routing_key="x")
        assert [drain(connection, q) for q in queues] == [[{"all": True}]] * 3

    def test_bind_to_undeclared_exchange_is_refused(self, connection: Connection) -> None:
        queue = Queue("orphan", Exchange("never-declared", "direct", no_declare=True), "k")
        bound = queue(connection.default_channel)
        with pytest.raises(ChannelError, match=r"NOT_FOUND.*never-declared"):
            bound.declare()

    def test_unroutable_direct_message_is_kept_not_dropped(
        self, connection: Connection, dead_letters: Any
    ) -> None:
        Exchange("ex.lonely", "direct")(connection.default_channel).declare()
        Producer(connection).publish({"lost": False}, exchange="ex.lonely", routing_key="nobody")
        assert dead_letters() == [
            (
                "nobody",
                "unroutable: no queue bound for exchange"
                " 'ex.lonely' (direct), routing key 'nobody'",
            )
        ]

    def test_redeclare_with_another_type_is_refused(self, connection: Connection) -> None:
        Exchange("ex.typed", "direct")(connection.default_channel).declare()
        with pytest.raises(ChannelError, match="PRECONDITION_FAILED"):
            Exchange("ex.typed", "fanout")(connection.default_channel).declare()
