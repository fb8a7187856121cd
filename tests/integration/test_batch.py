"""``pg_transport.batch()``: a block's publishes commit together, once, at its end."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, group
from kombu import Connection, Exchange, Producer, Queue

import pg_transport
from pg_transport.publish import batching
from pg_transport.publish.batching import BatchFailed
from pg_transport.store import Store
from tests.integration.conftest import Peek, idle_consumer

MESSAGES = "SELECT count(*), count(DISTINCT xmin::text) FROM {schema}.message"


@pytest.fixture
def queue(conn: Connection) -> Iterator[Any]:
    q = conn.SimpleQueue("batched")
    yield q
    q.close()


def our_open_transaction(rows: Peek) -> int:
    """The backend pid of this process's pgq session that has a transaction writing."""
    found = rows(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND backend_xid IS NOT NULL",
        f"pgq:{os.getpid()}",
    )
    assert len(found) == 1, found
    return int(found[0][0])


def test_a_batch_commits_its_messages_together_at_the_end_of_the_block(
    queue: Any, rows: Peek
) -> None:
    with pg_transport.batch() as batch:
        for n in range(50):
            queue.put({"n": n})
        assert batch.statements == 50
        assert rows(MESSAGES) == [(0, 0)]  # nothing is published before the commit
    # One transaction: every row has the same xmin (one commit, one WAL flush).
    assert rows(MESSAGES) == [(50, 1)]
    got = []
    for _ in range(50):
        message = queue.get(timeout=5)
        got.append(message.payload["n"])
        message.ack()
    assert sorted(got) == list(range(50))
    assert rows(MESSAGES) == [(0, 0)]


def test_a_block_left_by_an_exception_publishes_nothing(queue: Any, rows: Peek) -> None:
    with pytest.raises(KeyError), pg_transport.batch():
        for n in range(5):
            queue.put({"n": n})
        raise KeyError("the caller's own error")
    assert rows(MESSAGES) == [(0, 0)]
    queue.put({"n": "after"})  # the connection went back to the pool usable
    assert rows(MESSAGES) == [(1, 1)]
    assert queue.get(timeout=5).payload == {"n": "after"}


def test_a_failing_statement_fails_the_whole_batch(store: Store, peek: Peek) -> None:
    with pytest.raises(psycopg.errors.DatetimeFieldOverflow), pg_transport.batch():
        store.publisher.publish("q", {"n": 1}, publish_key="k1")
        # An interval no timestamp can hold: the server refuses this insert. Pipelined,
        # its error arrives with a later statement or with the commit.
        store.publisher.publish("q", {"n": 2}, publish_key="k2", delay=1e300)
        store.publisher.publish("q", {"n": 3}, publish_key="k3")
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]
    store.publisher.publish("q", {"n": 4}, publish_key="k4")  # the pool's connection is usable
    assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]


def test_a_failed_batch_takes_no_more_statements(store: Store, peek: Peek) -> None:
    with pytest.raises(BatchFailed), pg_transport.batch():
        with pytest.raises(psycopg.errors.DatetimeFieldOverflow):
            store.publisher.publish("q", {"n": 1}, publish_key="k1", delay=1e300)
            # A routed publish waits for its answer: the error has arrived by then.
            store.publisher.publish_routed("ex", "rk", {"n": 2}, publish_tag="t2")
        with pytest.raises(BatchFailed, match="an earlier statement of this batch failed"):
            store.publisher.publish("q", {"n": 3}, publish_key="k3")
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_a_batch_keeps_each_message_s_priority_and_delay(store: Store, peek: Peek) -> None:
    with pg_transport.batch():
        store.publisher.publish("q", {"n": "later"}, publish_key="a", delay=60)
        store.publisher.publish("q", {"n": "low"}, publish_key="b", priority=1)
        store.publisher.publish("q", {"n": "high"}, publish_key="c", priority=9)
    assert peek(
        "SELECT payload->>'n', priority, visible_at > now() + interval '50 seconds'"
        " FROM {schema}.message ORDER BY id"
    ) == [("later", 0, True), ("low", 1, False), ("high", 9, False)]
    assert [m.payload["n"] for m in store.claim(["q"], [30.0], 3, None)] == ["high", "low"]


