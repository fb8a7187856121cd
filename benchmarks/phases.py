"""The three measurements of a broker: publish rate, drain rate, idle latency.

Every loop is bounded in count and in time, so a stuck broker or worker ends the
phase with a :class:`PhaseError` instead of hanging the run.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from celery import Task
from kombu.messaging import Producer

from benchmarks import procstat
from benchmarks.app import LATENCY, Sink
from benchmarks.worker import Worker

T = TypeVar("T")

__all__ = [
    "Clock",
    "PhaseError",
    "broker_call_clock",
    "drain",
    "latency_interleaved",
    "percentile",
    "probe",
    "publish_interleaved",
    "wait_ready",
]

# How often the harness looks at the sink while waiting for the drain to finish.
DRAIN_POLL = 0.05
# Shortest idle gap before a latency probe: the worker has finished the previous one.
MIN_PROBE_GAP = 0.02
# Longest single wait on the sink, so a dead worker is noticed within this time.
SINK_WAIT_SLICE = 1.0


class PhaseError(RuntimeError):
    """A phase could not produce its measurement (timeout, dead worker)."""


class Clock:
    """Time spent inside the functions it wraps since the last :meth:`take`; a call
    made inside another wrapped call is counted once, in the outer one."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.depth = 0

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # (called inside another timed call: counted there)
                return function(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start
                self.depth -= 1

        return timed


@contextmanager
def broker_call_clock() -> Iterator[Callable[[], float]]:
    """Seconds spent inside kombu's ``Producer._publish`` while this is open.

    That call is a publish's broker-specific part, the same method for every broker:
    the transport's ``basic_publish`` (for pgq the statement's round trip and commit,
    for Redis its LPUSH, for RabbitMQ the frames and, with confirms, the wait for the
    confirm) behind kombu's declare cache. What ``apply_async`` spends outside it
    (Celery building the task message, kombu serializing it) is the same code for
    every broker. Yields a function returning the seconds counted so far.
    """
    clock = Clock()
    original = Producer._publish
    Producer._publish = clock.wrap(original)  # type: ignore[method-assign]
    try:
        yield lambda: clock.spent
    finally:
        Producer._publish = original  # type: ignore[method-assign]


def in_turn(brokers: Sequence[T], turn: int) -> Iterator[T]:
    """The order the brokers (their names, or the brokers) go in on pass ``turn``: as
    listed, reversed every other pass, so that no broker always goes first (right after
    the others' work)."""
    return iter(brokers) if turn % 2 == 0 else reversed(brokers)


def publish_interleaved(
    publishers: dict[str, Callable[[int], None]], count: int, chunk: int, timeout: float
) -> dict[str, dict[str, Any] | PhaseError]:
    """Publish ``count`` drain tasks through each publisher, the brokers taking turns.

    ``publishers[name](n)`` publishes ``n`` tasks from one producer. Each broker gets
    a first task alone (it connects and declares the queue; pgq also migrates its fresh
    schema: a one-time cost of every client, kept out of the rate), then ``chunk``
    tasks at a time, in turn and in reverse order every other pass, so that a machine
    whose speed drifts meets every broker alike. The rate of each counts only the time
    spent publishing through it, and that time is split into what was spent inside the
    broker's publish call and the rest (see :func:`broker_call_clock`). A broker that
    fails or runs out of time is reported with its error and the others go on.
    """
    outcome: dict[str, dict[str, Any] | PhaseError] = {}
    sent: dict[str, int] = {}
    spent: dict[str, float] = {}
    for name, publish_n in publishers.items():
        try:
            publish_n(1)
        except Exception as exc:  # any broker error ends that broker's phase only
            outcome[name] = PhaseError(f"first publish failed: {type(exc).__name__}: {exc}")
            continue
        sent[name], spent[name] = 1, 0.0
    broker: dict[str, float] = dict.fromkeys(sent, 0.0)
    deadline = time.monotonic() + timeout
    turn = 0
    with broker_call_clock() as in_broker:
        while pending := [n for n in sent if n not in outcome and sent[n] < count]:
            if time.monotonic() > deadline:
                for name in pending:
                    outcome[name] = PhaseError(
                        f"publish timed out after {timeout:.0f}s with {sent[name]}/{count} sent"
                    )
                break
            for name in in_turn(pending, turn):
                n = min(chunk, count - sent[name])
                start, start_in_broker = time.perf_counter(), in_broker()
                try:
                    publishers[name](n)
                except Exception as exc:  # any broker error ends that broker's phase only
                    outcome[name] = PhaseError(f"publish failed: {type(exc).__name__}: {exc}")
                    continue
                spent[name] += time.perf_counter() - start
                broker[name] += in_broker() - start_in_broker
                sent[name] += n
            turn += 1
    for name in sent:
        if name not in outcome:
            timed = sent[name] - 1
            outcome[name] = {
                "tasks": sent[name],
                "seconds": spent[name],
                "rate": timed / spent[name] if spent[name] > 0 else 0.0,
                "chunk": chunk,
                # Per publish: inside the broker's publish call, and the rest of it.
                "broker_call_us": broker[name] / timed * 1e6 if timed else 0.0,
                "client_us": (spent[name] - broker[name]) / timed * 1e6 if timed else 0.0,
            }
    return outcome


def drain(
    worker: Worker,
    sink: Sink,
    expected: int,
    timeout: float,
    spawned_at: float,
    sample: Callable[[], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Wait until the worker has run ``expected`` pre-published tasks; rate first→last.
    With ``sample`` (a reading of the worker's CPU and context switches, see
    :mod:`benchmarks.procstat`), what the worker spent per task from its first task
    done to its last, under ``per_task``."""
    client = sink.client()
    deadline = time.monotonic() + timeout
    first: tuple[int, dict[str, Any] | None] | None = None
    while (done := int(client.llen(sink.done_key))) < expected:
        if sample is not None and first is None and done > 0:
            first = (done, sample())
        if not worker.alive():
            raise PhaseError(
                f"worker exited (code {worker.proc.returncode}) after {done}/{expected} tasks"
            )
        if time.monotonic() > deadline:
            raise PhaseError(
                f"drain timed out after {timeout:.0f}s with {done}/{expected} tasks done"
            )
        time.sleep(DRAIN_POLL)
    last = sample() if sample is not None else None
    stamps = sorted(float(s) for s in client.lrange(sink.done_key, 0, -1))
    span = stamps[-1] - stamps[0]
    found: dict[str, Any] = {}
    if first is not None and first[1] is not None and last is not None:
        found["per_task"] = procstat.per_task(first[1], last, done - first[0])
    return {
        **found,
        "tasks": len(stamps),
        # More completions than tasks would mean redeliveries of finished tasks.
        "duplicates": len(stamps) - expected,
        "seconds": span,
        "rate": (len(stamps) - 1) / span if span > 0 else 0.0,
        # From spawning the worker process (start-up included) to the last task.
        "wall_seconds": stamps[-1] - spawned_at,
    }


def _wait_probe(worker: Worker, sink: Sink, seq: int, timeout: float) -> float:
    """When probe ``seq`` started running; late answers to older probes are skipped."""
    client = sink.client()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        popped = client.blpop([sink.latency_key], timeout=min(left, SINK_WAIT_SLICE))
        if popped is None:
            if not worker.alive():
                raise PhaseError(
                    f"worker exited (code {worker.proc.returncode}) during latency probe {seq}"
                )
            continue
        raw = popped[1]
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        got, _published, started = text.split()
        if int(got) == seq:
            return float(started)
    raise PhaseError(f"latency probe {seq} did not start within {timeout:.0f}s")


def wait_ready(worker: Worker, sink: Sink, seen: int, timeout: float) -> None:
    """Until the worker reports ready: the sink's ready list grows past ``seen``."""
    client = sink.client()
    deadline = time.monotonic() + timeout
    while int(client.llen(sink.ready_key)) <= seen:
        if not worker.alive():
            raise PhaseError(f"worker exited (code {worker.proc.returncode}) before ready")
        if time.monotonic() > deadline:
            raise PhaseError(f"worker not ready within {timeout:.0f}s")
        time.sleep(DRAIN_POLL)


def probe(
    task: Task, worker: Worker, sink: Sink, seq: int, probe_timeout: float
) -> tuple[float, float]:
    """Publish probe ``seq`` to an idle worker and wait for it to start: the time from
    just before ``apply_async`` to the task's first line, and the ``apply_async`` call
    alone (commit, confirm, round trip), both in ms."""
    published_at = time.time()
    task.apply_async(args=(LATENCY, seq, published_at))
    called = (time.time() - published_at) * 1000.0
    started = _wait_probe(worker, sink, seq, probe_timeout)
    return (started - published_at) * 1000.0, called


def latency_interleaved(
    probes: dict[str, Callable[[int], tuple[float, float]]],
    samples: int,
    max_gap: float,
    warmup: int = 0,
) -> dict[str, dict[str, Any] | PhaseError]:
    """Idle latency of every broker, the brokers taking turns one probe at a time.

    ``probes[name](seq)`` runs probe ``seq`` on that broker's idle worker (see
    :func:`probe`). Each pass gives every broker one probe, in reverse order every
    other pass, so that a slow spell of the machine (on a small VM a few seconds of
    it can triple a probe's time) lands on every broker alike instead of on whichever
    was being probed then. The first ``warmup`` passes are not counted: a worker
    just started has not run a task yet.

    The idle gap before each probe is drawn at random up to ``max_gap``. A polling
    consumer (kombu's SQLAlchemy transport sleeps a second between empty polls) restarts
    its rhythm after each task; a fixed short gap would land every probe at the same
    point of that rhythm. A gap spread over a whole polling interval measures what a
    task meets on a worker that has been idle a while. A broker whose probe fails is
    reported with its error and the others go on.
    """
    outcome: dict[str, dict[str, Any] | PhaseError] = {}
    millis: dict[str, list[float]] = {name: [] for name in probes}
    # How much of it the apply_async call itself took (commit, confirm, round trip).
    called: dict[str, list[float]] = {name: [] for name in probes}
    for seq in range(warmup + samples):
        pending = [name for name in probes if name not in outcome]
        for name in in_turn(pending, seq):
            time.sleep(random.uniform(MIN_PROBE_GAP, max(max_gap, MIN_PROBE_GAP)))
            try:
                took, call = probes[name](seq)
            except Exception as exc:  # any broker error ends that broker's phase only
                outcome[name] = (
                    exc
                    if isinstance(exc, PhaseError)
                    else PhaseError(f"probe {seq} failed: {type(exc).__name__}: {exc}")
                )
                continue
            if seq >= warmup:
                millis[name].append(took)
                called[name].append(call)
    for name in probes:
        if name not in outcome:
            outcome[name] = {
                **summarize(millis[name]),
                "publish_call_p50_ms": percentile(called[name], 0.50),
                "publish_call_p99_ms": percentile(called[name], 0.99),
                # Each probe's time after its publish returned (the wake-up, the claim
                # or delivery, the dispatch to the pool): the part above the floor a
                # durable publish sets, where the call waits for its commit's flush.
                **_after_publish(millis[name], called[name]),
                "samples_ms": [round(m, 3) for m in millis[name]],
            }
    return outcome


def _after_publish(millis: list[float], called: list[float]) -> dict[str, float]:
    """p50 and p99 of each probe's latency minus its own publish call, in ms."""
    after = [took - call for took, call in zip(millis, called, strict=True)]
    if not after:
        return {}
    return {
        "after_publish_p50_ms": percentile(after, 0.50),
        "after_publish_p99_ms": percentile(after, 0.99),
    }


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile: an observed value, so p50 <= p99 always holds."""
    ordered = sorted(values)
    # The epsilon keeps float noise (0.29 * 100 = 28.999…) from moving the rank.
    rank = math.ceil(fraction * len(ordered) - 1e-9)
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def summarize(millis: list[float]) -> dict[str, Any]:
    return {
        "samples": len(millis),
        "p50_ms": percentile(millis, 0.50),
        "p99_ms": percentile(millis, 0.99),
        "mean_ms": sum(millis) / len(millis),
        "min_ms": min(millis),
        "max_ms": max(millis),
    }
