"""A Celery app whose only change is its broker URL runs its tasks on pgq."""

from __future__ import annotations

import pytest

from tests.acceptance.harness import Env, wait_for, workers

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"


def test_round_trip(env: Env) -> None:
    with workers(env, "w1"):
        client = env.client()
        result = client.send_task(MARK, args=["hello"])
        wait_for(lambda: env.runs(), 30, "the task to run")
    runs = env.runs()
    assert [(r[0], r[1]) for r in runs] == [(result.id, "hello")]
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0
