"""Faults under real workers: terminated backends mid-flight."""

from __future__ import annotations

from collections import Counter

import psycopg
import pytest

from tests.acceptance.harness import Env, Worker, wait_for, workers

pytestmark = pytest.mark.acceptance

SLOW = "tests.acceptance.app.slow_mark"


def terminate_backends_of(env: Env, worker: Worker) -> int:
    """pg_terminate_backend on every session of the worker process; how many."""
    with psycopg.connect(env.pg_url, autocommit=True) as admin:
        row = admin.execute(
            # Filter first (AND does not fix evaluation order), then terminate.
            "WITH victims AS MATERIALIZED (SELECT pid FROM pg_stat_activity"
            " WHERE application_name = %s)"
            " SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM victims",
            [f"pgq:{worker.proc.pid}"],
        ).fetchone()
    return int(row[0]) if row else 0


def test_acks_after_terminated_backends_land_and_nothing_runs_twice(env: Env) -> None:
    client = env.client()
    ids = [client.send_task(SLOW, args=[f"f{n}", 1.5]).id for n in range(8)]
    environ = {"PGQ_VISIBILITY_TIMEOUT": "20"}
    with workers(env, "victim", concurrency=4, environ=environ) as (worker,):
        wait_for(lambda: len(env.runs()) >= 4, 30, "four tasks in flight")
        assert terminate_backends_of(env, worker) >= 1
        wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 60,
                 "every message acked")
        assert worker.proc.poll() is None
    per_id = Counter(r[0] for r in env.runs())
    assert set(per_id) == set(ids)
    assert max(per_id.values()) == 1, per_id
