"""Where one publish's time goes, layer by layer: pgq next to Redis, from one producer.

``python -m benchmarks.layers`` publishes no-op tasks with ``apply_async`` from this
process through each broker in turn (``--tasks`` a round, every broker once a round,
in reverse order every other round) and times each call at three depths:

- ``apply_async``: the whole call;
- ``call``: kombu's ``Producer._publish`` inside it, the broker's part (the broker
  benchmark's ``call us``);
- ``wire``: the broker's own round trips inside that: for pgq the statements sent
  through libpq (``wire.run_apart`` and ``Statement.execute``: the INSERT, its wake-up,
  a flush), for Redis redis-py's commands (the LPUSH).

Reported per broker, as the median over every call of every round: each depth, the
Python in the call around the round trips (``call`` minus ``wire``) and the rest of
``apply_async`` (``apply_async`` minus ``call``), all in µs; and the publish rate. Set
against each other, they say what a gap in publish rate is made of: the durable
commit's WAL flush shows as ``wire`` of ``pgq`` minus ``wire`` of ``pgq-async``.

Two lines under the table bound what any change to pgq's Python could win:

- ``without python``: each broker's ``apply_async`` with the Python of its broker call
  (kombu's and the transport's) taking no time, call by call (``apply_async`` minus
  ``call`` plus ``wire``), as a publish rate ÷ Redis's. Below 1, no client code
  reaches Redis's rate: the round trips alone are slower than Redis's whole call.
- ``pgq's INSERT through pgbench``: the ``enqueue`` statement a publish sends, with a
  message this run published, through pgbench (C, prepared, one connection), durable
  and with ``synchronous_commit`` off: that statement's cost with no Python client at
  all, next to pgq's ``wire`` (``--pgbench-seconds 0`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import psycopg
import redis.client
from psycopg import sql

from benchmarks.app import DRAIN, TASK_NAME, make_app
from benchmarks.brokers import default_pg_url, make_brokers, patched_environ
from benchmarks.pgbench import run_pgq_insert, seconds
from benchmarks.phases import Clock, broker_call_clock, in_turn
from benchmarks.targets import Broker, Target
from pg_transport.db import wire
from pg_transport.publish import publisher as store

__all__ = ["Layers", "insert_floor", "main", "measure", "publisher", "without_python"]

BROKERS = ("pgq", "pgq-async", "redis", "redis-fsync")
DEPTHS = ("apply_async", "call", "wire")


@dataclass
class Layers:
    """One broker's calls: for each depth, the seconds of every call, in call order."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {depth: [] for depth in DEPTHS})
    published: int = 0
    elapsed: float = 0.0

    def summary(self) -> dict[str, float]:
        """Medians in µs (of each depth, and of the differences call by call) and the
        rate in publishes a second."""
        s = self.seconds
        per_call = {
            "apply_async_us": s["apply_async"],
            "call_us": s["call"],
            "wire_us": s["wire"],
            "python_in_call_us": [c - w for c, w in zip(s["call"], s["wire"], strict=True)],
            "outside_call_us": [a - c for a, c in zip(s["apply_async"], s["call"], strict=True)],
            # The publish had the Python of its broker call taken no time.
            "without_python_us": [
                a - c + w for a, c, w in zip(s["apply_async"], s["call"], s["wire"], strict=True)
            ],
        }
        found = {name: median(values) * 1e6 for name, values in per_call.items()}
        found["rate"] = self.published / self.elapsed if self.elapsed else 0.0
        return found


