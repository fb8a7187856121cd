"""Unique tasks through a real Celery worker with pgq as broker and result backend: the
duplicates of a queued task are never run, each names the task that holds its key, whose
result they resolve to, and the key is free again once that task ran."""

from __future__ import annotations

import pytest

from pg_transport import DuplicateTask
from tests.acceptance.harness import QUICK_STOP, Env, workers
from tests.acceptance.test_results import APP, T, client

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    env.extra.update(QUICK_STOP)
    return env


def test_duplicates_run_once_and_resolve_to_the_holders_result(env: Env) -> None:
    app = client(env)
    first = app.send_task(
        T + "echo", args=["first"], unique_key="report-1", unique_while="queued_or_running"
    )
    holders = set()
    for n in range(5):  # queued, no worker yet: every one a duplicate
        with pytest.raises(DuplicateTask) as dup:
            app.send_task(
                T + "echo", args=[f"dup-{n}"], unique_key="report-1", unique_conflict="raise"
            )
        holders.add(dup.value.existing_id)
    assert holders == {first.id}
    with workers(env, "w-unique", app=APP):
        assert first.get(timeout=30) == "first"
        assert app.AsyncResult(holders.pop()).get(timeout=5) == "first"
        # The key left with its message: a new publish is a new task, and runs.
        again = app.send_task(T + "echo", args=["again"], unique_key="report-1")
        assert again.id != first.id and again.get(timeout=30) == "again"
    assert [task_id for task_id, label, _ in env.runs() if label == "echo"] == [first.id, again.id]
