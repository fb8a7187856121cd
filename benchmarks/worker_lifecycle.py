"""How long a worker takes to start and to stop, and how many sessions it holds.

``python -m benchmarks.worker_lifecycle [--pools prefork,threads,gevent] [--rounds 3]
[--app tests.acceptance.app] [--idle-timeout SECONDS]`` starts each pool's worker as the
acceptance tests do (tests/acceptance/harness.py, with its QUICK_STOP polling interval)
and prints one JSON line per round: ``start`` (process start to its `` ready.`` line),
``stop`` (SIGTERM and the harness's wake-up to the exit), the sessions its main process
held idle (sampled from pg_stat_activity ``--idle-wait`` seconds after a burst of tasks
ran) and the most while it ran.
Runs on the test server (``PGQ_TEST_URL`` or 127.0.0.1:5432) in a database of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import psycopg

from tests.acceptance.harness import QUICK_STOP, prepare, start_worker, wait_for, wake
from tests.acceptance.test_footprint import Sampler as FootprintSampler
from tests.pg import drop_session_database, session_database


class Sampler(FootprintSampler):
    """test_footprint's sampler (the most sessions each pid held, every 20 ms), which
    also says what each of a pid's sessions is now."""

    def sessions_now(self) -> dict[int, list[str]]:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT split_part(application_name, ':', 2)::int,"
                " coalesce(backend_type, '') || '/' || split_part(application_name, ':', 1)"
                " || '/' || left(regexp_replace(query, '\\s+', ' ', 'g'), 50)"
                " FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name ~ '^pgq[a-z-]*:[0-9]+(:|$)'"
            ).fetchall()
        found: dict[int, list[str]] = {}
        for pid, what in rows:
            found.setdefault(int(pid), []).append(str(what))
        return found


def one_round(
    env: Any, pool: str, app: str, burst: int, idle_wait: float, idle_timeout: str
) -> dict[str, Any]:
    environ = dict(QUICK_STOP)
    if idle_timeout:
        environ["PGQ_POOL_IDLE_TIMEOUT"] = idle_timeout
    concurrency = 4
    began = time.monotonic()
    worker = start_worker(
        env, f"lc-{pool}", pool=pool, concurrency=concurrency, app=app, environ=environ
    )
    started = time.monotonic() - began
    parent = worker.proc.pid
    try:
        with Sampler(env.pg_url) as sampler:
            client = env.client()
            for n in range(burst):
                client.send_task("tests.acceptance.app.mark", args=[f"b{n}"])
            wait_for(
                lambda: env.scalar("SELECT count(*) FROM {schema}.task_runs") >= burst,
                60,
                "the burst to run",
            )
            env.close()
            busy = sampler.most[parent]
        time.sleep(idle_wait)  # a measurement: what stays once pool_idle_timeout passed
        idle = sampler.sessions_now().get(parent, [])
        began = time.monotonic()
        os.killpg(parent, signal.SIGTERM)
        wake([worker])
        worker.proc.wait(60)
        stopped = time.monotonic() - began
    finally:
        worker.kill()
        env.scalar("DELETE FROM {schema}.task_runs RETURNING 1")
    return {
        "pool": pool,
        "start_s": round(started, 3),
        "stop_s": round(stopped, 3),
        "busy_sessions": busy,
        "idle_sessions": len(idle),
        "idle": sorted(idle),
        "rc": worker.proc.returncode,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pools", default="prefork,threads,gevent")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--app", default="tests.acceptance.app")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--idle-wait", type=float, default=5.0)
    parser.add_argument(
        "--idle-timeout", default="", help="PGQ_POOL_IDLE_TIMEOUT (default: pgq's own, 30 s)"
    )
    args = parser.parse_args()
    os.environ.setdefault("PGQ_TEST_DB_PREFIX", "pgq_t_lifecycle_")
    url = session_database()
    try:
        env = prepare(url, "lc")
        print(json.dumps({"load": os.getloadavg()}), flush=True)
        for _ in range(args.rounds):
            for pool in args.pools.split(","):
                result = one_round(
                    env, pool, args.app, args.burst, args.idle_wait, args.idle_timeout
                )
                print(json.dumps(result), flush=True)
    finally:
        drop_session_database()


if __name__ == "__main__":
    main()
