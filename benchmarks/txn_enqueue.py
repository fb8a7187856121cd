"""A web request's unit of work (insert a row, enqueue one task about it) with the task
written in the request's transaction on pgq, against ``delay_on_commit`` on Redis.

``python -m benchmarks.txn_enqueue`` runs, for each way, in the same run:

1. **requests**: ``--requests`` requests in a loop from this process, each a Django
   ``transaction.atomic()`` inserting an order row and enqueueing a task about it; per
   request latency (p50, p99) and requests a second. No worker runs: only the producer's
   side is measured. The ways take turns, ``--chunk`` requests at a time (in reverse order
   every other turn), so that a drift of the shared machine weighs on every way alike.
2. **kills**: ``--kills`` times a producer subprocess runs requests in a loop and is
   SIGKILLed at a random moment (``--kill-after`` seconds at most after it is ready). At
   the end every committed order row is matched with the tasks in the broker: a row with
   no task is a **lost** task, a task with no row a **phantom**.

Ways: ``pgq-txn`` (pgq, ``join_atomic()``: ``task.delay()`` inside ``atomic()`` writes the
message in the request's transaction), ``redis-on-commit`` (Redis, Celery's
``delay_on_commit``: the task is sent by Django's ``on_commit`` after the commit), and
``pgq-on-commit`` (pgq with ``delay_on_commit``, publishing apart after the commit: the
same window as Redis's, on the same broker as pgq-txn). Reported: each way's numbers and
its requests per second ÷ redis-on-commit's. ``--json`` prints the same as JSON.

Django is configured in code (the psycopg 3 backend on ``--pg-url``); Redis is
``--redis-url`` (its database flushed before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from base64 import b64decode
from collections.abc import Callable
from statistics import median
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["WAYS", "main", "parse_args"]

#: way -> (broker, enqueue in the transaction?)
WAYS: dict[str, tuple[str, bool]] = {
    "pgq-txn": ("pgq", True),
    "redis-on-commit": ("redis", False),
    "pgq-on-commit": ("pgq", False),
}
TASK = "bench.txn.handle"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.txn_enqueue", description=__doc__)
    p.add_argument(
        "--pg-url",
        default=os.environ.get("PGQ_TEST_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=250)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--kill-after", type=float, default=0.3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--schema", default="")
    # The producer subprocess of the kills (internal).
    p.add_argument("--producer", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for way in args.ways.split(","):
        if way not in WAYS:
            p.error(f"unknown way {way!r} (known: {', '.join(WAYS)})")
    return args


# --- one process's Django, Celery app and request ------------------------------------


def setup_django(pg_url: str) -> None:
    import django
    from django.conf import settings

    if settings.configured:
        return
    parts = psycopg.conninfo.conninfo_to_dict(pg_url)
    settings.configure(
        USE_TZ=True,
        INSTALLED_APPS=[],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": parts.get("dbname", ""),
                "USER": parts.get("user", ""),
                "PASSWORD": parts.get("password", ""),
                "HOST": parts.get("host", ""),
                "PORT": parts.get("port", ""),
            }
        },
    )
    django.setup()


def celery_app(way: str, args: argparse.Namespace) -> Any:
    from celery import Celery

    broker = WAYS[way][0]
    url = args.redis_url if broker == "redis" else "pgq://" + args.pg_url.split("://", 1)[1]
    app = Celery(f"bench-{way}", broker=url, task_cls="celery.contrib.django.task:DjangoTask")
    app.conf.broker_transport_options = {"schema": args.schema} if broker == "pgq" else {}

    @app.task(name=TASK)
    def handle(order_id: int) -> None: ...

    return app, handle


def request_of(way: str, args: argparse.Namespace) -> Callable[[str], None]:
    """One request of ``way``: insert an order labelled ``label``, enqueue its task."""
    from django.db import connection, transaction

    _app, handle = celery_app(way, args)
    insert = (
        sql.SQL("INSERT INTO {}.bench_orders (label) VALUES (%s)")
        .format(sql.Identifier(args.schema))
        .as_string(None)
    )
    in_txn = WAYS[way][1]

    def request(label: str) -> None:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute(insert, [label])
            if in_txn:
                handle.delay(label)
            else:
                handle.delay_on_commit(label)

    return request


def producer(args: argparse.Namespace) -> None:
    """The killed subprocess: requests in a loop, labels ``<run>-<n>``."""
    way, run = args.producer.split(":")
    setup_django(args.pg_url)
    if WAYS[way][1]:
        from pg_transport.integrations.django import join_atomic

        join_atomic()
    request = request_of(way, args)
    request(f"{run}-warm")
    print("READY", flush=True)
    n = 0
    while True:
        request(f"{run}-{n}")
        n += 1


# --- measuring ----------------------------------------------------------------------


def measure_requests(ways: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    from pg_transport.integrations.django import join_atomic, leave_atomic

    requests = {way: request_of(way, args) for way in ways}
    latencies: dict[str, list[float]] = {way: [] for way in ways}
    for way in ways:  # connect, declare, migrate: not measured
        with_join(way, join_atomic, leave_atomic, lambda w=way: requests[w](f"{w}-warm"))
    for turn in range((args.requests + args.chunk - 1) // args.chunk):
        order = ways if turn % 2 == 0 else ways[::-1]
        for way in order:

            def chunk(way: str = way, turn: int = turn) -> None:
                for n in range(args.chunk):
                    began = time.perf_counter()
                    requests[way](f"{way}-{turn}-{n}")
                    latencies[way].append(time.perf_counter() - began)

            with_join(way, join_atomic, leave_atomic, chunk)
    return latencies


def with_join(
    way: str, join: Callable[[], None], leave: Callable[[], None], run: Callable[[], None]
) -> None:
    if WAYS[way][1]:
        join()
    try:
        run()
    finally:
        if WAYS[way][1]:
            leave()


def kill_runs(way: str, args: argparse.Namespace) -> dict[str, int]:
    """``--kills`` producers of ``way`` killed at random moments; rows and tasks."""
    rng = random.Random(f"{way}-kills")
    run_prefix = f"k{uuid.uuid4().hex[:6]}"
    for k in range(args.kills):
        run = f"{run_prefix}_{k}"
        env = dict(os.environ, PGAPPNAME=f"bench-txn-{run}")
        cmd = [sys.executable, "-m", "benchmarks.txn_enqueue", "--producer", f"{way}:{run}"]
        cmd += ["--pg-url", args.pg_url, "--redis-url", args.redis_url, "--schema", args.schema]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            proc.kill()
            raise RuntimeError(f"the {way} producer did not start")
        time.sleep(rng.uniform(0.0, args.kill_after))  # a random moment of its loop
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_sessions_gone(args.pg_url, f"bench-txn-{run}")
    rows = committed_rows(args, run_prefix)
    tasks = tasks_of(way, args, run_prefix)
    return {
        "kills": args.kills,
        "rows_committed": len(rows),
        "tasks": len(tasks),
        "lost": len(rows - tasks),
        "phantom": len(tasks - rows),
    }


def wait_sessions_gone(pg_url: str, app_name: str) -> None:
    """Until the server has ended a killed producer's sessions (rolling back what was
    open), 30 s at most: an outcome waited for, not an ordering."""
    deadline = time.monotonic() + 30
    with psycopg.connect(pg_url, autocommit=True) as conn:
        while conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [app_name]
        ).fetchone() != (0,):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sessions of {app_name} did not end")
            time.sleep(0.01)


def committed_rows(args: argparse.Namespace, prefix: str) -> set[str]:
    with psycopg.connect(args.pg_url) as conn:
        query = sql.SQL("SELECT label FROM {}.bench_orders WHERE label LIKE %s").format(
            sql.Identifier(args.schema)
        )
        found = {row[0] for row in conn.execute(query, [f"{prefix}\\_%"])}
    return {label for label in found if not label.endswith("-warm")}


def tasks_of(way: str, args: argparse.Namespace, prefix: str) -> set[str]:
    """The labels of the tasks the broker holds for ``prefix``'s runs."""
    bodies: list[str] = []
    if WAYS[way][0] == "pgq":
        with psycopg.connect(args.pg_url) as conn:
            query = sql.SQL("SELECT payload->>'body' FROM {}.message").format(
                sql.Identifier(args.schema)
            )
            bodies = [row[0] for row in conn.execute(query)]
    else:
        import redis

        client = redis.Redis.from_url(args.redis_url)
        for raw in client.lrange("celery", 0, -1):
            message = json.loads(raw)
            body = message["body"]
            if message.get("properties", {}).get("body_encoding") == "base64":
                body = b64decode(body).decode()
            bodies.append(body)
    labels = {str(json.loads(body)[0][0]) for body in bodies}
    return {label for label in labels if label.startswith(prefix) and not label.endswith("-warm")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prepare(args: argparse.Namespace) -> None:
    from pg_transport.db.migrate import ensure_schema
    from pg_transport.db.pool import Connector

    connector = Connector(args.pg_url)
    ensure_schema(connector, args.schema, auto_migrate=True)
    connector.close()
    with psycopg.connect(args.pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {}.bench_orders (id bigserial PRIMARY KEY, label text)").format(
                sql.Identifier(args.schema)
            )
        )


