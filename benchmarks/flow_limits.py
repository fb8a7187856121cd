"""Flow limits on a fleet of real Celery workers: a global rate, and a concurrency per key.

    python -m benchmarks.flow_limits [--part a,b] [--rate 50] [--seconds 60] [--workers 4]
        [--keys 100] [--per-key 12] [--limit 3] [--task-ms 300] [--json]

Issue 47's benchmark, parts (a) and (b) (docs/design/flow-control.md, "The benchmark").
Every measurement gets a fresh pgq schema and queue, and ``--workers`` worker processes
(``benchmarks.flow_limits_app``, prefetch multiplier 1, acks late), started once all its
tasks are published (``pg_transport.batch()``, 500 to a transaction) and stopped once it
is done. A task's start is the database's ``clock_timestamp()`` taken by the task body
itself (a row it inserts): one clock for the whole fleet, none of it the publisher's.

(a) Global rate: a backlog of ``flow.paced`` (``pgq_rate_limit="<rate>/s"``, burst 1) on
    the fleet (``--pool``, ``--concurrency`` each) for ``--seconds``. The window starts
    when every worker is ready and has started a task (``max(last ready, first start)``).
    Reported: starts in the window ÷ its length (the achieved rate; within 5 % of the
    rate is the target), the most starts in any one second (any sliding 1-s window over
    the whole run, which must not pass ``rate * 1.1``; GCRA allows ``rate + burst``), the
    most in a calendar second, and each worker's share. Then the same fleet with
    Celery's own ``rate_limit="<rate>/s"`` (``flow.celery_paced``, ``--celery-seconds``),
    which each worker applies on its own: the fleet over-runs by up to the number of
    workers.
(b) Concurrency per key: ``--keys`` * ``--per-key`` tasks of ``flow.per_key``
    (``concurrency_key``, ``concurrency_limit=--limit``; each sleeps ``--task-ms`` then
    records its end), published key after key (the oldest messages all of one key: the
    hardest order for the limit), drained by the fleet (``--b-pool``,
    ``--b-concurrency`` each). Reported: the most tasks of one key running at once
    (must not pass ``--limit``), the most tasks and keys running at once, their means
    over the drain (time-weighted), and the bound min(fleet slots, keys * limit).

The guarantees (exit status 1 when one is broken): the claims never grant more than
``rate + burst`` leases in any 1 s (a row trigger the harness adds records every grant's
time), no task runs twice, no key ever has more than ``--limit`` running. The targets
(reported): achieved rate within 5 %, no 1 s with more than ``rate * 1.1`` starts.
The load average is recorded before and after each measurement (the machine may be
shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import pg_transport
from benchmarks import flow_limits_app as fapp
from benchmarks.brokers import default_pg_url, patched_environ
from benchmarks.worker import ROOT, Worker

__all__ = ["analyse_keys", "analyse_rate", "main", "parse_args"]

PUBLISH_BATCH = 500
RATE_SLACK = 1.1  # "no second with more than 55 starts" at 50/s
RATE_TOLERANCE = 0.05  # "achieved rate within 5 %"
POLL = 0.25


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.flow_limits", description=(__doc__ or "").split("\n\n")[0]
    )
    add = parser.add_argument
    add("--part", default="a,b", help="parts to run, of a and b (a,b)")
    add("--rate", type=int, default=50, help="(a) the global rate, starts per second (50)")
    add("--burst", type=int, default=1, help="(a) pgq's burst, pgq_rate_burst (1)")
    add("--seconds", type=float, default=60.0, help="(a) the measured window, s (60)")
    add("--celery-seconds", type=float, help="(a) Celery's window, s (as --seconds; 0 skips)")
    add("--workers", type=int, default=4, help="worker processes of the fleet (4)")
    add("--pool", default="prefork", help="(a) each worker's pool (prefork)")
    add("--concurrency", type=int, default=2, help="(a) each worker's pool size (2)")
    add("--keys", type=int, default=100, help="(b) keys (100)")
    add("--per-key", type=int, default=12, help="(b) tasks per key (12)")
    add("--limit", type=int, default=3, help="(b) tasks of a key at once (3)")
    add("--task-ms", type=float, default=300.0, help="(b) each task's time, ms (300)")
    add("--b-pool", default="threads", help="(b) each worker's pool (threads)")
    add("--b-concurrency", type=int, default=16, help="(b) each worker's pool size (16)")
    add("--pg-url", default=default_pg_url(), help="Postgres for pgq (libpq URL)")
    add("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.part.split(",") if p.strip()]
    if not args.parts or set(args.parts) - {"a", "b"}:
        parser.error(f"--part takes a, b or a,b; got {args.part!r}")
    if args.celery_seconds is None:
        args.celery_seconds = args.seconds
    whole = (
        args.rate,
        args.burst,
        args.workers,
        args.concurrency,
        args.keys,
        args.per_key,
        args.limit,
    )
    if min(*whole, args.b_concurrency) < 1:
        parser.error("--rate, --burst, --workers, --concurrency, --keys, --per-key, --limit and "
                     "--b-concurrency must be >= 1")  # fmt: skip
    if args.seconds < 1 or args.celery_seconds < 0 or args.task_ms < 0:
        parser.error("--seconds must be >= 1; --celery-seconds and --task-ms not negative")
    return args


# -- one measurement: schemas, workers, publishing ---------------------------------------


@dataclass
class Fleet:
    """One measurement's pgq schema and queue, its runs schema, and its workers."""

    pg_url: str
    label: str
    rate: int
    limit: int
    burst: int = 1
    schema: str = ""
    runs: str = ""
    queue: str = ""

    def __post_init__(self) -> None:
        run_id = uuid.uuid4().hex[:8]
        self.schema = f"flow_bench_{run_id}"
        self.runs = f"flow_runs_{run_id}"
        self.queue = f"flow_{self.label}_{run_id}"

    @property
    def broker_url(self) -> str:
        return "pgq://" + self.pg_url.split("://", 1)[1]

    def env(self) -> dict[str, str]:
        return {
            "PGQ_SCHEMA": self.schema,
            fapp.ENV_BROKER_URL: self.broker_url,
            fapp.ENV_QUEUE: self.queue,
            fapp.ENV_TRANSPORT_OPTIONS: json.dumps({"schema": self.schema}),
            fapp.ENV_PG_URL: self.pg_url,
            fapp.ENV_RUNS: self.runs,
            fapp.ENV_RATE: f"{self.rate}/s",
            fapp.ENV_CONCURRENCY: str(self.limit),
            fapp.ENV_BURST: str(self.burst),
        }

    def sql(self, query: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            names = {"runs": sql.Identifier(self.runs), "schema": sql.Identifier(self.schema)}
            cur = conn.execute(sql.SQL(query).format(**names), params)
            return cur.fetchall() if cur.description else []


@contextmanager
def fleet(pg_url: str, label: str, rate: int, limit: int, burst: int = 1) -> Iterator[Fleet]:
    f = Fleet(pg_url, label, rate, limit, burst)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(fapp.TABLES).format(runs=sql.Identifier(f.runs)))
    try:
        yield f
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            for schema in (f.schema, f.runs):
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


