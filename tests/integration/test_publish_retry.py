"""A publish whose commit landed but whose answer was lost inserts once, whoever retries.

The answer is lost on the wire (tests/proxy.py closes the connection instead of
forwarding the server's answer to the INSERT): the row is committed, the client sees a
connection lost. pgq retries once on a fresh connection; that answer is lost too, so the
error reaches kombu, whose publish retry (Celery's ``task_publish_retry`` is the same)
prepares the message again and sends it a third time.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from pg_transport.kombu.channel import PUBLISH_ID
from tests.integration.conftest import Peek
from tests.proxy import CuttingProxy

RETRY = {"max_retries": 3, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.1}


@pytest.fixture
def rows(pg_url: str, schema: str, broker_url: str) -> Iterator[Peek]:
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()  # creates the schema before anything goes through the proxy
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


def inserted(proxy: CuttingProxy) -> list[tuple[int, bool]]:
    """Each INSERT's row count as the server answered it, and whether it was lost."""
    return [(int(tag.split(b" ")[2].rstrip(b"\x00")), lost) for tag, lost in proxy.answers]


def test_kombus_publish_retry_after_a_lost_commit_answer_inserts_once(
    proxied_url: str, schema: str, proxy: CuttingProxy, rows: Peek
) -> None:
    with Connection(proxied_url, transport_options={"schema": schema}) as conn:
        producer = conn.Producer()
        conn.connect()
        proxy.cut(2)  # the first attempt's answer and pgq's own retry's
        producer.publish({"n": 1}, routing_key="q", retry=True, retry_policy=RETRY)
    # Committed, lost; found taken, lost; found taken, answered.
    assert inserted(proxy) == [(1, True), (0, True), (0, False)]
    assert rows("SELECT count(*) FROM {schema}.message") == [(1,)]


def test_a_routed_publish_retried_by_kombu_inserts_once_per_queue(
    proxied_url: str, schema: str, proxy: CuttingProxy, rows: Peek
) -> None:
    exchange = Exchange("fan", type="fanout")
    with Connection(proxied_url, transport_options={"schema": schema}) as conn:
        for name in ("a", "b"):
            Queue(name, exchange)(conn.default_channel).declare()
        producer = conn.Producer(exchange=exchange, auto_declare=False)
        # A routed publish is one SELECT that routes, inserts and wakes.
        proxy.marker = re.compile(rb"SELECT \d+\x00")
        proxy.answers.clear()
        proxy.cut(2)
        producer.publish({"n": 1}, retry=True, retry_policy=RETRY)
    # Two answers lost, with their connections; then one answered. (An answer is a
    # packet: one the server sent with two SELECT tags in it counts once per tag.)
    lost = [lost for _, lost in proxy.answers]
    assert proxy.cuts_left == 0, lost
    assert False in lost and all(lost[: lost.index(False)]), lost
    assert rows("SELECT queue, count(*) FROM {schema}.message GROUP BY 1 ORDER BY 1") == [
        ("a", 1),
        ("b", 1),
    ]


def celery_app(url: str, schema: str) -> Celery:
    app = Celery("retried", broker=url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.task_publish_retry_policy = RETRY
    return app


def test_celerys_task_publish_retry_after_a_lost_commit_answer_inserts_once(
    proxied_url: str, schema: str, proxy: CuttingProxy, rows: Peek
) -> None:
    app = celery_app(proxied_url, schema)
    with app.connection_for_write() as conn:
        app.send_task("tasks.add", args=(0, 0), task_id="t-0", connection=conn)  # declares
        proxy.answers.clear()
        proxy.cut(2)
        app.send_task("tasks.add", args=(1, 2), task_id="t-1", connection=conn)
    # Committed, lost; found taken, lost; (the queue declared again;) found taken.
    found = inserted(proxy)
    assert found[:2] == [(1, True), (0, True)] and found[-1] == (0, False)
    assert rows(
        "SELECT count(*) FROM {schema}.message WHERE payload->'headers'->>'id' = 't-1'"
    ) == [(1,)]


def test_publishes_of_one_task_id_are_each_inserted(
    broker_url: str, schema: str, rows: Peek
) -> None:
    # self.retry() and Task.replace() send a new message with the task's id: each is
    # a publish of its own.
    app = celery_app(broker_url, schema)
    task_id = str(uuid.uuid4())
    with app.connection_for_write() as conn:
        for _ in range(3):
            app.send_task("tasks.add", args=(1, 2), task_id=task_id, connection=conn)
    assert rows(
        "SELECT count(*), count(DISTINCT publish_key) FROM {schema}.message"
        " WHERE payload->'headers'->>'id' = %s",
        task_id,
    ) == [(3, 3)]


def test_a_delivered_message_does_not_carry_its_publish_id(
    broker_url: str, schema: str, rows: Peek
) -> None:
    # Published again from what a consumer received, a message is a new publish.
    with Connection(broker_url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("again")
        q.put({"n": 1})
        got: Any = q.get(timeout=5)
        assert PUBLISH_ID not in got.properties
        q.put(got.payload, **{k: v for k, v in got.properties.items() if k == "priority"})
        got.ack()
        q.close()
    assert rows("SELECT count(*) FROM {schema}.message") == [(1,)]


def test_celerys_publish_retry_declares_the_queue_again_after_a_lost_connection(
    proxied_url: str, schema: str, proxy: CuttingProxy, rows: Peek
) -> None:
    # The answers lost are the queue's declaration's: kombu's retry collects the
    # transport and declares again through the entity bound to its old channel.
    app = celery_app(proxied_url, schema)
    with app.connection_for_write() as conn:
        conn.connect()
        proxy.cut(2)  # the declaration's answer, and pgq's own retry's
        app.send_task("tasks.add", args=(1, 2), task_id="t-1", connection=conn)
    assert proxy.answers[0][1] is True  # a connection was lost
    assert rows("SELECT count(*) FROM {schema}.message") == [(1,)]
