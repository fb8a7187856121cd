"""Behind a transaction pooler, ``listen_url``: one direct session per process that only
LISTENs wakes idle consumers whose statements all go through the pooler."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Queue

from pg_transport.consume.listener import Listener
from pg_transport.db import waits
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.errors import ConfigurationError
from tests.bouncer import Bouncer, BouncerUnavailable, pgbouncer
from tests.integration.conftest import Peek
from tests.pg import to_broker_url

LISTENER = (
    "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
    " AND query LIKE 'LISTEN%%' AND backend_type = 'client backend'"
)


@pytest.fixture
def bouncer(pg_url: str) -> Iterator[Bouncer]:
    try:
        with pgbouncer(pg_url, pool_size=2) as found:
            yield found
    except BouncerUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def rows(pg_url: str, schema: str, broker_url: str) -> Iterator[Peek]:
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


@contextmanager
def consuming(url: str, options: dict[str, Any], queue: Queue) -> Iterator[tuple[list[float], Any]]:
    """A consumer draining ``queue`` in a thread; yields when each message arrived, and
    its engine."""
    got: list[float] = []
    stop = threading.Event()
    with Connection(url, transport_options=options) as conn:
        consumer = Consumer(
            conn,
            [queue],
            accept=["json"],
            callbacks=[lambda body, msg: (got.append(time.monotonic()), msg.ack())],
        )
        consumer.consume()

        def drain() -> None:
            while not stop.is_set():
                with suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)

        thread = threading.Thread(target=drain)
        thread.start()
        try:
            yield got, conn.transport.engine
        finally:
            stop.set()
            thread.join(10)


def idle(engine: Any) -> None:
    """Until the consumer's claim came back empty and it waits: from then on only a
    wake-up (or its poll) brings it a message."""
    deadline = time.monotonic() + 10
    while not engine.waiting:
        assert time.monotonic() < deadline, "the consumer never came to wait"
        time.sleep(0.005)


def arrival(got: list[float], n: int) -> float:
    deadline = time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(got) == n, f"{len(got)} messages of {n} arrived"
    return got[n - 1]


def publish(url: str, schema: str, queue: Queue) -> float:
    with Connection(url, transport_options={"schema": schema, "use_notify": False}) as conn:
        conn.connect()
        started = time.monotonic()
        conn.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="r")
    return started


def test_an_idle_consumer_behind_the_pooler_is_woken_through_its_direct_listener(
    bouncer: Bouncer, pg_url: str, schema: str, rows: Peek, caplog: pytest.LogCaptureFixture
) -> None:
    options = {
        "schema": schema,
        "use_notify": False,
        "listen_url": to_broker_url(pg_url),
        "polling_interval": 30,  # only a wake-up brings a message within the test
    }
    queue = Queue("woken", Exchange("woken"), "r")
    with consuming(bouncer.url("pgq"), options, queue) as (got, engine):
        application = f"pgq:{os.getpid()}"
        deadline = time.monotonic() + 10
        while not engine.listener.listening:  # its LISTEN answered
            assert time.monotonic() < deadline, "the listener never listened"
            time.sleep(0.005)
        assert len(rows(LISTENER, application)) == 1  # one direct session, to Postgres
        idle(engine)
        started = publish(bouncer.url("pgq"), schema, queue)
        assert arrival(got, 1) - started < 1.0, "not woken: it would have waited for its poll"

        # The direct session lost: a warning, and the consumer polls until it is back.
        caplog.set_level(logging.WARNING, logger="pg_transport.consume")
        [(pid,)] = rows(LISTENER, application)
        rows("SELECT pg_terminate_backend(%s)", pid)
        rows.wait_until(
            "SELECT count(*) = 1 FROM pg_stat_activity WHERE application_name = %s"
            " AND query LIKE 'LISTEN%%' AND pid <> %s",
            application,
            pid,
            failure="the listener did not come back",
        )
        deadline = time.monotonic() + 10
        while "listening connection (listen_url) is back" not in caplog.text:
            assert time.monotonic() < deadline, "the listener never said it is back"
            time.sleep(0.01)
        assert engine.listener.listening
        assert "listening connection (listen_url) is lost" in caplog.text
        idle(engine)
        started = publish(bouncer.url("pgq"), schema, queue)
        assert arrival(got, 2) - started < 1.0, "not woken after the reconnection"
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_listen_url_is_for_use_notify_off(broker_url: str, schema: str) -> None:
    with pytest.raises(ConfigurationError, match="listen_url is for use_notify=false"):
        Connection(
            broker_url, transport_options={"schema": schema, "listen_url": broker_url}
        ).connect()


def test_listen_url_pointed_at_the_pooler_says_so_and_backs_off(
    bouncer: Bouncer, schema: str, rows: Peek, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pg_transport.consume")
    options = {"schema": schema, "use_notify": False, "listen_url": bouncer.url("pgq")}
    queue = Queue("misdirected", Exchange("misdirected"), "r")
    with consuming(bouncer.url("pgq"), options, queue):

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "listen_url" in r.getMessage()]

        # Two refusals: 2 s apart (the first back-off step), then a wait twice as long.
        deadline = time.monotonic() + 30
        while len(said()) < 2:
            assert time.monotonic() < deadline, said()
            time.sleep(0.05)
    first, second = said()[:2]
    for line in (first, second):
        # What is wrong (the URL leads to a pooler), not the setting already made.
        assert "leads to a connection pooler" in line and "Postgres directly" in line, line
        assert "Set the transport option use_notify=false" not in line, line
    assert "next try in 2s" in first and "next try in 4s" in second, (first, second)


def test_a_notification_landing_while_a_claim_is_out_wakes_another_claim(
    broker_url: str, schema: str, rows: Peek
) -> None:
    """The listener's notification for a message published while the consumer's claim is
    on the wire (its snapshot taken before the commit: it comes back empty) is not lost
    when the driver reads the wake-up before the claim's empty answer: that answer marks
    the queue empty, and the notification, taken already, must still bring a claim,
    not the poll 30 s later. The order is forced, not hoped for: the claim's answer is
    waiting on the session's socket before the publish, the listener's wake-up is waiting
    on the pipe before the driver looks, and the blocking driver takes a wake-up before
    an answer when both are ready."""
    options = {
        "schema": schema,
        "use_notify": False,
        "listen_url": broker_url,
        "polling_interval": 30,  # only a wake-up brings the message within the test
    }
    queue = Queue("racing", Exchange("racing"), "r")
    got: list[Any] = []
    with Connection(broker_url, transport_options=options) as conn:
        consumer = Consumer(
            conn,
            [queue],
            accept=["json"],
            callbacks=[lambda body, msg: (got.append(body), msg.ack())],
        )
        consumer.consume()
        engine = conn.transport.engine
        deadline = time.monotonic() + 10
        while not (engine.waiting and engine.listener.listening):  # idle, and listened
            assert time.monotonic() < deadline, "the consumer never came to wait"
            with suppress(TimeoutError):
                conn.drain_events(timeout=0.05)
        engine._pipe.clear()  # (wake-ups of the start, taken already)

        # A claim out (sent from here, as the driver would on an ack's wake-up), and its
        # empty answer arrived, not read: its snapshot cannot see what comes next.
        engine.exhausted.discard(queue.name)
        engine.kick()
        assert engine.busy, "no claim was sent"
        session_socket = engine.session.fileno()
        assert waits.readable([session_socket], 10), "the claim's answer never came"

        publish(broker_url, schema, queue)
        # The listener heard it and woke the driver's pipe (nobody reads it yet).
        assert waits.readable([engine._pipe.fileno()], 10), "the listener never woke the driver"
        assert waits.readable([session_socket], 0), "the claim's answer was read"

        started = time.monotonic()
        conn.drain_events(timeout=10)  # TimeoutError: the wake-up was lost (poll: 30 s)
        assert got == [{"n": 1}]
        assert time.monotonic() - started < 10
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


class _Recording(Connector):
    """A connector that keeps the last session it opened (the test watches its socket)."""

    last: psycopg.Connection[Any] | None = None

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        self.last = super().connect(autocommit=autocommit)
        return self.last


def test_a_notification_read_with_a_listen_s_answer_is_not_dropped(
    broker_url: str, pg_url: str, schema: str
) -> None:
    """psycopg takes a notification read during a statement out of libpq's list: one that
    came in before the answer of a LISTEN (for a queue consumed anew) must still wake
    the consumer. Forced: the listener's thread is held in its wake-up call while the
    notification reaches its socket, and the next thing it does is that LISTEN."""
    first, second = f"{schema}_a", f"{schema}_b"
    connector = _Recording(url_to_conninfo(broker_url), max_idle=0, prepare_threshold=None)
    hold, inside, go = threading.Event(), threading.Event(), threading.Event()
    woken = threading.Semaphore(0)

    def wake() -> None:
        if hold.is_set():
            hold.clear()
            inside.set()
            go.wait(10)
        woken.release()

    listener = Listener(connector, schema, wake)
    try:
        listener.want({first})
        # Once it listens it wakes the consumer for the channel (whatever came before).
        assert woken.acquire(timeout=10), "the listener never listened"
        assert listener.take() == {first}
        with psycopg.connect(pg_url, autocommit=True) as notifier:
            hold.set()
            notifier.execute("SELECT pg_notify(%s, '')", [first])
            assert inside.wait(10), "the first notification never woke anyone"
            assert listener.take() == {first}
            # The driver's next decision hands it out once more (for a claim that was
            # out meanwhile): taken here, so that only the notification below brings it.
            listener.want({first})
            assert woken.acquire(timeout=10)
            assert listener.take() == {first}
            # The thread is held in wake(): this one waits on its socket, unread.
            notifier.execute("SELECT pg_notify(%s, '')", [first])
            assert connector.last is not None
            assert waits.readable([connector.last.pgconn.socket], 10), "not sent"
            listener.want({first, second})  # its next step: LISTEN (second)
            go.set()
        seen: set[str] = set()
        deadline = time.monotonic() + 10
        while seen != {first, second}:
            assert woken.acquire(timeout=max(deadline - time.monotonic(), 0)), (
                f"woken for {seen or 'nothing'} only: the notification was dropped"
            )
            seen |= listener.take()
    finally:
        listener.close()
