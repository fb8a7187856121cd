"""How late an idle worker starts a countdown task, on pgq, Redis and RabbitMQ.

    python -m benchmarks.countdown [--tasks 200] [--spread 0.1,5] [--brokers pgq,redis,rabbitmq]

For each reachable broker a fresh Celery worker (default settings, prefork pool,
concurrency 2) is started; once it is ready and idle, ``--tasks`` no-op tasks are sent
at once with an eta spread at random over ``--spread`` seconds from now, and each task
reports to a Redis sink when it started. Lateness is start minus eta: p50, p99 and the
worst in ms, and pgq's ratios to the others. On pgq the task waits in Postgres until it
is due and the idle worker claims it then; on Redis and RabbitMQ the worker holds it in
memory and Celery's own timer starts it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.app import LATENCY, TASK_NAME, Sink, make_app
from benchmarks.brokers import default_pg_url, patched_environ
from benchmarks.phases import PhaseError, percentile, wait_ready
from benchmarks.targets import AmqpBroker, Broker, PgqBroker, RedisBroker
from benchmarks.worker import WorkerSpec, start_worker

__all__ = ["main", "measure"]

BROKERS = ("pgq", "redis", "rabbitmq")
# Latency probes before the countdowns, so the worker's first-task costs are paid.
WARMUP = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.countdown", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--tasks", type=int, default=200, help="countdown tasks per broker (default 200)")
    add("--spread", default="0.1,5", help="shortest,longest countdown in s (default 0.1,5)")
    add("--brokers", default=",".join(BROKERS), help=f"subset of {','.join(BROKERS)}")
    add("--pg-url", default=default_pg_url(), help="Postgres for pgq (libpq URL)")
    add("--redis-url", default="redis://127.0.0.1:6379", help="Redis (broker and sink)")
    add("--redis-db", type=int, default=13, help="Redis db of the Redis broker (flushed)")
    add("--sink-db", type=int, default=12, help="Redis db of the timing sink")
    add("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//", help="RabbitMQ")
    add("--seed", type=int, default=1, help="random seed of the countdowns")
    add("--rounds", type=int, default=1, help="turns of every broker (order reversed each round)")
    add("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    low, _, high = args.spread.partition(",")
    try:
        args.low, args.high = float(low), float(high)
    except ValueError:
        parser.error(f"--spread must be two numbers, 'shortest,longest'; got {args.spread!r}")
    if not 0 < args.low <= args.high or args.tasks < 1 or args.rounds < 1:
        parser.error("--spread needs 0 < shortest <= longest, --tasks and --rounds at least 1")
    unknown = set(args.brokers.split(",")) - set(BROKERS)
    if unknown:
        parser.error(f"unknown broker(s) {', '.join(sorted(unknown))}; known: {', '.join(BROKERS)}")
    return args


def make_brokers(args: argparse.Namespace) -> list[Broker]:
    every: dict[str, Broker] = {
        "pgq": PgqBroker(args.pg_url),
        "redis": RedisBroker(args.redis_url, args.redis_db),
        "rabbitmq": AmqpBroker(args.amqp_url),
    }
    return [every[name] for name in BROKERS if name in args.brokers.split(",")]


def _collected(sink: Sink, first: int) -> list[tuple[int, float, float]]:
    found = []
    for raw in sink.client().lrange(sink.latency_key, 0, -1):
        seq, due, started = raw.decode().split()
        if int(seq) >= first:
            found.append((int(seq), float(due), float(started)))
    return found


def measure(broker: Broker, args: argparse.Namespace, sink_url: str) -> dict[str, Any]:
    """Lateness of ``args.tasks`` countdowns on one broker (ms: p50, p99, max, min)."""
    run_id = uuid.uuid4().hex[:8]
    target = broker.setup(run_id)
    sink = Sink(sink_url, f"countdown:{run_id}")
    spec = WorkerSpec("prefork", 2, 4, sink_url)
    log = Path(tempfile.mkstemp(prefix=f"pgq-countdown-{broker.name}-", suffix=".log")[1])
    load_before = os.getloadavg()
    try:
        with patched_environ(target.env):
            app = make_app(target.broker_url, target.queue, target.transport_options)
            task = app.tasks[TASK_NAME]
            worker = start_worker(target, spec, f"countdown-{broker.name}", sink.prefix, log)
            try:
                wait_ready(worker, sink, 0, 60)
                for seq in range(WARMUP):
                    task.apply_async(args=(LATENCY, seq, time.time()))
                _wait_for(sink, worker, WARMUP, 30)
                time.sleep(0.5)  # idle: every warm-up task done, the worker waits
                rng = random.Random(args.seed)
                first = WARMUP
                with app.producer_or_acquire() as producer:
                    for n in range(args.tasks):
                        due = time.time() + rng.uniform(args.low, args.high)
                        eta = dt.datetime.fromtimestamp(due, tz=dt.timezone.utc)
                        task.apply_async(args=(LATENCY, first + n, due), eta=eta, producer=producer)
                _wait_for(sink, worker, WARMUP + args.tasks, args.high + 60)
                rows = _collected(sink, first)
            finally:
                worker.stop()
                sink.client().delete(*sink.keys())
    finally:
        broker.teardown(target)
        log.unlink(missing_ok=True)
    late = [(started - due) * 1000.0 for _, due, started in rows]
    return {
        **_summary(late),
        "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
        "late_ms": [round(ms, 3) for ms in late],
    }


def _summary(late: list[float]) -> dict[str, Any]:
    return {
        "tasks": len(late),
        "p50_ms": percentile(late, 0.50),
        "p99_ms": percentile(late, 0.99),
        "max_ms": max(late),
        "min_ms": min(late),
    }


def _wait_for(sink: Sink, worker: Any, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    client = sink.client()
    while int(client.llen(sink.latency_key)) < count:
        if not worker.alive():
            raise PhaseError(f"worker exited (code {worker.proc.returncode})")
        if time.monotonic() > deadline:
            raise PhaseError(f"only {client.llen(sink.latency_key)} of {count} tasks ran")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sink_url = str(RedisBroker(args.redis_url, args.sink_db).url)
    results: dict[str, Any] = {}
    brokers = []
    for broker in make_brokers(args):
        why = broker.check()
        if why is not None:
            results[broker.name] = {"skipped": why}
        else:
            brokers.append(broker)
    # Rounds: every broker in turn, the order reversed every other round, so that a
    # slow spell of a shared machine weighs on each alike; each turn's load average
    # is kept with its figures.
    turns: dict[str, list[dict[str, Any]]] = {b.name: [] for b in brokers}
    for n in range(args.rounds):
        for broker in brokers if n % 2 == 0 else brokers[::-1]:
            turns[broker.name].append(measure(broker, args, sink_url))
    for name, measured in turns.items():
        late = [ms for m in measured for ms in m["late_ms"]]
        results[name] = {
            **_summary(late),
            "rounds": [{k: v for k, v in m.items() if k != "late_ms"} for m in measured],
        }
    pgq = results.get("pgq", {})
    ratios = {
        f"pgq/{name}": {k: pgq[k] / other[k] for k in ("p50_ms", "p99_ms") if other.get(k)}
        for name, other in results.items()
        if name != "pgq" and "p50_ms" in pgq and "p50_ms" in other
    }
    report = {
        "spread_s": [args.low, args.high],
        "rounds": args.rounds,
        "brokers": results,
        "ratios": ratios,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.tasks} countdowns over {args.low}-{args.high} s to an idle worker:")
    print(f"{'broker':<10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'min ms':>8}")
    for name, found in results.items():
        if "skipped" in found:
            print(f"{name:<10} skipped: {found['skipped']}")
            continue
        loads = " ".join(f"{r['loadavg']['before'][0]:.1f}" for r in found["rounds"])
        print(
            f"{name:<10} {found['p50_ms']:8.1f} {found['p99_ms']:8.1f} "
            f"{found['max_ms']:8.1f} {found['min_ms']:8.1f}   load {loads}"
        )
    for name, found in ratios.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