def flush_redis(args: argparse.Namespace) -> None:
    import redis

    redis.Redis.from_url(args.redis_url).flushdb()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.producer:
        producer(args)
        return {}
    own_schema = not args.schema
    if own_schema:
        args.schema = f"pgq_bench_txn_{uuid.uuid4().hex[:8]}"
    ways = args.ways.split(",")
    prepare(args)
    if any(WAYS[w][0] == "redis" for w in ways):
        flush_redis(args)
    setup_django(args.pg_url)
    try:
        latencies = measure_requests(ways, args)
        kills = {way: kill_runs(way, args) for way in ways} if args.kills else {}
    finally:
        from django.db import connections

        connections.close_all()
        if own_schema:
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(args.schema)))
        if any(WAYS[w][0] == "redis" for w in ways):
            flush_redis(args)
    base = "redis-on-commit" if "redis-on-commit" in ways else ways[0]
    rate = {way: len(v) / sum(v) for way, v in latencies.items()}
    result: dict[str, Any] = {
        "requests": args.requests,
        "kills": args.kills,
        "baseline": base,
        "ways": {
            way: {
                "requests_per_s": rate[way],
                "ratio_to_baseline": rate[way] / rate[base],
                "p50_ms": percentile(latencies[way], 0.50) * 1000,
                "p99_ms": percentile(latencies[way], 0.99) * 1000,
                "median_ms": median(latencies[way]) * 1000,
                **kills.get(way, {}),
            }
            for way in ways
        },
    }
    report(result, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=2))
    return result


def report(result: dict[str, Any], out: Any) -> None:
    print(
        f"{'way':<16} {'req/s':>8} {'x ' + result['baseline']:>20} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'kills':>6} {'rows':>6} {'lost':>5} {'phantom':>8}",
        file=out,
    )
    for way, r in result["ways"].items():
        print(
            f"{way:<16} {r['requests_per_s']:>8.0f} {r['ratio_to_baseline']:>20.2f}"
            f" {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r.get('kills', '-'):>6}"
            f" {r.get('rows_committed', '-'):>6} {r.get('lost', '-'):>5}"
            f" {r.get('phantom', '-'):>8}",
            file=out,
        )


if __name__ == "__main__":
    main()
