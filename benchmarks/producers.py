"""Publish rate from several producers at once: pgq next to Redis.

``python -m benchmarks.producers`` measures bursts: for each count of producers
(``--producers``, say 1,2,4,8) and each broker in turn (in reverse order every other
round), that many producer processes are started; each builds the benchmark's Celery app
and publishes one untimed task (connect, declare, migrate), then all of them wait for
one another and publish ``--tasks`` no-op tasks each with ``apply_async``. A burst's rate
is all its timed publishes over the time from the first producer's start to the last
one's end (the monotonic clock, which the processes of one machine share). The queue is
purged after each burst, so every burst starts on an empty one.

Also reported: the share of the machine's CPU time that was busy during the burst
(``/proc/stat``, Linux only): on a small machine the producers and the broker share the
cores, and a burst that keeps them all busy measures the CPU each publish costs, client
and server together, more than the broker's wait for its disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from statistics import median
from typing import Any

from kombu.connection import Connection

from benchmarks.brokers import patched_environ
from benchmarks.layers import (
    add_broker_arguments,
    add_run_arguments,
    positive,
    publisher,
    targets_of,
)
from benchmarks.phases import in_turn
from benchmarks.targets import Target

__all__ = ["Burst", "cpu_ticks", "main", "measure", "parse_args"]

PROC_STAT = Path("/proc/stat")
_BROKEN = "BrokenBarrierError"


@dataclass
class Burst:
    """One burst: every producer's (start, end) on the shared monotonic clock."""

    spans: list[tuple[float, float]]
    tasks: int
    cpu_busy: float | None = None

    @property
    def published(self) -> int:
        return self.tasks * len(self.spans)

    @property
    def seconds(self) -> float:
        return max(end for _, end in self.spans) - min(start for start, _ in self.spans)

    @property
    def rate(self) -> float:
        return self.published / self.seconds


@dataclass
class Series:
    """One broker's bursts, by count of producers."""

    bursts: dict[int, list[Burst]] = field(default_factory=dict)

    def summary(self) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for count, bursts in sorted(self.bursts.items()):
            busy = [b.cpu_busy for b in bursts if b.cpu_busy is not None]
            found[count] = {
                "rate": median(b.rate for b in bursts),
                "rates": [b.rate for b in bursts],
                "cpu_busy": median(busy) if busy else None,
            }
        return found


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the machine so far; None where ``/proc/stat`` is not."""
    try:
        first = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(value) for value in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def _busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _produce(target: Target, tasks: int, start: Barrier, out: Any) -> None:
    """One producer: ready, then (with the others) ``tasks`` publishes; puts
    ("ok", start, end) or ("failed", traceback) on ``out``."""
    try:
        with patched_environ(target.env):
            publish = publisher(target)
            publish(0)  # connect, declare, migrate: not timed
            start.wait()
            began = time.monotonic()
            for seq in range(tasks):
                publish(seq + 1)
            out.put(("ok", began, time.monotonic()))
    except BaseException:  # (a broken barrier too: another producer failed)
        out.put(("failed", traceback.format_exc()))
        start.abort()


def burst(target: Target, producers: int, tasks: int, timeout: float) -> Burst:
    """``producers`` processes publishing ``tasks`` each through ``target`` at once."""
    context = multiprocessing.get_context("fork")  # (the target as it is, unpickled)
    start = context.Barrier(producers + 1, timeout=timeout)
    out = context.Queue()
    processes = [
        context.Process(target=_produce, args=(target, tasks, start, out), daemon=True)
        for _ in range(producers)
    ]
    for process in processes:
        process.start()
    try:
        # Broken: a producer failed getting ready, and its report says how.
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait()
        before = cpu_ticks()
        try:  # one report from each producer, whatever happened
            reports = [out.get(timeout=timeout) for _ in processes]
        except queue.Empty:
            raise RuntimeError(f"a producer did not report within {timeout:.0f} s") from None
        after = cpu_ticks()
    finally:
        for process in processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
    # The first failure, not the others' broken barrier that followed it.
    failed = sorted((r for r in reports if r[0] == "failed"), key=lambda r: _BROKEN in r[1])
    if failed:
        raise RuntimeError(f"a producer failed: {failed[0][1]}")
    return Burst([(r[1], r[2]) for r in reports], tasks, _busy(before, after))


def purge(target: Target) -> int:
    """Empty the target's queue; how many messages were in it."""
    connection = Connection(  # type: ignore[no-untyped-call]
        target.broker_url, transport_options=target.transport_options
    )
    with patched_environ(target.env), connection as conn:
        return int(conn.default_channel.queue_purge(target.queue) or 0)


def measure(
    targets: dict[str, Target],
    counts: list[int],
    tasks: int,
    rounds: int,
    timeout: float = 300.0,
) -> dict[str, Series]:
    """Bursts of each count of producers through every target, in turn, ``rounds`` times."""
    found = {name: Series() for name in targets}
    for turn in range(rounds):
        for count in counts:
            for name in in_turn(list(targets), turn):
                made = burst(targets[name], count, tasks, timeout)
                found[name].bursts.setdefault(count, []).append(made)
                purge(targets[name])
    return found


def _counts_arg(text: str) -> list[int]:
    try:
        counts = [positive(part) for part in text.split(",") if part]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"producer counts must be whole numbers of at least 1, comma-separated: {exc}"
        ) from exc
    if not counts:
        raise argparse.ArgumentTypeError("no producer count given")
    return sorted(set(counts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.producers", description=(__doc__ or "").split("\n")[0]
    )
    add_broker_arguments(parser)
    parser.add_argument(
        "--producers",
        type=_counts_arg,
        default=[1, 2, 4],
        help="counts of producer processes, comma-separated (default 1,2,4)",
    )
    add_run_arguments(
        parser, tasks=2000, tasks_help="publishes of each producer in a burst", rounds=2
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a burst may take (default 300)"
    )
    return parser.parse_args(argv)


def format_table(summaries: dict[str, dict[int, dict[str, Any]]]) -> str:
    names = list(summaries)
    reference = "redis" if "redis" in summaries else names[0]
    counts = sorted({count for summary in summaries.values() for count in summary})
    lines = [f"{'producers':<10}" + "".join(f"{name:>24}" for name in names)]
    for count in counts:
        base = summaries[reference][count]["rate"]
        cells = []
        for name in names:
            found = summaries[name][count]
            busy = "" if found["cpu_busy"] is None else f" {found['cpu_busy']:4.0%}"
            cells.append(f"{found['rate']:.0f} {found['rate'] / base:.2f}x{busy}")
        lines.append(f"{count:<10}" + "".join(f"{cell:>24}" for cell in cells))
    lines.append(
        f"publishes/s, medians over the rounds; then the ratio to {reference} and "
        "the machine's CPU busy during the bursts"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with targets_of(args) as targets:
        found = measure(targets, args.producers, args.tasks, args.rounds, args.timeout)
        summaries = {name: series.summary() for name, series in found.items()}
    print(json.dumps(summaries, indent=2) if args.json else format_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
