"""pgq in a process holding more than a thousand files: every wait works at any number.

``select.select`` refuses a descriptor of 1024 or more. Each test here first takes every
descriptor number below 1100 (``/dev/null`` opened again and again), so each socket and
pipe pgq opens afterwards is numbered past the limit; then it publishes, consumes,
closes and waits for a result as an application would.

The kombu connections use a URL of their own: a process's pools are shared, and a
session another test left idle in one would have a number below the limit.
"""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import suppress
from typing import Any

import pytest
from celery import Celery, states
from kombu import Connection, Exchange, Queue

from pg_transport.db import waits
from tests.integration.conftest import Peek
from tests.pg import pgq_url

# Every descriptor below this one is taken before pgq opens any; the soft limit is
# raised to ROOM for them if need be.
FLOOR = 1100
ROOM = FLOOR + 1000


def _skip_without_room() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < ROOM:
        pytest.skip(f"RLIMIT_NOFILE's hard limit ({hard}) is below {ROOM}")


@pytest.fixture
def crowded() -> Iterator[int]:
    """Every descriptor number below :data:`FLOOR` in use (the soft limit raised if need
    be); yields the number of the last one taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < ROOM:
        _skip_without_room()
        resource.setrlimit(resource.RLIMIT_NOFILE, (ROOM, hard))
    taken: list[int] = []
    try:
        while not taken or taken[-1] < FLOOR:
            taken.append(os.open(os.devnull, os.O_RDONLY))
        yield taken[-1]
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def url(pg_url: str) -> str:
    return pgq_url(pg_url, application_name="pgq-many-fds")


def _no_errors(caplog: pytest.LogCaptureFixture) -> None:
    said = [
        f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
        for r in caplog.records
        if r.name.startswith("pg_transport") and r.levelno >= logging.WARNING
    ]
    assert not said, said


def test_publish_consume_and_close_past_descriptor_1024(
    crowded: int, url: str, schema: str, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pg_transport")
    with Connection(url, transport_options={"schema": schema}) as conn:
        queue = conn.SimpleQueue("crowded")
        producer = conn.Producer()
        for n in range(5):
            # The default exchange: the durable way, insert and wake-up sent apart.
            producer.publish({"n": n}, routing_key="crowded")
        queue.put({"n": 5})  # through an exchange: routed in SQL
        got = []
        for _ in range(6):
            message = queue.get(timeout=10)  # the blocking driver's wait
            got.append(message.payload["n"])
            message.ack()
        queue.close()
    assert got == [0, 1, 2, 3, 4, 5]
    peek = Peek(pg_url, schema)
    try:
        assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]
    finally:
        peek.conn.close()
    _no_errors(caplog)


def test_a_consumer_is_woken_through_its_listener_past_descriptor_1024(
    crowded: int, url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pg_transport")
    options = {
        "schema": schema,
        "use_notify": False,
        "listen_url": url,  # (straight to Postgres here: no pooler in between)
        "polling_interval": 60,  # nothing arrives within the test but through a wake-up
    }
    queue = Queue("woken", Exchange("woken"), "r")
    with Connection(url, transport_options=options) as conn:
        got: list[Any] = []
        consumer = conn.Consumer([queue], accept=["json"], callbacks=[lambda b, m: got.append(b)])
        consumer.consume()
        with suppress(TimeoutError):
            conn.drain_events(timeout=0.05)  # (starts the listener)
        engine = conn.transport.engine
        deadline = time.monotonic() + 10
        while not engine.listener.listening:  # its LISTEN answered
            assert time.monotonic() < deadline, "the listener never listened"
            time.sleep(0.005)
        while not engine.waiting:  # no claim out: the next one is the wake-up's
            assert time.monotonic() < deadline, "the consumer never came to wait"
            with suppress(TimeoutError):
                conn.drain_events(timeout=0.05)
        with Connection(url, transport_options={"schema": schema}) as publisher:
            publisher.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="r")
        # Only the listener's wake-up brings it before the poll (a minute away).
        conn.drain_events(timeout=30)
        assert got == [{"n": 1}]
    _no_errors(caplog)


def test_a_result_is_waited_for_past_descriptor_1024(
    crowded: int, url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pg_transport")
    client, worker = (Celery("many-fds", broker=url, backend=url) for _ in range(2))
    for app in (client, worker):
        app.conf.update(broker_transport_options={"schema": schema})
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(client.AsyncResult("t").get(timeout=30)))
    waiter.start()
    try:
        listener = client.backend.listener
        deadline = time.monotonic() + 10
        # Subscribed: its LISTEN and first read are out once two statements went.
        while listener.waiting() != 1 or listener.statements < 2:
            assert time.monotonic() < deadline, "the waiter never subscribed"
            time.sleep(0.005)
        worker.backend.store_result("t", "done", states.SUCCESS)
        waiter.join(30)
        assert got == ["done"]
    finally:
        waiter.join(30)
        for app in (client, worker):
            app.backend.listener.stop()
    _no_errors(caplog)


def test_a_publish_whose_answer_cannot_be_read_after_its_commit_succeeds_once(
    url: str, schema: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should waiting for the server's answer fail after the insert committed (as
    ``select`` did past descriptor 1024), the publish is not reported as failed: the
    session is closed as lost, and the retry on another finds its row taken."""
    with Connection(url, transport_options={"schema": schema}) as conn:
        conn.SimpleQueue("unread")  # declared
        peek = Peek(pg_url, schema)
        real = waits.readable
        publishing = threading.get_ident()
        refused: list[int] = []

        def refuse_once_committed(fds: Collection[int], timeout: float | None) -> set[int]:
            if threading.get_ident() != publishing or refused:
                return real(fds, timeout)
            peek.wait_until(
                "SELECT count(*) = 1 FROM {schema}.message", failure="the insert never committed"
            )
            refused.append(1)
            raise ValueError("filedescriptor out of range in select()")

        monkeypatch.setattr(waits, "readable", refuse_once_committed)
        try:
            conn.Producer().publish({"n": 1}, routing_key="unread")
            assert refused, "the publish never waited for its answer"
            assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]
        finally:
            monkeypatch.undo()
            peek.conn.close()
        message = conn.SimpleQueue("unread").get(timeout=10)
        assert message.payload == {"n": 1}
        message.ack()


# Under gevent's monkey-patching (Celery's gevent pool): pgq's waits block only their
# greenlet, and work past descriptor 1024 (gevent's select() calls the system's first).
GEVENT = """
from gevent import monkey

monkey.patch_all()

import os, resource, sys

import gevent
from kombu import Connection

from pg_transport.db import waits

url, schema, floor, room = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft != resource.RLIM_INFINITY and soft < room:
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
while os.open(os.devnull, os.O_RDONLY) < floor:
    pass

# A wait lets the other greenlets run: the writer is only scheduled, and runs while the
# reader waits (a wait blocking the whole thread would see nothing for 30 s).
r, w = os.pipe()
gevent.spawn(os.write, w, b"x")
assert waits.readable((r,), 30) == {r}, "the wait blocked every greenlet"

with Connection(url, transport_options={"schema": schema}) as conn:
    queue = conn.SimpleQueue("gevent")
    conn.Producer().publish({"n": 1}, routing_key="gevent")
    message = queue.get(timeout=10)
    message.ack()
    queue.close()
assert message.payload == {"n": 1}, message.payload
print("ok")
"""


def test_under_gevent_past_descriptor_1024(url: str, schema: str) -> None:
    pytest.importorskip("gevent")
    _skip_without_room()
    done = subprocess.run(
        [sys.executable, "-c", GEVENT, url, schema, str(FLOOR), str(ROOM)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