def test_a_batch_resent_after_its_commit_landed_inserts_nothing_twice(
    store: Store, peek: Peek
) -> None:
    # What a resend after a commit whose answer was lost does: the same keys again.
    for _ in range(2):
        with pg_transport.batch():
            for n in range(3):
                store.publisher.publish("q", {"n": n}, publish_key=f"key-{n}")
    assert peek("SELECT count(*), count(DISTINCT xmin::text) FROM {schema}.message") == [(3, 1)]


def test_a_connection_terminated_in_the_middle_of_a_batch_is_replaced(
    queue: Any, rows: Peek
) -> None:
    with pg_transport.batch():
        for n in range(10):
            queue.put({"n": n})
        victim = our_open_transaction(rows)
        assert rows("SELECT pg_terminate_backend(%s, 10000)", victim) == [(True,)]
        for n in range(10, 20):
            queue.put({"n": n})
    # All twenty, once each, committed by the replacement session in one transaction.
    assert rows(MESSAGES) == [(20, 1)]
    payloads = rows("SELECT payload::text FROM {schema}.message")
    assert len({text for (text,) in payloads}) == 20


def test_a_batch_starts_on_a_fresh_session_when_the_pooled_one_was_reaped(
    conn: Connection, queue: Any, rows: Peek
) -> None:
    queue.put({"n": 0})
    # The session the next publish takes from the pool (the last one given back).
    with conn.transport.publisher.connector.connection() as pooled:
        pid = pooled.info.backend_pid
    assert rows("SELECT pg_terminate_backend(%s, 10000)", pid) == [(True,)]
    with pg_transport.batch():
        for n in range(1, 4):
            queue.put({"n": n})
    assert rows("SELECT count(*) FROM {schema}.message") == [(4,)]


def test_a_commit_lost_with_its_session_is_sent_again(
    queue: Any, rows: Peek, caplog: pytest.LogCaptureFixture
) -> None:
    # The first commit that inserts a message ends its own session on the server (a
    # deferred trigger runs at COMMIT): the client loses its connection while committing.
    rows("CREATE SEQUENCE {schema}.commits")
    rows(
        "CREATE FUNCTION {schema}.die_once() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF nextval(TG_TABLE_SCHEMA || '.commits') = 1 THEN"
        " PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); END IF;"
        " RETURN NULL; END $$"
    )
    rows(
        "CREATE CONSTRAINT TRIGGER die_once AFTER INSERT ON {schema}.message"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.die_once()"
    )
    with pg_transport.batch():
        for n in range(5):
            queue.put({"n": n})
    assert "connection lost committing a batch" in caplog.text
    assert rows(MESSAGES) == [(5, 1)]
    # The first commit died at its first row; the one sent again ran the trigger 5 times.
    assert rows("SELECT last_value FROM {schema}.commits") == [(6,)]


def test_a_batch_inside_a_batch_commits_with_the_outer_one(queue: Any, rows: Peek) -> None:
    with pg_transport.batch() as outer:
        queue.put({"n": 1})
        with pg_transport.batch() as inner:
            assert inner is outer
            queue.put({"n": 2})
        assert rows(MESSAGES) == [(0, 0)]
        queue.put({"n": 3})
    assert rows(MESSAGES) == [(3, 1)]
    assert batching.current() is None


