"""The kombu transport against a real Postgres: wake-ups, acks, rejects, restores."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from pg_transport import fencing
from pg_transport.kombu.qos import lease_of
from tests.integration.conftest import Peek, idle_consumer


def setting(connector: Any, name: str) -> str:
    with connector.connection() as c:
        return str(c.execute(f"SHOW {name}").fetchone()[0])


def test_consumer_sessions_commit_asynchronously_publish_sessions_do_not(
    conn: Connection, broker_url: str, schema: str
) -> None:
    transport = conn.transport
    assert setting(transport.relaxed, "synchronous_commit") == "off"
    assert setting(transport.connector, "synchronous_commit") == "on"
    # The consumer's statements are planned once (test_plans.py checks those plans).
    assert setting(transport.relaxed, "plan_cache_mode") == "force_generic_plan"
    assert setting(transport.connector, "plan_cache_mode") == "auto"
    # No JIT: compiling a claim would cost more than a thousand claims.
    assert setting(transport.relaxed, "jit") == "off"
    assert setting(transport.connector, "jit") == "off"
    # durable_acks: auto (the default) is relaxed without synchronous standbys (this
    # server has none: tests/acceptance/test_failover.py has one); on follows the server.
    for durable_acks, expected in (("on", "on"), ("off", "off"), ("auto", "off")):
        options = {"schema": schema, "durable_acks": durable_acks}
        with Connection(broker_url, transport_options=options) as chosen:
            chosen.connect()
            assert setting(chosen.transport.relaxed, "synchronous_commit") == expected
    options = {"schema": schema, "use_notify": False}
    with Connection(broker_url, transport_options=options) as pooled:
        pooled.connect()
        # Behind a transaction pooler no session state is set at all, and no
        # statement is prepared on a server session that may be someone else's next.
        assert pooled.transport.relaxed is pooled.transport.connector
        assert setting(pooled.transport.relaxed, "synchronous_commit") == "on"
        assert setting(pooled.transport.relaxed, "plan_cache_mode") == "auto"
    # Publishes wait for their WAL flush unless durable_publish is off; the store knows.
    assert transport.publisher.connector is transport.connector
    assert transport.publisher.flushes
    options = {"schema": schema, "durable_publish": False}
    with Connection(broker_url, transport_options=options) as fast:
        fast.connect()
        assert setting(fast.transport.publisher.connector, "synchronous_commit") == "off"
        assert not fast.transport.publisher.flushes
        assert pooled.transport.connector.prepare_threshold is None
        with pooled.transport.connector.connection() as c:
            assert c.prepare_threshold is None
    assert transport.connector.prepare_threshold == 5


def test_idle_consumer_is_woken_by_notify_not_by_polling(broker_url: str, schema: str) -> None:
    options = {"schema": schema, "polling_interval": 30}
    queue = Queue("wake", Exchange("wake"), "wake")
    with (
        idle_consumer(broker_url, options, queue) as got,
        Connection(broker_url, transport_options=options) as pub,
    ):
        sent = time.monotonic()
        Producer(pub).publish(
            {"x": 1}, exchange=queue.exchange, routing_key="wake", declare=[queue]
        )
    assert got, "the message was never delivered"
    assert got[0] - sent < 5  # the poll would have taken 30 s


def test_polling_delivers_without_notify(broker_url: str, schema: str) -> None:
    options = {"schema": schema, "use_notify": False, "polling_interval": 0.05}
    with Connection(broker_url, transport_options=options) as c:
        queue = c.SimpleQueue("polled")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        queue.close()


def test_no_ack_consumer_takes_and_deletes(conn: Connection, rows: Peek) -> None:
    buffer = conn.SimpleBuffer("fire-and-forget")
    buffer.put({"n": 1})
    assert buffer.get(timeout=5).payload == {"n": 1}
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]
    buffer.close()


def test_reject_with_requeue_and_without(conn: Connection, rows: Peek) -> None:
    queue = conn.SimpleQueue("rej")
    queue.put({"n": 1})
    first = queue.get(timeout=5)
    first.requeue()
    assert first.delivery_info["redelivered"] is False
    again = queue.get(timeout=5)
    assert again.payload == {"n": 1}
    assert again.delivery_info["redelivered"] is True
    assert again.delivery_info["pgq_token"][1] == 3  # claimed, released, claimed again
    assert again.delivery_info["redelivered"] is True
    again.reject()
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]
    assert rows("SELECT queue, reason FROM {schema}.dead_letter") == [
        ("rej", "rejected without requeue; not a Celery task message")
    ]
    queue.close()


def test_unacked_messages_are_released_when_the_channel_closes(
    broker_url: str, schema: str, rows: Peek
) -> None:
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        queue = c.SimpleQueue("held")
        queue.put({"n": 1})
        queue.get(timeout=5)  # never acked
        assert rows("SELECT visible_at > now() FROM {schema}.message") == [(True,)]
    # Closed: visible again at once, not after the visibility timeout.
    assert rows("SELECT visible_at <= now(), read_ct FROM {schema}.message") == [(True, 1)]


def test_an_ack_that_cannot_land_does_not_raise_and_stops_renewal(
    conn: Connection, rows: Peek, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    queue = conn.SimpleQueue("unackable")
    queue.put({"n": 1})
    message = queue.get(timeout=5)
    transport = conn.transport
    monkeypatch.setattr(transport.store, "fenced_window", 0.3)
    assert transport.held()  # leased and renewed while held
    # Postgres goes out of reach for this consumer's acks (a real refused port).
    monkeypatch.setattr(transport.relaxed, "conninfo", "postgresql://postgres@127.0.0.1:1/x")
    # No healthy session may be reused either (the renewal thread may hold one now).
    monkeypatch.setattr(transport.relaxed, "max_idle", 0)
    transport.relaxed.discard_idle()
    message.ack()  # must not raise
    assert transport.held() == []  # not renewed any more: the lease will lapse
    transport.engine.flush_acks()  # where a buffered ack lands when no claim takes it: no raise
    assert "will be delivered again" in caplog.text
    # The message is still there, leased: it comes back when the lease lapses.
    assert rows("SELECT read_ct FROM {schema}.message") == [(1,)]
    queue.close()


def test_a_renewal_that_races_an_ack_reports_no_refusal_but_a_lapse_it_does(
    conn: Connection, rows: Peek, caplog: pytest.LogCaptureFixture
) -> None:
    """The renewer reads what the consumer holds, then renews it: an ack landing in
    between deletes a row the renewal then misses. That message was not lost to another
    consumer (no warning, no count); a held one whose lease lapsed and was claimed again
    still is."""
    queue = conn.SimpleQueue("renew-race")
    queue.put({"n": 1})
    queue.put({"n": 2})
    first = queue.get(timeout=5)
    transport = conn.transport
    read = transport.held()  # what the renewer read, just before the ack
    assert lease_of(first).id in {t.id for t, _ in read}
    first.ack()
    transport.engine.flush_acks()  # the ack lands (as on the consumer's next claim)
    assert rows("SELECT count(*) FROM {schema}.message") == [(1,)]
    before = fencing.counts()["renewal"]
    with caplog.at_level(logging.WARNING, logger="pg_transport.fencing"):
        transport.renew(read)  # the renewal's statement, after the ack landed
    assert fencing.counts()["renewal"] == before
    assert not [r for r in caplog.records if r.name == "pg_transport.fencing"]
    # A lease that lapsed while held, the message claimed again: reported.
    second = queue.get(timeout=5)
    held = transport.held()
    (token,) = [t for t, _ in held if t.id == lease_of(second).id]
    rows(
        "UPDATE {schema}.message SET visible_at = now() - interval '1 second' WHERE id = %s",
        token.id,
    )
    (again,) = transport.store.claim([token.queue], [30.0], 1)
    assert again.id == token.id
    with caplog.at_level(logging.WARNING, logger="pg_transport.fencing"):
        transport.renew(held)
    assert fencing.counts()["renewal"] > before
    assert any(str(token.id) in r.getMessage() for r in caplog.records)
    second.ack()
    queue.close()


def test_concurrent_declares_of_one_new_exchange_agree_on_its_type(
    broker_url: str, schema: str, conn: Connection
) -> None:
    store = conn.transport.store
    others = [Connection(broker_url, transport_options={"schema": schema}) for _ in range(2)]
    try:
        stores = [c.transport.store for c in others]
        for c in others:
            c.connect()
        for n in range(30):
            name = f"racy-{n}"
            start = threading.Barrier(2)
            seen: list[str] = []

            def declare(
                s: Any, name: str = name, start: threading.Barrier = start, seen: list[str] = seen
            ) -> None:
                start.wait()
                seen.append(s.declare_exchange(name, "topic"))

            threads = [threading.Thread(target=declare, args=(s,)) for s in stores]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert seen == ["topic", "topic"]
        assert store.declare_exchange("racy-0", "direct") == "topic"  # keeps its type
    finally:
        for c in others:
            c.release()


def test_a_publishing_connection_holds_no_wake_up_pipe(broker_url: str, schema: str) -> None:
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with Connection(broker_url, transport_options={"schema": schema}) as warm:
        warm.SimpleQueue("pub-only").put({"n": 0})  # imports, schema, first connections
    before = open_fds()
    publishers = [Connection(broker_url, transport_options={"schema": schema}) for _ in range(20)]
    try:
        for c in publishers:
            Producer(c).publish({"n": 1}, routing_key="pub-only")
        # One session each, kept for the next publish; no wake-up pipe (two more each).
        assert open_fds() - before <= len(publishers) + 2
    finally:
        for c in publishers:
            c.release()
    assert open_fds() <= before + 2


def test_a_batch_waiting_behind_a_blocked_delivery_keeps_its_lease(
    broker_url: str, schema: str, rows: Peek
) -> None:
    # A consumer whose callback blocks (the solo pool runs the task right there) has
    # claimed a batch of two; the second message waits for the first for longer than
    # its visibility timeout. Its lease must be renewed, or another consumer takes it.
    options = {"schema": schema, "visibility_timeout": 1}
    entered, release = threading.Event(), threading.Event()
    got: list[Any] = []

    def blocking(body: Any, message: Any) -> None:
        got.append(body)
        if body == {"n": 1}:
            entered.set()
            release.wait(20)
        message.ack()

    with Connection(broker_url, transport_options=options) as c:
        consumer = Consumer(c.channel(), [Queue("blocked")], callbacks=[blocking])
        consumer.qos(prefetch_count=2)
        consumer.consume()
        producer = Producer(c.channel(), routing_key="blocked")
        producer.publish({"n": 1})
        producer.publish({"n": 2})
        thread = threading.Thread(target=c.drain_events, kwargs={"timeout": 20})
        thread.start()
        try:
            assert entered.wait(10)
            start = time.monotonic()
            # Three visibility timeouts pass with the second message claimed, undelivered.
            while time.monotonic() - start < 3.0:
                with Connection(broker_url, transport_options=options) as rival:
                    assert rival.transport.store.claim(["blocked"], [1.0], 10) == []
                time.sleep(0.2)
            assert rows(
                "SELECT count(*) FROM {schema}.message WHERE read_ct = 1 AND visible_at > now()"
            ) == [(2,)]
        finally:
            release.set()
            thread.join(20)
    # Both delivered by that one drain, once each.
    assert got == [{"n": 1}, {"n": 2}]


def test_connection_port_is_the_urls_then_the_one_that_answered(pg_url: str, schema: str) -> None:
    """kombu keeps a pgq URL whole, without a port: the transport says which one, the
    first libpq tries until a connection says which answered (a failover's)."""
    live = psycopg.conninfo.conninfo_to_dict(pg_url)
    host, port, dbname = (
        live.get("host") or "127.0.0.1",
        int(live.get("port") or 5432),
        live["dbname"],
    )
    user = live.get("user") or "postgres"
    dead = 1 if port != 1 else 2  # nothing listens on it
    url = f"pgq://{user}@{host}:{dead},{host}:{port}/{dbname}?target_session_attrs=any"
    with Connection(url, transport_options={"schema": schema}) as conn:
        assert conn.info()["port"] == dead
        assert conn.port == dead
        conn.connect()
        assert conn.port == port
        assert conn.info()["port"] == port
    with Connection(f"pgq://{user}@{host}/{dbname}", transport_options={"schema": schema}) as conn:
        assert conn.info()["port"] == 5432  # none written: libpq's default


def test_draining_again_after_a_terminated_session_reconnects(
    conn: Connection, pg_url: str, rows: Peek
) -> None:
    """A blocking consumer whose session the server dropped gets a connection error, and
    the same consumer's next drain_events opens a fresh session and delivers: never an
    internal error about a session that is not open."""
    queue = Queue("redrain", Exchange("redrain"), "redrain")
    got: list[Any] = []
    consumer = Consumer(
        conn, [queue], accept=["json"], callbacks=[lambda body, msg: (got.append(body), msg.ack())]
    )
    consumer.consume()
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.2)  # consuming, idle: the session is open
    engine = conn.transport.engine
    backend = engine.session.backend_pid
    assert backend is not None
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [backend])
    with pytest.raises(conn.connection_errors):
        while True:  # until the driver reads the dead socket (a bound: the poll interval)
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.2)
    Producer(conn.default_channel).publish({"n": 1}, exchange="redrain", routing_key="redrain")
    conn.drain_events(timeout=10)
    assert got == [{"n": 1}]
    assert engine.session.backend_pid not in (None, backend)
