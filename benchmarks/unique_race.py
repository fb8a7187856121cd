"""Unique tasks under a publishers' race, on a fleet of real Celery workers.

    python -m benchmarks.unique_race [--publishers 10] [--publishes 1000] [--keys 50]
        [--workers 4] [--concurrency 16] [--json]

Issue 47's benchmark, part (c) (docs/design/flow-control.md, "The benchmark"): the workers
(``benchmarks.flow_limits_app``, threads pool) are up and claiming before the race starts;
``--publishers`` threads, each with its own Celery app and connections, start together
(a ``threading.Barrier``) and publish ``--publishes`` calls of ``flow.unique`` between
them, every key ``--publishes / --keys`` times, each thread going through the keys from
its own offset so that every key is raced from several threads at once. The task is a
``pg_transport.UniqueTask`` held while queued or running: a duplicate's ``delay()``
returns the holder's id.

Each task records its start (a row, with its task id and key), then waits for the
harness's gate, an advisory lock held through the whole race: so every key is held by a
message queued or running until every publish is answered, and a key freed early cannot
let a late duplicate in. Then the gate opens, the tasks end and are acked.

The guarantee (exit status 1 when broken): exactly ``--keys`` tasks run, one per key,
none twice; the distinct ids the ``--publishes`` calls returned are exactly the tasks
that ran; the queue is empty at the end. Reported: the race's time and publishes per
second, how many publishes were new (must be ``--keys``) and duplicates, and how many
messages were already claimed by the workers when the race ended (duplicates of a key
held by a running task, not only a queued one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from typing import Any

import psycopg

from benchmarks import flow_limits_app as fapp
from benchmarks.brokers import default_pg_url, patched_environ
from benchmarks.flow_limits import fleet, load, start_workers, stop_workers, wait_until

__all__ = ["main", "parse_args", "race"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.unique_race", description=(__doc__ or "").split("\n\n")[0]
    )
    add = parser.add_argument
    add("--publishers", type=int, default=10, help="publisher threads racing (10)")
    add("--publishes", type=int, default=1000, help="publishes between them (1000)")
    add("--keys", type=int, default=50, help="unique keys (50)")
    add("--workers", type=int, default=4, help="worker processes (4)")
    add("--concurrency", type=int, default=16, help="each worker's threads pool size (16)")
    add("--pg-url", default=default_pg_url(), help="Postgres for pgq (libpq URL)")
    add("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if min(args.publishers, args.publishes, args.keys, args.workers, args.concurrency) < 1:
        parser.error("every count must be >= 1")
    if args.publishes < args.keys:
        parser.error("--publishes must be at least --keys (every key is published)")
    return args


def _calls(n: int, publishers: int, publishes: int, keys: int) -> list[str]:
    """Publisher ``n``'s keys: its share of the publishes, going round the keys from its
    own offset."""
    share = publishes // publishers + (1 if n < publishes % publishers else 0)
    offset = n * keys // publishers
    return [f"k{(offset + i) % keys}" for i in range(share)]


def race(args: argparse.Namespace) -> dict[str, Any]:
    gate = random.randrange(1, 2**31)
    with fleet(args.pg_url, "unique", 1, 1) as f:
        env = {**f.env(), fapp.ENV_GATE: str(gate)}
        load_before = load()
        with psycopg.connect(f.pg_url, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", [fapp.GATE, gate])
            with patched_environ(env):
                workers = start_workers(f, args.workers, "threads", args.concurrency)
            try:
                ready_q = "SELECT count(*) FROM {runs}.ready"
                wait_until("workers ready", lambda: f.sql(ready_q)[0][0] == args.workers,
                           workers, 180)  # fmt: skip
                returned, elapsed = _publish(f, env, args)
                claimed_q = (
                    "SELECT count(*) FILTER (WHERE read_ct > 0), count(*) FROM {schema}.message"
                )
                [(claimed, queued)] = f.sql(claimed_q)
            finally:
                holder.execute("SELECT pg_advisory_unlock(%s::int4, %s::int4)", [fapp.GATE, gate])
            try:
                left_q = "SELECT count(*) FROM {schema}.message"
                wait_until("the queue drained", lambda: f.sql(left_q)[0][0] == 0, workers, 180)
            finally:
                trouble = stop_workers(workers)
        runs = f.sql("SELECT tid, key FROM {runs}.runs WHERE task = %s", [fapp.UNIQUE])
        left = f.sql("SELECT count(*) FROM {schema}.message")[0][0]
    tids = [str(t) for t, _ in runs]
    ids = {i for got in returned for i in got}
    calls = sum(len(got) for got in returned)
    per_key = sorted({k for _, k in runs})
    report = {
        "publishers": args.publishers,
        "publishes": args.publishes,
        "keys": args.keys,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "race_seconds": round(elapsed, 3),
        "publishes_per_second": round(args.publishes / elapsed, 1),
        "calls_answered": calls,
        "distinct_ids_returned": len(ids),
        "duplicates": calls - len(ids),
        "tasks_run": len(tids),
        "distinct_tasks_run": len(set(tids)),
        "keys_run": len(per_key),
        "messages_at_race_end": queued,
        "claimed_at_race_end": claimed,
        "left_in_queue": left,
        "load_before": load_before,
        "load_after": load(),
        "worker_trouble": trouble,
    }
    report["ok"] = (
        len(tids) == args.keys
        and len(set(tids)) == args.keys
        and len(per_key) == args.keys
        and ids == set(tids)
        and calls == args.publishes
        and left == 0
    )
    return report


def _publish(
    f: Any, env: dict[str, str], args: argparse.Namespace
) -> tuple[list[list[str]], float]:
    """Every publisher's returned ids (one per call), and the race's seconds (from the
    barrier to the last answer)."""
    start = threading.Barrier(args.publishers + 1)
    returned: list[list[str]] = [[] for _ in range(args.publishers)]
    errors: list[BaseException] = []
    with patched_environ(env):
        apps = [
            fapp.make_app(f.broker_url, f.queue, {"schema": f.schema}, "1/s", 1)
            for _ in range(args.publishers)
        ]
    try:
        for a in apps:  # each publisher's connection made before the race
            a.connection_for_write().ensure_connection()

        def publisher(n: int) -> None:
            task = apps[n].tasks[fapp.UNIQUE]
            keys = _calls(n, args.publishers, args.publishes, args.keys)
            try:
                start.wait()
                for key in keys:
                    returned[n].append(str(task.delay(key).id))
            except BaseException as exc:  # reported after the join
                errors.append(exc)

        threads = [threading.Thread(target=publisher, args=(n,)) for n in range(args.publishers)]
        for t in threads:
            t.start()
        start.wait()
        began = time.monotonic()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - began
    finally:
        for a in apps:
            a.close()
    if errors:
        raise RuntimeError(f"a publisher failed: {errors[0]!r}") from errors[0]
    return returned, elapsed


def table(r: dict[str, Any]) -> str:
    lines = [
        f"(c) unique tasks: {r['publishers']} publishers racing {r['publishes']} publishes of "
        f"{r['keys']} keys; {r['workers']} workers x {r['concurrency']} threads",
        f"  race {r['race_seconds']} s ({r['publishes_per_second']} publishes/s); "
        f"{r['calls_answered']} calls answered, {r['distinct_ids_returned']} distinct ids, "
        f"{r['duplicates']} duplicates",
        f"  tasks run {r['tasks_run']} (distinct {r['distinct_tasks_run']}, keys "
        f"{r['keys_run']}); at the race's end {r['messages_at_race_end']} messages, "
        f"{r['claimed_at_race_end']} of them claimed; left in queue {r['left_in_queue']}",
        f"  load {r['load_before']} -> {r['load_after']}; guarantee "
        f"{'held' if r['ok'] else 'BROKEN'}",
    ]
    lines += [f"  worker log: {line}" for line in r["worker_trouble"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = race(args)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