def publish(f: Fleet, task: str, calls: Iterator[tuple[Any, ...]]) -> float:
    """Every call's args as one ``task`` message, in batches; returns the seconds taken.
    The app is the workers' (same task attributes: pgq's limits travel as headers)."""
    began = time.monotonic()
    with patched_environ(f.env()):
        options = {"schema": f.schema}
        app = fapp.make_app(f.broker_url, f.queue, options, f"{f.rate}/s", f.limit, f.burst)
        try:
            batch: list[tuple[Any, ...]] = []
            for args in calls:
                batch.append(args)
                if len(batch) == PUBLISH_BATCH:
                    _send(app, task, batch)
                    batch = []
            _send(app, task, batch)
        finally:
            app.close()
    return time.monotonic() - began


def _send(app: Any, task: str, batch: list[tuple[Any, ...]]) -> None:
    if batch:
        with pg_transport.batch():
            for args in batch:
                app.send_task(task, args=args)


def start_workers(f: Fleet, count: int, pool: str, concurrency: int) -> list[Worker]:
    started: list[Worker] = []
    for n in range(count):
        name = f"{f.label}{n + 1}"
        env = dict(os.environ)
        env.update(f.env())
        env[fapp.ENV_WORKER] = name
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        log = Path(tempfile.mkstemp(prefix=f"pgq-flow-{name}-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "benchmarks.flow_limits_app", "worker",
                 "-P", pool, "-c", str(concurrency), "-Q", f.queue, "-n", f"{name}@%h",
                 "-l", "warning", "--without-gossip", "--without-mingle",
                 "--without-heartbeat"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        started.append(Worker(proc, log))
    return started


def stop_workers(workers: list[Worker]) -> list[str]:
    """Stop them all; the first problem lines of their logs."""
    trouble: list[str] = []
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(60)
        except subprocess.TimeoutExpired:
            w.stop()  # (alive: a second SIGTERM, then SIGKILL of its group)
        trouble += w.trouble()
        w.log.unlink(missing_ok=True)
    return trouble[:20]


def wait_until(what: str, done: Callable[[], bool], workers: list[Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        dead = [w for w in workers if not w.alive()]
        if dead:
            raise RuntimeError(f"{what}: a worker exited: {dead[0].trouble()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f}s")
        time.sleep(POLL)


def _epoch(t: datetime) -> float:
    return t.timestamp()


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- (a) the global rate -------------------------------------------------------------------


def analyse_rate(
    starts: list[float], workers: list[str], window_from: float, seconds: float, rate: float
) -> dict[str, Any]:
    """Starts (epoch seconds, any order) against a rate: in the window, per second."""
    starts = sorted(starts)
    in_window = [t for t in starts if window_from <= t < window_from + seconds]
    sliding, j = 0, 0
    for i, t in enumerate(starts):  # the most starts in any [t, t + 1 s)
        j = max(j, i)
        while j < len(starts) and starts[j] - t < 1.0:
            j += 1
        sliding = max(sliding, j - i)
    calendar = Counter(int(t) for t in starts)
    achieved = len(in_window) / seconds
    inside = Counter(int(t - window_from) for t in in_window)
    per_second = sorted(inside.get(s, 0) for s in range(int(seconds)))
    gaps = [b - a for a, b in pairwise(in_window)]
    return {
        "starts": len(starts),
        "window_starts": len(in_window),
        "window_seconds": seconds,
        "achieved_rate": round(achieved, 3),
        "achieved_vs_rate": round(achieved / rate, 4),
        "max_in_any_1s": sliding,
        "max_in_a_calendar_second": max(calendar.values(), default=0),
        "per_worker": dict(sorted(Counter(workers).items())),
        "window_second_min_median_max": per_second[:1]
        + per_second[len(per_second) // 2 :][:1]
        + per_second[-1:],
        "longest_gap_ms": round(max(gaps, default=0.0) * 1000, 1),
    }


def part_a(args: argparse.Namespace, task: str, seconds: float, label: str) -> dict[str, Any]:
    """One fleet on a backlog of ``task`` for ``seconds``."""
    celery = task == fapp.CELERY_PACED
    # Enough for the window and the start-up: Celery's fleet may run workers * rate.
    backlog = int(args.rate * (args.workers if celery else 1) * (seconds + 30))
    before = load()
    with fleet(args.pg_url, label, args.rate, args.limit, args.burst) as f:
        publish_s = publish(f, task, iter([()] * backlog))
        f.sql(fapp.CLAIMS)
        workers = start_workers(f, args.workers, args.pool, args.concurrency)
        try:
            ready_q = "SELECT max(at), count(*) FROM {runs}.ready"
            wait_until("workers ready", lambda: f.sql(ready_q)[0][1] == args.workers, workers, 180)
            first_q = "SELECT min(started) FROM {runs}.runs"
            wait_until("a first start", lambda: f.sql(first_q)[0][0] is not None, workers, 120)
            window_from = max(_epoch(f.sql(ready_q)[0][0]), _epoch(f.sql(first_q)[0][0]))
            end = window_from + seconds + 1.0
            now_q = "SELECT extract(epoch FROM clock_timestamp())::float8"
            wait_until("the window", lambda: f.sql(now_q)[0][0] >= end, workers, seconds * 3 + 120)
        finally:
            trouble = stop_workers(workers)
        rows = f.sql("SELECT started, worker, tid FROM {runs}.runs WHERE task = %s", [task])
        claims = [_epoch(r[0]) for r in f.sql("SELECT at FROM {runs}.claims")]
    found = analyse_rate([_epoch(r[0]) for r in rows], [r[1] for r in rows],
                         window_from, seconds, args.rate)  # fmt: skip
    # A task run twice (its lease lapsed before its ack: delivered again).
    found["ran_twice"] = len(rows) - len({r[2] for r in rows})
    # The grants themselves, as the claim made them (the bound GCRA gives is on these).
    granted = analyse_rate(claims, ["-"] * len(claims), window_from, seconds, args.rate)
    found["claims_max_in_any_1s"] = granted["max_in_any_1s"]
    found["claims_in_window"] = granted["window_starts"]
    found.update(
        task=task,
        rate=args.rate,
        burst=args.burst if not celery else None,
        backlog=backlog,
        publish_seconds=round(publish_s, 2),
        load_before=before,
        load_after=load(),
        worker_trouble=trouble,
    )
    if not celery:
        found["rate_ok"] = abs(found["achieved_vs_rate"] - 1) <= RATE_TOLERANCE
        found["second_ok"] = found["max_in_any_1s"] <= args.rate * RATE_SLACK
        found["once_ok"] = found["ran_twice"] == 0
        # The gate's guarantee (GCRA): at most burst + rate grants in any 1 s.
        found["claims_ok"] = found["claims_max_in_any_1s"] <= args.rate + args.burst
    return found


# -- (b) concurrency per key ---------------------------------------------------------------


def analyse_keys(runs: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Runs (key, start, end): the most of one key at once, and parallelism overall.
    A run holds its place on ``[start, end)``: at one instant an end goes before a start."""
    events = sorted([(s, 1, k) for k, s, _ in runs] + [(e, -1, k) for k, _, e in runs],
                    key=lambda ev: (ev[0], ev[1]))  # fmt: skip
    per_key: Counter[str] = Counter()
    most_of_key: dict[str, int] = {}
    running = keys_running = most_running = most_keys = 0
    tasks_area = keys_area = 0.0
    last = events[0][0] if events else 0.0
    for t, step, key in events:
        tasks_area += running * (t - last)
        keys_area += keys_running * (t - last)
        last = t
        before = per_key[key]
        per_key[key] += step
        running += step
        keys_running += (per_key[key] > 0) - (before > 0)
        most_of_key[key] = max(most_of_key.get(key, 0), per_key[key])
        most_running = max(most_running, running)
        most_keys = max(most_keys, keys_running)
    span = (events[-1][0] - events[0][0]) if events else 0.0
    return {
        "runs": len(runs),
        "keys": len(most_of_key),
        "max_in_flight_of_a_key": max(most_of_key.values(), default=0),
        "keys_at_that_max": sum(1 for v in most_of_key.values() if v == max(most_of_key.values())),
        "max_running": most_running,
        "mean_running": round(tasks_area / span, 2) if span else 0.0,
        "max_keys_running": most_keys,
        "mean_keys_running": round(keys_area / span, 2) if span else 0.0,
        "span_seconds": round(span, 2),
    }


def part_b(args: argparse.Namespace) -> dict[str, Any]:
    tasks = args.keys * args.per_key
    seconds = args.task_ms / 1000.0
    calls = ((f"k{k}", seconds) for k in range(args.keys) for _ in range(args.per_key))
    before = load()
    with fleet(args.pg_url, "b", args.rate, args.limit) as f:
        publish_s = publish(f, fapp.PER_KEY, calls)
        workers = start_workers(f, args.workers, args.b_pool, args.b_concurrency)
        try:
            ended_q = "SELECT count(ended) FROM {runs}.runs"
            slots = args.workers * args.b_concurrency
            bound = tasks * seconds / min(slots, args.keys * args.limit)
            wait_until("every task's end", lambda: f.sql(ended_q)[0][0] >= tasks, workers,
                       240 + bound * 20)  # fmt: skip
        finally:
            trouble = stop_workers(workers)
        rows = f.sql("SELECT key, started, ended, tid FROM {runs}.runs WHERE task = %s",
                     [fapp.PER_KEY])  # fmt: skip
    found = analyse_keys([(k, _epoch(s), _epoch(e)) for k, s, e, _ in rows if e is not None])
    found["ran_twice"] = len(rows) - len({r[3] for r in rows})
    found.update(
        tasks=tasks,
        limit=args.limit,
        task_ms=args.task_ms,
        fleet_slots=slots,
        parallel_bound=min(slots, args.keys * args.limit),
        tasks_per_second=round(found["runs"] / found["span_seconds"], 1)
        if found["span_seconds"]
        else 0.0,
        publish_seconds=round(publish_s, 2),
        load_before=before,
        load_after=load(),
        worker_trouble=trouble,
    )
    found["limit_ok"] = found["max_in_flight_of_a_key"] <= args.limit
    found["all_ran_once"] = len(rows) == tasks and found["ran_twice"] == 0
    return found


# -- the report ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("pg_url", "parts")},
        "load_start": load(),
    }
    if "a" in args.parts:
        report["a_pgq"] = part_a(args, fapp.PACED, args.seconds, "a")
        if args.celery_seconds > 0:
            report["a_celery"] = part_a(args, fapp.CELERY_PACED, args.celery_seconds, "c")
    if "b" in args.parts:
        report["b"] = part_b(args)
    report["load_end"] = load()
    a_checks = ("claims_ok", "once_ok")
    checks = [report["a_pgq"][k] for k in a_checks] if "a_pgq" in report else []
    if "b" in report:
        checks += [report["b"]["limit_ok"], report["b"]["all_ran_once"]]
    report["guarantees_hold"] = all(checks)
    a = report.get("a_pgq", {})
    report["targets_met"] = bool(a.get("rate_ok", True) and a.get("second_ok", True))
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"load average at start {report['load_start']}, at end {report['load_end']}"]
    for name in ("a_pgq", "a_celery"):
        m = report.get(name)
        if m:
            lines.append(
                f"({name}) {m['task']} at {m['rate']}/s (burst {m['burst']}): "
                f"{m['window_starts']} starts in "
                f"{m['window_seconds']:g} s = {m['achieved_rate']}/s "
                f"(x{m['achieved_vs_rate']}); most in any 1 s {m['max_in_any_1s']}, "
                f"in a calendar second {m['max_in_a_calendar_second']}; "
                f"per worker {m['per_worker']}; window seconds min/median/max "
                f"{m['window_second_min_median_max']}, longest gap {m['longest_gap_ms']} ms; "
                f"claims: most in any 1 s {m['claims_max_in_any_1s']}, "
                f"{m['claims_in_window']} in the window; "
                f"ran twice {m['ran_twice']}; load {m['load_before']} -> {m['load_after']}"
            )
    b = report.get("b")
    if b:
        lines.append(
            f"(b) {b['tasks']} tasks over {b['keys']} keys, limit {b['limit']}, "
            f"{b['task_ms']:g} ms each: most of a key at once {b['max_in_flight_of_a_key']} "
            f"({b['keys_at_that_max']} keys reached it); running at once max "
            f"{b['max_running']} mean {b['mean_running']} (bound {b['parallel_bound']}); "
            f"keys at once max {b['max_keys_running']} mean {b['mean_keys_running']}; "
            f"{b['tasks_per_second']} tasks/s over {b['span_seconds']} s; "
            f"ran twice {b['ran_twice']}; "
            f"load {b['load_before']} -> {b['load_after']}"
        )
    for name in ("a_pgq", "a_celery", "b"):
        for line in (report.get(name) or {}).get("worker_trouble", []):
            lines.append(f"  worker log ({name}): {line}")
    lines.append("guarantees hold" if report["guarantees_hold"] else "GUARANTEE BROKEN")
    lines.append("targets met" if report["targets_met"] else "target missed (rate or 1-s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(table(report), file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["guarantees_hold"] else 1


if __name__ == "__main__":
    sys.exit(main())
