"""Publish rate in batches (``pg_transport.batch()``) next to one publish at a time.

``python -m benchmarks.batch`` publishes ``--tasks`` no-op tasks a round with
``apply_async`` from this process through each broker in turn (in reverse order every
other round). Each pgq variant publishes twice a round: one message per transaction, as
any Celery app does, and ``--batch-size`` messages per transaction, the ``apply_async``
calls inside ``with pg_transport.batch():``. A batch waits for one WAL flush, where
one-at-a-time durable publishing waits for one per message.

Reported: each way's publishes per second (the median over the rounds) and its rate ÷
Redis's, all measured in this run. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from statistics import median

import pg_transport
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

__all__ = ["Way", "main", "measure", "parse_args", "publish_all"]

#: (broker name, messages per batch: 0 for one publish at a time)
Way = tuple[str, int]


def label(way: Way) -> str:
    name, size = way
    return f"{name} batch {size}" if size else name


def publish_all(publish: Callable[[int], None], tasks: int, size: int) -> None:
    """``tasks`` publishes (sequence numbers 1 to ``tasks``), ``size`` to a batch (0:
    one at a time, no batch)."""
    if not size:
        for seq in range(1, tasks + 1):
            publish(seq)
        return
    for start in range(1, tasks + 1, size):
        with pg_transport.batch():
            for seq in range(start, min(start + size, tasks + 1)):
                publish(seq)


def measure(
    targets: dict[str, Target], tasks: int, rounds: int, size: int
) -> dict[str, list[float]]:
    """Each way's publish rate in every round, by :func:`label`."""
    publishers: dict[str, Callable[[int], None]] = {}
    for name, target in targets.items():
        with patched_environ(target.env):
            publishers[name] = publisher(target)
            publishers[name](0)  # connect, declare, migrate: not measured
    ways: list[Way] = [(name, 0) for name in targets]
    ways += [(name, size) for name in targets if name.startswith("pgq")]
    rates: dict[str, list[float]] = {label(way): [] for way in ways}
    for turn in range(rounds):
        for way in in_turn(ways, turn):
            name, batch_size = way
            with patched_environ(targets[name].env):
                began = time.perf_counter()
                publish_all(publishers[name], tasks, batch_size)
                rates[label(way)].append(tasks / (time.perf_counter() - began))
    return rates


def summary(rates: dict[str, list[float]], against: str = "redis") -> dict[str, dict[str, float]]:
    """Each way's median rate, and its ratio to ``against``'s where that was measured."""
    medians = {way: median(found) for way, found in rates.items()}
    theirs = medians.get(against)
    return {
        way: {"rate": rate, **({f"ratio_to_{against}": rate / theirs} if theirs else {})}
        for way, rate in medians.items()
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.batch", description=(__doc__ or "").split("\n")[0]
    )
    add_broker_arguments(parser)
    add_run_arguments(parser, tasks=3000, tasks_help="publishes a round, each way", rounds=3)
    parser.add_argument(
        "--batch-size", type=positive, default=100, help="messages per batch (default 100)"
    )
    return parser.parse_args(argv)


def format_table(found: dict[str, dict[str, float]]) -> str:
    lines = [f"{'way':<24}{'publish/s':>12}{'÷ redis':>10}"]
    for way, numbers in found.items():
        ratio = numbers.get("ratio_to_redis")
        lines.append(
            f"{way:<24}{numbers['rate']:>12.0f}"
            + (f"{ratio:>9.2f}x" if ratio is not None else f"{'-':>10}")
        )
    lines.append("medians over the rounds; one producer, apply_async in a loop")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with targets_of(args) as targets:
        found = summary(measure(targets, args.tasks, args.rounds, args.batch_size))
    if args.json:
        print(json.dumps({"batch_size": args.batch_size, "ways": found}, indent=2))
    else:
        print(format_table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