@contextlib.contextmanager
def _round_trip_clock() -> Iterator[Clock]:
    """A clock on the brokers' round trips (pgq's statements through libpq, redis-py's
    commands), while this is open."""
    trips = Clock()
    patched: list[tuple[Any, str]] = [
        (wire, "run_apart"),
        (wire.Statement, "execute"),
        (redis.client.Redis, "execute_command"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]
    # The publisher imported run_apart by name: that name is the one it calls.
    originals.append((store, "run_apart", getattr(store, "run_apart")))  # noqa: B009
    try:
        for owner, name in patched:
            setattr(owner, name, trips.wrap(getattr(owner, name)))
        setattr(store, "run_apart", wire.run_apart)  # noqa: B010
        yield trips
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def publisher(target: Target) -> Callable[[int], None]:
    """``publish(seq)``: one drain task through ``target`` with ``apply_async``."""
    app = make_app(target.broker_url, target.queue, target.transport_options)
    task = app.tasks[TASK_NAME]
    return lambda seq: task.apply_async((DRAIN, seq, 0.0))


def measure(targets: dict[str, Target], tasks: int, rounds: int) -> dict[str, Layers]:
    """Publish ``tasks`` a round through each target, ``rounds`` times, in turn."""
    found = {name: Layers() for name in targets}
    publishers: dict[str, Callable[[int], None]] = {}
    for name, target in targets.items():
        with patched_environ(target.env):
            publishers[name] = publisher(target)
            publishers[name](0)  # connect, declare, migrate: not measured
    with broker_call_clock() as in_call, _round_trip_clock() as trips:
        for turn in range(rounds):
            for name in in_turn(list(targets), turn):
                layers, publish = found[name], publishers[name]
                with patched_environ(targets[name].env):
                    trips.take()
                    began = time.perf_counter()
                    for seq in range(tasks):
                        start, call_before = time.perf_counter(), in_call()
                        publish(seq + 1)
                        layers.seconds["apply_async"].append(time.perf_counter() - start)
                        layers.seconds["call"].append(in_call() - call_before)
                        layers.seconds["wire"].append(trips.take())
                    layers.elapsed += time.perf_counter() - began
                    layers.published += tasks
    return found


def without_python(
    summaries: dict[str, dict[str, float]], against: str = "redis"
) -> dict[str, float]:
    """Each other broker's publish rate ÷ ``against``'s, had the Python of its broker
    call taken no time (``against``'s as measured); empty without ``against``."""
    if against not in summaries:
        return {}
    theirs = summaries[against]["apply_async_us"]
    return {
        name: theirs / found["without_python_us"]
        for name, found in summaries.items()
        if name != against and found["without_python_us"] > 0
    }


def insert_floor(
    pg_url: str, targets: dict[str, Target], seconds: float
) -> dict[str, dict[str, Any]]:
    """pgq's INSERT through pgbench, durable and with ``synchronous_commit`` off, on the
    first pgq target's schema, with the first message published there (see
    :func:`benchmarks.pgbench.run_pgq_insert`); empty without a pgq target or with
    ``seconds`` 0."""
    pgq = [target for name, target in targets.items() if name.startswith("pgq")]
    if not pgq or seconds <= 0:
        return {}
    target = pgq[0]
    schema = target.transport_options["schema"]
    query = sql.SQL("SELECT payload::text FROM {}.message WHERE queue = %s ORDER BY id LIMIT 1")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(query.format(sql.Identifier(schema)), (target.queue,)).fetchone()
    if row is None:
        return {}
    return {
        kind: run_pgq_insert(
            pg_url, schema, target.queue, row[0], seconds=seconds, durable=kind == "durable"
        )
        for kind in ("durable", "committed")
    }


def brokers(args: argparse.Namespace) -> dict[str, Broker]:
    """The brokers named, made as the broker benchmark makes them."""
    chosen = argparse.Namespace(**{**vars(args), "brokers": ",".join(args.brokers)})
    return {broker.name: broker for broker in make_brokers(chosen)}


def _brokers_arg(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(BROKERS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown broker(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(BROKERS)}"
        )
    return names


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The brokers to publish through and where they are (``--brokers``, a subset of
    :data:`BROKERS`), as :func:`brokers` takes them."""
    parser.add_argument(
        "--brokers",
        type=_brokers_arg,
        default=["pgq", "pgq-async", "redis"],
        help=f"subset of {','.join(BROKERS)} (default pgq,pgq-async,redis)",
    )
    parser.add_argument("--pg-url", default=default_pg_url(), help="Postgres for pgq (libpq URL)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis server")
    parser.add_argument(
        "--redis-db",
        type=int,
        default=13,
        help="Redis db of the Redis broker (flushed; default 13)",
    )
    # What make_brokers asks of the brokers this benchmark does not offer (RabbitMQ) or
    # leaves as they are by default (Redis-fsync's data in the temporary directory).
    parser.set_defaults(redis_fsync_dir=None, amqp_url="")


def add_run_arguments(
    parser: argparse.ArgumentParser, *, tasks: int, tasks_help: str, rounds: int
) -> None:
    """How much a publishing benchmark runs (``--tasks``, ``--rounds``) and ``--json``."""
    parser.add_argument(
        "--tasks", type=positive, default=tasks, help=f"{tasks_help} (default {tasks})"
    )
    parser.add_argument(
        "--rounds", type=positive, default=rounds, help=f"rounds (default {rounds})"
    )
    parser.add_argument("--json", action="store_true", help="JSON on stdout instead of the table")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.layers", description=(__doc__ or "").split("\n")[0]
    )
    add_broker_arguments(parser)
    add_run_arguments(parser, tasks=3000, tasks_help="publishes a round", rounds=3)
    parser.add_argument(
        "--pgbench-seconds",
        type=seconds,
        default=3.0,
        help="length of each pgbench run of pgq's INSERT (0: skip them)",
    )
    return parser.parse_args(argv)


def format_table(
    summaries: dict[str, dict[str, float]],
    ceilings: dict[str, float] | None = None,
    floor: dict[str, dict[str, Any]] | None = None,
) -> str:
    head = ("broker", "publish/s", "apply_async", "call", "wire", "py in call", "outside")
    keys = ("rate", "apply_async_us", "call_us", "wire_us", "python_in_call_us", "outside_call_us")
    lines = [f"{head[0]:<14}" + "".join(f"{h:>13}" for h in head[1:])]
    for name, found in summaries.items():
        lines.append(f"{name:<14}" + "".join(f"{found[k]:>13.0f}" for k in keys))
    lines.append(
        "µs per publish, medians over every call; wire: the broker's round trips "
        "(pgq: its statements through libpq; Redis: its commands)"
    )
    if ceilings:
        lines.append(
            "without python (the broker call's Python taking no time), publish "
            "÷ redis: " + ", ".join(f"{n} {r:.2f}x" for n, r in ceilings.items())
        )
    if floor:
        said = [
            f"{kind} {found['latency_us']:.0f} µs"
            if found["status"] == "ok"
            else f"{kind} {found['status']} ({found['reason']})"
            for kind, found in floor.items()
        ]
        lines.append(
            "pgq's INSERT through pgbench (one connection, prepared), per "
            "statement: " + ", ".join(said)
        )
    return "\n".join(lines)


@contextlib.contextmanager
def targets_of(args: argparse.Namespace) -> Iterator[dict[str, Target]]:
    """The brokers ``args`` names that answer (the others skipped, the reason printed),
    each set up for this run, by name; torn down on the way out."""
    made = brokers(args)
    unusable = {name: reason for name, b in made.items() if (reason := b.check())}
    for name, reason in unusable.items():
        print(f"[{name}] skipped: {reason}", file=sys.stderr)
    run_id = uuid.uuid4().hex[:10]
    targets: dict[str, Target] = {}
    try:
        for name, broker in made.items():
            if name not in unusable:
                targets[name] = broker.setup(f"{run_id}_{name.replace('-', '_')}")
        yield targets
    finally:
        for name, target in targets.items():
            made[name].teardown(target)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with targets_of(args) as targets:
        summaries = {
            name: layers.summary()
            for name, layers in measure(targets, args.tasks, args.rounds).items()
        }
        floor = insert_floor(args.pg_url, targets, args.pgbench_seconds)
    ceilings = without_python(summaries)
    if args.json:
        found = {"brokers": summaries, "without_python": ceilings, "pgq_insert": floor}
        print(json.dumps(found, indent=2))
    else:
        print(format_table(summaries, ceilings, floor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