def test_a_batch_is_its_threads_own(broker_url: str, schema: str, rows: Peek) -> None:
    options = {"schema": schema}
    published, done = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def batching_thread() -> None:
        try:
            with Connection(broker_url, transport_options=options) as c:
                q = c.SimpleQueue("batched")
                with pg_transport.batch():
                    q.put({"from": "batch"})
                    published.set()
                    assert done.wait(10)
                q.close()
        except BaseException as exc:
            failures.append(exc)
            published.set()

    thread = threading.Thread(target=batching_thread)
    thread.start()
    assert published.wait(10)
    with Connection(broker_url, transport_options=options) as c:
        q = c.SimpleQueue("batched")
        q.put({"from": "main"})  # no batch open in this thread: committed at once
        q.close()
    try:
        assert rows(MESSAGES) == [(1, 1)]  # main's; the batch's is not committed yet
    finally:
        done.set()
        thread.join(10)
    assert not failures, failures
    assert rows(MESSAGES) == [(2, 2)]


def test_routed_copies_and_dead_letters_join_the_batch(conn: Connection, rows: Peek) -> None:
    fanout = Exchange("fan", type="fanout")
    nowhere = Exchange("nowhere", type="direct")
    copies = [Queue("copy-a", fanout), Queue("copy-b", fanout)]
    with conn.channel() as channel:
        producer = Producer(channel)
        for q in copies:
            q(channel).declare()
        nowhere(channel).declare()
        with pg_transport.batch():
            producer.publish({"x": 1}, exchange=fanout)
            producer.publish({"x": 2}, exchange=nowhere, routing_key="nobody")
            assert rows(MESSAGES) == [(0, 0)]
            assert rows("SELECT count(*) FROM {schema}.dead_letter") == [(0,)]
        assert rows("SELECT queue FROM {schema}.message ORDER BY queue") == [
            ("copy-a",),
            ("copy-b",),
        ]
        assert rows("SELECT queue, reason LIKE 'unroutable%%' FROM {schema}.dead_letter") == [
            ("nobody", True)
        ]
        # The copies and the dead letter: one transaction.
        assert rows(
            "SELECT count(DISTINCT xmin::text) FROM (SELECT xmin FROM {schema}.message"
            " UNION ALL SELECT xmin FROM {schema}.dead_letter) AS t"
        ) == [(1,)]


def test_an_idle_consumer_is_woken_by_the_commit(broker_url: str, schema: str) -> None:
    options = {"schema": schema, "polling_interval": 60}
    queue = Queue("woken", Exchange("woken"), "woken")
    with (
        idle_consumer(broker_url, options, queue) as got,
        Connection(broker_url, transport_options=options) as pub,
    ):
        with pg_transport.batch():
            Producer(pub).publish(
                {"x": 1}, exchange=queue.exchange, routing_key="woken", declare=[queue]
            )
        committed = time.monotonic()
    assert got, "the message was never delivered"
    assert got[0] - committed < 5  # the poll would have taken 60 s


