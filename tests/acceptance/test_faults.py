"""Faults under real workers: terminated backends mid-flight."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.acceptance.harness import QUICK_STOP, Env, terminate_backends_of, wait_for, workers

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


SLOW = "tests.acceptance.app.slow_mark"


def test_acks_after_terminated_backends_land_and_nothing_runs_twice(env: Env) -> None:
    client = env.client()
    ids = [client.send_task(SLOW, args=[f"f{n}", 1.5]).id for n in range(8)]
    environ = {"PGQ_VISIBILITY_TIMEOUT": "20"}
    with workers(env, "victim", concurrency=4, environ=environ) as (worker,):
        wait_for(lambda: len(env.runs()) >= 4, 30, "four tasks in flight")
        assert terminate_backends_of(env, worker) >= 1
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "every message acked",
        )
        assert worker.proc.poll() is None
    per_id = Counter(r[0] for r in env.runs())
    assert set(per_id) == set(ids)
    assert max(per_id.values()) == 1, per_id
