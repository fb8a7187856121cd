"""Message TTL on every way a message reaches a queue, the default exchange included.

A message expires after the shorter of its own ``expiration`` and its queue's
``x-message-ttl``, counted from its publish. An expired message is never delivered
(not to a claim, not to a no_ack get) and a consumer's housekeeping deletes it: as on
an AMQP broker with no dead-letter exchange, it is not dead-lettered.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue

from tests.integration.conftest import Peek

DEFAULT = Exchange("")  # AMQP's default exchange: the routing key names the queue


def _declared(conn: Connection, name: str, **options: Any) -> Queue:
    queue = Queue(name, Exchange(name), name, **options)
    queue(conn.default_channel).declare()
    return queue


def _ttl_of(rows: Peek, queue: str) -> list[float | None]:
    """Each message's lifetime in seconds (None: it never expires), oldest first."""
    found = rows(
        "SELECT EXTRACT(EPOCH FROM expires_at - enqueued_at)::float8 FROM {schema}.message"
        " WHERE queue = %s ORDER BY id",
        queue,
    )
    return [None if ttl is None else round(ttl, 3) for (ttl,) in found]


def _wait_expired(rows: Peek, queue: str) -> None:
    """Until every message of ``queue`` is past its expiry, by the server's clock."""
    rows.wait_until(
        "SELECT bool_and(expires_at < now()) FROM {schema}.message WHERE queue = %s",
        queue,
        failure=f"the messages of {queue} never expired",
    )


def _consume_until_gone(conn: Connection, rows: Peek, queue: Queue) -> list[Any]:
    """Consume ``queue`` (its consumer's housekeeping running) until it has no row left;
    what it was delivered meanwhile."""
    delivered: list[Any] = []
    deadline = time.monotonic() + 15
    with Consumer(conn, [queue], accept=["json"], callbacks=[lambda b, m: delivered.append(b)]):
        while rows("SELECT count(*) FROM {schema}.message WHERE queue = %s", queue.name)[0][0]:
            assert time.monotonic() < deadline, "expired messages were never cleaned up"
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
    return delivered


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_default_exchange_publish_honours_expiration(conn: Connection, rows: Peek) -> None:
    queue = _declared(conn, "ttl-default")
    producer = Producer(conn, exchange=DEFAULT)
    producer.publish({"n": "short"}, routing_key="ttl-default", expiration=0.05)
    producer.publish({"n": "none"}, routing_key="ttl-default")
    producer.publish({"n": "long"}, routing_key="ttl-default", expiration=600)
    assert _ttl_of(rows, "ttl-default") == [0.05, None, 600.0]

    rows("DELETE FROM {schema}.message WHERE expires_at IS NULL OR expires_at > now() + '1 min'")
    _wait_expired(rows, "ttl-default")
    assert conn.default_channel.basic_get("ttl-default", no_ack=False) is None
    assert conn.default_channel.basic_get("ttl-default", no_ack=True) is None
    assert conn.default_channel._size("ttl-default") == 0
    assert _consume_until_gone(conn, rows, queue) == []
    assert rows("SELECT count(*) FROM {schema}.dead_letter")[0][0] == 0


def test_default_exchange_publish_honours_queue_message_ttl(conn: Connection, rows: Peek) -> None:
    queue = _declared(conn, "ttl-queue", message_ttl=0.3)
    producer = Producer(conn, exchange=DEFAULT)
    producer.publish({"n": "queue's"}, routing_key="ttl-queue")
    producer.publish({"n": "own, shorter"}, routing_key="ttl-queue", expiration=0.05)
    producer.publish({"n": "own, longer"}, routing_key="ttl-queue", expiration=60)
    assert _ttl_of(rows, "ttl-queue") == [0.3, 0.05, 0.3]

    _wait_expired(rows, "ttl-queue")
    assert _consume_until_gone(conn, rows, queue) == []


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_expired_message_is_not_redelivered_after_its_lease(conn: Connection, rows: Peek) -> None:
    """Claimed before it expired, released after: never delivered again, cleaned up."""
    queue = _declared(conn, "ttl-held")
    Producer(conn, exchange=DEFAULT).publish({"n": 1}, routing_key="ttl-held", expiration=0.2)
    held = conn.default_channel.basic_get("ttl-held", no_ack=False)
    assert held is not None and held.payload == {"n": 1}
    _wait_expired(rows, "ttl-held")
    held.requeue()
    assert _consume_until_gone(conn, rows, queue) == []


def test_expiry_does_not_touch_other_messages(conn: Connection, rows: Peek) -> None:
    _declared(conn, "ttl-mixed")
    producer = Producer(conn, exchange=DEFAULT)
    producer.publish({"n": "expires"}, routing_key="ttl-mixed", expiration=0.05)
    producer.publish({"n": "stays"}, routing_key="ttl-mixed")
    rows.wait_until(
        "SELECT bool_or(expires_at < now()) FROM {schema}.message WHERE queue = %s",
        "ttl-mixed",
        failure="the short message never expired",
    )
    got = conn.default_channel.basic_get("ttl-mixed", no_ack=False)
    assert got is not None and got.payload == {"n": "stays"}
    got.ack()


@pytest.fixture
def app(broker_url: str, schema: str) -> Iterator[Celery]:
    app = Celery("ttl", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    yield app
    app.close()


def test_celery_expires_is_never_delivered(app: Celery, pg_url: str, schema: str) -> None:
    """Celery's ``expires=`` becomes the message's expiration (every task goes to the
    default exchange): past it, no worker is handed the task."""
    app.send_task("t.expiring", expires=0.2)
    app.send_task("t.lasting", expires=600)
    rows = Peek(pg_url, schema)
    try:
        assert _ttl_of(rows, "celery") == [0.2, 600.0]
        rows("DELETE FROM {schema}.message WHERE expires_at > now() + '1 min'")
        _wait_expired(rows, "celery")
        with app.connection_for_read() as conn:
            assert _consume_until_gone(conn, rows, Queue("celery")) == []
    finally:
        rows.conn.close()
