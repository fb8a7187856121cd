"""A consumer whose path to Postgres goes dark — every packet dropped, no RST, no FIN —
notices within the bound its URL's TCP settings give, not the operating system's minutes.

The server is a throwaway cluster in a network namespace behind a veth pair
(:mod:`tests.acceptance.netns`); the consumer, in this process, crosses the pair. The
cut sets the namespace's side of the link down. A loopback proxy cannot stand in: the
kernel answers for both ends, so a probe is always acknowledged.

- With short keepalives and ``tcp_user_timeout`` in the URL, a consumer blocked in
  ``get`` fails with a connection error within ``polling_interval`` (the next claim
  sent into the dark) plus the larger of ``tcp_user_timeout`` and ``keepalives_idle +
  keepalives_count * keepalives_interval``, plus a margin measured from one round trip
  before the cut. With the link back, the same consumer gets a message published after
  the cut.
- A Celery worker (a real process, on request: ``-m failover``) with the same URL logs
  that its broker connection was lost within that bound, and once the link is back runs
  a task published after the cut (Celery's own reconnect).
- The control (on request, ``-m failover``): with keepalives off and
  ``tcp_user_timeout=0`` (the kernel's default: retransmissions for ~15 minutes) the
  same call is still blocked after that bound; it ends when the link comes back and a
  message arrives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kombu import Connection

from tests.acceptance.cluster import ClusterUnavailable
from tests.acceptance.harness import prepare, start_worker, wait_for
from tests.acceptance.netns import NetnsCluster, cut_off_cluster

pytestmark = pytest.mark.acceptance

IDLE, INTERVAL, COUNT, USER_TIMEOUT_MS = 1, 1, 2, 3000
SHORT = (
    f"keepalives_idle={IDLE}&keepalives_interval={INTERVAL}"
    f"&keepalives_count={COUNT}&tcp_user_timeout={USER_TIMEOUT_MS}"
)
#: pgq's defaults would still apply a 30 s user timeout: the control turns both off.
NONE = "keepalives=0&tcp_user_timeout=0"
POLLING_INTERVAL = 1.0
#: Kernel timers and thread scheduling on a loaded 2-core machine, on top of the
#: measured round trip.
SLACK = 1.0
#: What the kernel would take without the settings is minutes: anything this long means
#: the settings did not work; the waits below end on events well before it.
GIVE_UP = 120.0


@pytest.fixture(scope="module")
def net() -> Iterator[NetnsCluster]:
    try:
        with cut_off_cluster() as cluster:
            yield cluster
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))


def bound() -> float:
    keepalive = IDLE + COUNT * INTERVAL
    return POLLING_INTERVAL + max(keepalive, USER_TIMEOUT_MS / 1000)


@dataclass
class BlockedGet:
    """``queue.get`` run in a thread: what it ended with, and when."""

    queue: Any
    timeout: float
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    ended_at: float = 0.0

    def start(self) -> BlockedGet:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self.result = self.queue.get(timeout=self.timeout).payload
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.done.set()


def pgq_url(net: NetnsCluster, options: str) -> str:
    return net.url().replace("postgresql://", "pgq://", 1) + "?" + options


def round_trip(queue: Any, label: str) -> float:
    """Seconds one publish and get take over the link: the measured part of the margin."""
    started = time.monotonic()
    queue.put({"n": label})
    assert queue.get(timeout=10).payload == {"n": label}
    return time.monotonic() - started


def publish(net: NetnsCluster, queue_name: str, body: dict[str, str]) -> None:
    with Connection(pgq_url(net, SHORT)) as conn:
        conn.SimpleQueue(queue_name).put(body)


def test_a_consumer_notices_a_silently_dead_link_and_comes_back(net: NetnsCluster) -> None:
    with Connection(
        pgq_url(net, SHORT), transport_options={"polling_interval": POLLING_INTERVAL}
    ) as conn:
        queue = conn.SimpleQueue("dead-peer")
        limit = bound() + round_trip(queue, "before") + SLACK
        blocked = BlockedGet(queue, GIVE_UP).start()
        cut_at = time.monotonic()
        net.cut()
        try:
            assert blocked.done.wait(GIVE_UP), "the consumer never noticed the dead link"
        finally:
            net.restore()
        noticed = blocked.ended_at - cut_at
        print(f"dead link noticed {noticed:.2f} s after the cut (bound {limit:.2f} s)")
        assert isinstance(blocked.error, conn.connection_errors), repr(blocked.error)
        assert noticed <= limit, (noticed, limit, blocked.error)
        # The link is back: a message published after the cut reaches the consumer once
        # it reconnects the way kombu's consumers (and Celery's) do after a connection
        # error: drop the dead connection's state, connect again, consume again.
        publish(net, "dead-peer", {"n": "after"})
        back = time.monotonic()
        conn.collect()
        conn.ensure_connection(max_retries=10, interval_start=0.2, interval_step=0.2)
        queue = conn.SimpleQueue("dead-peer")
        again = BlockedGet(queue, 30).start()
        assert again.done.wait(60)
        assert again.error is None, repr(again.error)
        assert again.result == {"n": "after"}
        print(f"consumer back {again.ended_at - back:.2f} s after the publish")


@pytest.mark.failover  # on request: it waits the whole bound out (~6 s more)
def test_without_the_settings_the_same_call_is_still_blocked(net: NetnsCluster) -> None:
    with Connection(
        pgq_url(net, NONE), transport_options={"polling_interval": POLLING_INTERVAL}
    ) as conn:
        queue = conn.SimpleQueue("no-keepalive")
        limit = bound() + round_trip(queue, "before") + SLACK
        blocked = BlockedGet(queue, GIVE_UP).start()
        net.cut()
        try:
            # Waiting the whole bound is the assertion: the call must not end in it.
            ended = blocked.done.wait(limit)
        finally:
            net.restore()
        assert not ended, f"ended within {limit:.2f} s without keepalives: {blocked.error!r}"
        # Stop it: with the link back the stalled connection resumes (the kernel's next
        # retransmission) and the message published now ends the call.
        publish(net, "no-keepalive", {"n": "after"})
        assert blocked.done.wait(GIVE_UP)
        assert blocked.error is None, repr(blocked.error)
        assert blocked.result == {"n": "after"}


LOST = "Connection to broker lost"
MARK = "tests.acceptance.app.mark"


@pytest.mark.failover  # on request: a worker's start-up and Celery's reconnect, ~20 s
def test_a_worker_on_a_dark_link_reconnects_and_runs_what_was_published_meanwhile(
    net: NetnsCluster,
) -> None:
    env = prepare(net.url(), "pgq_dead_peer")
    worker = start_worker(env, "dark", environ={"PGQ_BROKER_URL": pgq_url(net, SHORT)})
    try:
        client = env.client()
        started = time.monotonic()
        first = client.send_task(MARK, args=["before"]).id
        wait_for(lambda: [r for r in env.runs() if r[0] == first], 30, "the task before the cut")
        limit = bound() + (time.monotonic() - started) + SLACK
        cut_at = time.monotonic()
        net.cut()
        try:
            wait_for(lambda: LOST in worker.output(), GIVE_UP, "the worker to notice")
            noticed = time.monotonic() - cut_at
        finally:
            net.restore()
        print(f"worker noticed the dead link {noticed:.2f} s after the cut (bound {limit:.2f} s)")
        assert noticed <= limit, (noticed, limit, worker.output()[-3000:])
        after = client.send_task(MARK, args=["after"]).id
        back = time.monotonic()
        wait_for(lambda: [r for r in env.runs() if r[0] == after], 60, "the task after the cut")
        print(f"the task published after the cut ran {time.monotonic() - back:.2f} s later")
    finally:
        worker.stop()
