"""A Celery app whose only change is its broker URL runs its tasks on pgq."""

from __future__ import annotations

import pytest

from tests.acceptance.harness import QUICK_STOP, Env, wait_for, workers

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


MARK = "tests.acceptance.app.mark"


def test_round_trip(env: Env) -> None:
    with workers(env, "w1"):
        client = env.client()
        result = client.send_task(MARK, args=["hello"])
        wait_for(lambda: env.runs(), 30, "the task to run")
    runs = env.runs()
    assert [(r[0], r[1]) for r in runs] == [(result.id, "hello")]
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0
