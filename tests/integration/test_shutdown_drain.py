"""A worker shutting down does not wait for its blocking drain's timeout.

Celery's gevent and eventlet loops drain for up to 2 s at a time and look for a
shutdown between two drains, and run one more drain after they saw it: an idle worker
took 3.4-4 s to stop (benchmarks/results/2026-11-28-worker-lifecycle.md). Celery's
``worker_shutting_down`` (sent from its SIGTERM handler) ends the drain under way and
shortens the next ones. Here on a real consumer, its drain 20 s long in a thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from celery import signals
from kombu import Connection, Consumer, Queue

from pg_transport.consume.blocking import STOPPING_WAIT

# Far longer than an interrupted drain takes on a loaded machine (milliseconds), and
# than STOPPING_WAIT; far shorter than the drains' own timeout.
BOUND = 5.0
DRAIN = 20.0


@pytest.fixture
def consumer(broker_url: str, schema: str) -> Iterator[Connection]:
    with Connection(broker_url, transport_options={"schema": schema}) as conn:
        Consumer(conn, [Queue("idle")], accept=["json"], callbacks=[]).consume()
        yield conn


def drain_in_thread(conn: Connection) -> tuple[threading.Thread, list[float]]:
    """A drain of DRAIN seconds in a thread; the time it took, once it ended."""
    took: list[float] = []

    def drain() -> None:
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):  # (an interrupted drain's way out)
            conn.drain_events(timeout=DRAIN)
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=drain)
    thread.start()
    return thread, took


def test_a_shutting_down_worker_s_drains_end_without_their_timeout(
    consumer: Connection,
) -> None:
    thread, took = drain_in_thread(consumer)
    engine = consumer.transport.engine
    deadline = time.monotonic() + 10
    while not engine.waiting:  # its claim came back empty: it waits in poll()
        assert time.monotonic() < deadline, "the consumer never came to wait"
        time.sleep(0.005)
    # What Celery's SIGTERM handler sends in a worker's main process.
    signals.worker_shutting_down.send(sender="test@host", sig="SIGTERM", how="Warm", exitcode=0)
    thread.join(BOUND)
    assert not thread.is_alive() and took[0] < BOUND, took
    # Celery's loop drains once more after it saw the shutdown: that one is short too.
    thread, took = drain_in_thread(consumer)
    thread.join(BOUND)
    assert not thread.is_alive() and STOPPING_WAIT <= took[0] < BOUND, took


def test_a_drain_not_told_of_a_shutdown_waits_its_timeout(consumer: Connection) -> None:
    """The other side: nothing else ends a drain early (a wake-up claims, and waits on)."""
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        consumer.drain_events(timeout=0.5)
    assert time.monotonic() - started >= 0.5
