"""Exactly-once effects under crashes: atomic tasks against plain ``acks_late`` tasks.

``python -m benchmarks.exactly_once --tasks 10000 --pool prefork --concurrency 2
--kill-every 3 --terminate-rate 0.02 --ways pgq-atomic,pgq,redis``: each task increments
one counter row and inserts one audit row. For each way, in one run: the tasks are
published, then a worker drains them while a killer SIGKILLs the worker (its whole
process group) every ``--kill-every`` seconds and starts a new one, and terminates a
task session (``pg_terminate_backend``) with probability ``--terminate-rate`` every
0.1 s. The way is done when every task's effect is there and its queue is empty.

Ways: ``pgq-atomic`` (``pg_transport.AtomicTask``: the writes and the end of the delivery
in one commit), ``pgq`` and ``redis`` (the writes committed by the task, then Celery's
late ack). Reported per way: the counter and audit rows against the tasks (atomic must
be exact; the others over-count by the runs whose ack was lost), the kills and
terminations, the drain's tasks a second, and pgq-atomic's tasks a second ÷ pgq's.

``--cpu`` (Linux, Postgres on this host) adds what a task costs in CPU, the measure that
holds on a loaded machine where rates do not: ``/proc`` utime+stime of the worker (its
main process and pool children) and of the backends serving it (the sessions its
processes name by pid: two ways run at the same time on one database each count their
own), from the tenth of the tasks done to the last, divided by the tasks done in
between; and plain's total ÷ the atomic way's when both ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks import procstat

__all__ = ["WAYS", "main", "parse_args"]

ROOT = Path(__file__).resolve().parents[1]
APP = "benchmarks.exactly_once_app"
#: way -> (broker, task)
WAYS: dict[str, tuple[str, str]] = {
    "pgq-atomic": ("pgq", f"{APP}.atomic_bump"),
    "pgq": ("pgq", f"{APP}.plain_bump"),
    "redis": ("redis", f"{APP}.plain_bump"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.exactly_once", description=__doc__)
    p.add_argument(
        "--pg-url",
        default=os.environ.get("PGQ_BENCH_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    p.add_argument("--tasks", type=int, default=10000)
    p.add_argument("--pool", default="prefork")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--kill-every", type=float, default=3.0)
    p.add_argument("--terminate-rate", type=float, default=0.02)
    p.add_argument("--vt", type=float, default=5.0, help="visibility timeout, both brokers")
    p.add_argument("--ways", default="pgq-atomic,pgq,redis")
    p.add_argument("--seed", type=int, default=46)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per way at most")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cpu", action="store_true", help="report CPU ms a task (/proc)")
    args = p.parse_args(argv)
    args.ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in args.ways if w not in WAYS]
    if unknown:
        p.error(f"unknown ways {unknown}; known: {sorted(WAYS)}")
    return args


def _broker_url(pg_url: str) -> str:
    return "pgq://" + pg_url.split("://", 1)[1]


def _prepare(args: argparse.Namespace, way: str) -> dict[str, str]:
    tables = f"bench_eo_{way.replace('-', '_')}"
    pgq_schema = f"pgq_eo_{way.replace('-', '_')}"
    with psycopg.connect(args.pg_url, autocommit=True) as conn:
        for name in (tables, pgq_schema):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        t = sql.Identifier(tables)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(t))
        conn.execute(sql.SQL("CREATE TABLE {}.counter (id int PRIMARY KEY, n int)").format(t))
        conn.execute(sql.SQL("INSERT INTO {}.counter VALUES (1, 0)").format(t))
        conn.execute(sql.SQL("CREATE TABLE {}.audit (i int NOT NULL)").format(t))
    broker = _broker_url(args.pg_url) if WAYS[way][0] == "pgq" else args.redis_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(
        BENCH_BROKER=broker,
        BENCH_PG_URL=args.pg_url,
        BENCH_TABLES=tables,
        BENCH_VT=str(args.vt),
        PGQ_SCHEMA=pgq_schema,
        PYTHONPATH=str(ROOT),
    )
    return env


def _publish(args: argparse.Namespace, way: str, env: dict[str, str]) -> None:
    from celery import Celery

    app = Celery(f"publisher-{way}", broker=env["BENCH_BROKER"])
    options: dict[str, Any] = {"visibility_timeout": args.vt}
    if WAYS[way][0] == "pgq":
        options["schema"] = env["PGQ_SCHEMA"]  # (each way's queue in a schema of its own)
    app.conf.broker_transport_options = options
    if WAYS[way][0] == "redis":
        import redis

        redis.Redis.from_url(args.redis_url).flushdb()
        for i in range(args.tasks):
            app.send_task(WAYS[way][1], args=[i])
    else:
        import pg_transport

        for start in range(0, args.tasks, 500):
            with pg_transport.batch():
                for i in range(start, min(start + 500, args.tasks)):
                    app.send_task(WAYS[way][1], args=[i])
    app.close()


def _start(args: argparse.Namespace, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", args.pool, "-c",
           str(args.concurrency), "-l", "warning", "--without-gossip", "--without-mingle",
           "--without-heartbeat"]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _counts(args: argparse.Namespace, env: dict[str, str]) -> tuple[int, int, int]:
    t = sql.Identifier(env["BENCH_TABLES"])
    with psycopg.connect(args.pg_url) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT (SELECT n FROM {t}.counter), (SELECT count(*) FROM {t}.audit),"
                " (SELECT count(DISTINCT i) FROM {t}.audit)"
            ).format(t=t)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _queue_empty(args: argparse.Namespace, way: str, env: dict[str, str]) -> bool:
    if WAYS[way][0] == "redis":
        import redis

        r = redis.Redis.from_url(args.redis_url)
        return int(r.llen("celery")) == 0 and int(r.hlen("unacked")) == 0
    with psycopg.connect(args.pg_url) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.message WHERE queue = 'celery'").format(
                sql.Identifier(env["PGQ_SCHEMA"])
            )
        ).fetchone()
    return row is not None and int(row[0]) == 0


def _terminate_one(args: argparse.Namespace, rng: random.Random) -> int:
    with psycopg.connect(args.pg_url, autocommit=True) as conn:
        pids = [
            int(r[0])
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND (application_name LIKE 'pgq-atomic:%%'"
                " OR application_name LIKE 'bench-plain:%%')"
            ).fetchall()
        ]
        if not pids:
            return 0
        row = conn.execute("SELECT pg_terminate_backend(%s)", [rng.choice(pids)]).fetchone()
    return 1 if row and row[0] else 0


def _backends(args: argparse.Namespace, worker: int) -> dict[int, float]:
    """CPU seconds of the backends serving the worker now: the sessions whose
    application_name names its main process or one of its children (``pgq:<pid>...``,
    ``pgq-atomic:<pid>...``, ``bench-plain:<pid>``), so that two ways measured at the
    same time on one database each count their own."""
    ours = {worker, *procstat.children_of(worker)}
    with psycopg.connect(args.pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND backend_type = 'client backend'"
            " AND pid <> pg_backend_pid()"
        ).fetchall()
    pids = []
    for pid, name in rows:
        owner = str(name or "").split(":")
        if len(owner) > 1 and owner[1].isdigit() and int(owner[1]) in ours:
            pids.append(int(pid))
    return procstat.cpu_of(pids)


def _cpu_sample(args: argparse.Namespace, worker: int, done: int) -> dict[str, Any] | None:
    """The worker's CPU seconds (main + children), its backends', and ``done``."""
    found = procstat.sample(worker)
    if found is None:
        return None
    return {
        "done": done,
        "worker_s": found["main"]["cpu_s"] + found["children"]["cpu_s"],
        "backends": _backends(args, worker),
    }


def _cpu_per_task(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    n = max(last["done"] - first["done"], 1)
    # Backends present at both samples (one that ended in between is not counted).
    both = first["backends"].keys() & last["backends"].keys()
    backend = sum(last["backends"][p] - first["backends"][p] for p in both)
    worker = last["worker_s"] - first["worker_s"]
    return {
        "tasks": n,
        "worker_ms": round(worker * 1e3 / n, 3),
        "backend_ms": round(backend * 1e3 / n, 3),
        "total_ms": round((worker + backend) * 1e3 / n, 3),
        "backends": len(both),
    }


def run_way(args: argparse.Namespace, way: str, rng: random.Random) -> dict[str, Any]:
    env = _prepare(args, way)
    if WAYS[way][0] == "pgq":
        from pg_transport.db.migrate import ensure_schema
        from pg_transport.db.pool import Connector

        connector = Connector(args.pg_url)
        ensure_schema(connector, env["PGQ_SCHEMA"], auto_migrate=True)
        connector.close()
    _publish(args, way, env)
    log = Path(tempfile.mkstemp(prefix=f"pgq-bench-eo-{way}-", suffix=".log")[1])
    kills = terminations = 0
    started = time.monotonic()
    worker = _start(args, env, log)
    next_kill = started + args.kill_every
    last_distinct, stalled_since, last_kill = -1, started, started
    cpu_first: dict[str, Any] | None = None
    cpu_last: dict[str, Any] | None = None
    try:
        while True:
            now = time.monotonic()
            if now - started > args.timeout:
                raise SystemExit(f"{way}: not done in {args.timeout}s (log {log})")
            counter, audit, distinct = _counts(args, env)
            empty = _queue_empty(args, way, env)
            if args.cpu and cpu_first is None and distinct >= max(args.tasks // 10, 1):
                cpu_first = _cpu_sample(args, worker.pid, distinct)
            if distinct == args.tasks and empty:
                if args.cpu and cpu_first is not None:
                    cpu_last = _cpu_sample(args, worker.pid, distinct)
                break
            # Nothing left to deliver and no progress for three visibility timeouts after
            # the last kill: the missing tasks are lost (a broker that lost a message).
            if distinct != last_distinct or not empty:
                last_distinct, stalled_since = distinct, now
            elif now - max(stalled_since, last_kill) > 3 * args.vt:
                break
            if args.kill_every > 0 and now >= next_kill:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
                kills += 1
                last_kill = now
                worker = _start(args, env, log)
                next_kill = now + args.kill_every
            if rng.random() < args.terminate_rate:
                terminations += _terminate_one(args, rng)
            time.sleep(0.1)
        elapsed = time.monotonic() - started
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    counter, audit, distinct = _counts(args, env)
    row: dict[str, Any] = {
        "way": way,
        "tasks": args.tasks,
        "counter": counter,
        "audit_rows": audit,
        "over_count": audit - distinct,
        "lost": args.tasks - distinct,
        "exact": counter == audit == distinct == args.tasks,
        "kills": kills,
        "terminations": terminations,
        "seconds": round(elapsed, 2),
        "tasks_per_s": round(args.tasks / elapsed, 1),
    }
    if cpu_first is not None and cpu_last is not None and not kills:
        row["cpu"] = _cpu_per_task(cpu_first, cpu_last)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    for way in args.ways:
        rows.append(run_way(args, way, rng))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each way as it ends
    by = {r["way"]: r for r in rows}
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "pg_url"},
        "ways": rows,
    }
    if "pgq-atomic" in by and "pgq" in by:
        report["atomic_over_plain_pgq"] = round(
            by["pgq-atomic"]["tasks_per_s"] / by["pgq"]["tasks_per_s"], 3
        )
        if "cpu" in by["pgq-atomic"] and "cpu" in by["pgq"]:
            # (plain's CPU a task ÷ atomic's: the throughput ratio where CPU is the limit)
            report["atomic_over_plain_pgq_cpu"] = round(
                by["pgq"]["cpu"]["total_ms"] / by["pgq-atomic"]["cpu"]["total_ms"], 3
            )
    if args.json:
        print(json.dumps(report))
    else:
        for r in rows:
            print(
                f"{r['way']:>11}: counter {r['counter']}, audit {r['audit_rows']} of "
                f"{r['tasks']} (over {r['over_count']}, lost {r['lost']}), {r['kills']} kills, "
                f"{r['terminations']} terminations, {r['tasks_per_s']} tasks/s"
            )
        if "atomic_over_plain_pgq" in report:
            print(f"pgq-atomic / pgq throughput: {report['atomic_over_plain_pgq']}")
        for r in rows:
            if "cpu" in r:
                c = r["cpu"]
                print(
                    f"{r['way']:>11}: CPU a task {c['total_ms']} ms (worker {c['worker_ms']},"
                    f" backends {c['backend_ms']}) over {c['tasks']} tasks"
                )
    return report


if __name__ == "__main__":
    main()