def test_celery_tasks_sent_in_a_batch_are_published_at_its_end(
    broker_url: str, schema: str, rows: Peek
) -> None:
    app = Celery("batch-test", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    with pg_transport.batch():
        for n in range(20):
            app.send_task("tests.add", (n, 1))
        assert rows(MESSAGES) == [(0, 0)]
    assert rows(MESSAGES) == [(20, 1)]
    app.close()


def test_a_celery_group_sent_in_a_batch_is_one_commit(
    broker_url: str, schema: str, rows: Peek
) -> None:
    app = Celery("batch-group", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="tests.add")
    def add(x: int, y: int) -> int:
        return x + y

    with pg_transport.batch():
        group(add.s(n, 1) for n in range(10)).apply_async()
        assert rows(MESSAGES) == [(0, 0)]
    assert rows(MESSAGES) == [(10, 1)]
    app.close()


def test_a_batch_is_used_once() -> None:
    used = pg_transport.batch()
    with used:
        pass
    with pytest.raises(RuntimeError, match="one with-block"), used:
        pass


def test_a_batch_behind_a_transaction_pooler(broker_url: str, schema: str, rows: Peek) -> None:
    # use_notify off, as behind PgBouncer: nothing prepared, one transaction all the same.
    options = {"schema": schema, "use_notify": False}
    with Connection(broker_url, transport_options=options) as c:
        assert c.transport.publisher.connector.prepare_threshold is None
        q = c.SimpleQueue("pooled")
        with pg_transport.batch():
            for n in range(5):
                q.put({"n": n})
            assert rows(MESSAGES) == [(0, 0)]
        assert rows(MESSAGES) == [(5, 1)]
        assert q.get(timeout=5).payload == {"n": 0}
        q.close()


def test_kombus_producer_batch_publishes_in_one_commit(
    conn: Connection, rows: Peek, schema: str
) -> None:
    """kombu's own batch API (``Producer.batch()``, which asks the channel for
    ``create_publish_batch``) gets pgq's one-commit batches."""
    producer = Producer(conn)
    assert producer.supports_batch_publish
    exchange = Exchange("orders", type="direct")
    Queue("kombu-batched", exchange, routing_key="o")(producer.channel).declare()
    with producer.batch():
        for n in range(30):
            producer.publish({"n": n}, exchange=exchange, routing_key="o")
            producer.publish({"n": n}, routing_key="kombu-direct")  # the default exchange
        assert rows(MESSAGES) == [(0, 0)]  # nothing before the block's end
    assert rows(MESSAGES) == [(60, 1)]  # one transaction id: one commit
    with pytest.raises(KeyError), producer.batch():
        producer.publish({"n": "gone"}, routing_key="kombu-direct")
        raise KeyError("the producer's own error")
    assert rows(MESSAGES) == [(60, 1)]  # discarded
    # max_size: kombu's bound on what a batch holds before it flushes on its own.
    with producer.batch(max_size=10):
        for n in range(25):
            producer.publish({"n": n}, routing_key="kombu-sized")
        assert rows("SELECT count(*) FROM {schema}.message WHERE queue = 'kombu-sized'") == [(20,)]
    assert rows(
        "SELECT count(*), count(DISTINCT xmin::text) FROM {schema}.message"
        " WHERE queue = 'kombu-sized'"
    ) == [(25, 3)]


def test_a_batch_writes_its_messages_a_statement_per_thousand_in_publish_order(
    conn: Connection, rows: Peek
) -> None:
    """The messages of a batch go in multi-row statements of at most ROWS_PER_STATEMENT
    (not one statement each), and a routed publish in between writes the rows before it
    first: ids follow the order of the publishes across both."""
    per = batching.ROWS_PER_STATEMENT
    fanout = Exchange("fan-many", type="fanout")
    with conn.channel() as channel:
        producer = Producer(channel)
        Queue("many", Exchange("many"), "many")(channel).declare()
        Queue("fan-copy", fanout)(channel).declare()
        with pg_transport.batch() as batch:
            for n in range(per + 10):
                producer.publish({"n": n}, routing_key="many")
            producer.publish({"n": "routed"}, exchange=fanout)
            for n in range(per + 10, 2 * per + 20):
                producer.publish({"n": n}, routing_key="many")
            (part,) = batch._parts.values()
            # a full statement of `per` rows, the 10 rows before the routed publish, the
            # routed publish; the last `per + 10` rows: one full statement sent, 10 waiting
            assert len(part.ops) == 4
            # (what kombu's Producer.batch counts to its max_size: every message given)
            assert batch.statements == 2 * per + 21
            assert rows(MESSAGES) == [(0, 0)]
        assert rows(MESSAGES) == [(2 * per + 21, 1)]  # one commit for all of them
    got = rows("SELECT payload->>'body' FROM {schema}.message WHERE queue = 'many' ORDER BY id")
    assert len(got) == 2 * per + 20
    seq = [producer_body(body) for (body,) in got]
    assert seq == list(range(2 * per + 20))
    (routed_id,) = rows("SELECT id FROM {schema}.message WHERE queue = 'fan-copy'")[0]
    (before,) = rows(
        "SELECT count(*) FROM {schema}.message WHERE queue = 'many' AND id < %s", routed_id
    )[0]
    assert before == per + 10


def producer_body(body: str) -> int:
    """The ``n`` of a message kombu published with its JSON serializer."""
    return int(json.loads(body)["n"])
