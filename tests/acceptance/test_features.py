"""Celery features on pgq, one test each: Reject, failures, worker loss, routes, beat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.harness import QUICK_STOP, ROOT, Env, Fleet, fleet, wait_for, workers

# The sessions a test holds at most (the most of two runs, -n 0); a test may say otherwise.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(7)]


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


APP = "tests.acceptance.features_app"
T = APP + "."


@pytest.fixture(scope="module")
def features_fleet(module_env: Env) -> Iterator[Fleet]:
    """One worker (one slot) for the tests that only need one running as configured."""
    module_env.extra.update(QUICK_STOP)
    with fleet(module_env, "features", concurrency=1, app=APP) as started:
        yield started


@pytest.fixture
def shared(features_fleet: Fleet) -> Iterator[Env]:
    with features_fleet.serve() as env:
        yield env


def count(env: Env, query: str, *params: object) -> int:
    return int(env.scalar(query, *params) or 0)


def test_reject_with_requeue_runs_again(shared: Env) -> None:
    env = shared
    env.client().send_task(T + "reject", args=["again", True])
    wait_for(lambda: len(env.runs()) == 2, 30, "the requeued task to run again")
    wait_for(lambda: count(env, "SELECT count(*) FROM {schema}.message") == 0, 30, "ack")
    assert count(env, "SELECT count(*) FROM {schema}.dead_letter") == 0


def test_reject_without_requeue_is_dead_lettered(shared: Env) -> None:
    env = shared
    result = env.client().send_task(T + "reject", args=["once", False])
    wait_for(
        lambda: count(env, "SELECT count(*) FROM {schema}.dead_letter") == 1,
        30,
        "the rejected message in dead_letter",
    )
    assert len(env.runs()) == 1
    assert env.scalar("SELECT task_id FROM {schema}.dead_letter") == result.id
    assert env.scalar("SELECT reason FROM {schema}.dead_letter").startswith(
        "rejected without requeue"
    )


@pytest.mark.parametrize(("ack_on_failure", "dead"), [("1", 0), ("0", 1)])
def test_acks_on_failure_or_timeout(env: Env, ack_on_failure: str, dead: int) -> None:
    env.client().send_task(T + "fail", args=["boom"])
    environ = {"TEST_ACK_ON_FAILURE": ack_on_failure}
    with workers(env, "f", concurrency=1, app=APP, environ=environ):
        wait_for(
            lambda: count(env, "SELECT count(*) FROM {schema}.message") == 0,
            30,
            "the failed task's message to leave the queue",
        )
    # Acked on failure: gone. Not acked: Celery rejects it without requeue, and
    # pgq keeps it as a dead letter instead of dropping it.
    assert len(env.runs()) == 1
    assert count(env, "SELECT count(*) FROM {schema}.dead_letter") == dead


def test_reject_on_worker_lost_requeues_to_run_again(env: Env) -> None:
    env.client().send_task(T + "die", args=["lost"])
    environ = {"TEST_REJECT_ON_LOST": "1"}
    with workers(env, "pf", pool="prefork", concurrency=1, app=APP, environ=environ):
        wait_for(lambda: len(env.runs()) == 2, 60, "the task to run again after its child died")
        wait_for(lambda: count(env, "SELECT count(*) FROM {schema}.message") == 0, 30, "ack")


def test_task_routes_and_several_queues(env: Env) -> None:
    client = env.client(task_routes={T + "routed": {"queue": "reports"}})
    client.send_task(T + "routed", args=["r"])
    client.send_task(T + "record", args=["d"])
    with workers(env, "multi", concurrency=2, app=APP, queues="celery,reports"):
        wait_for(lambda: len(env.runs()) == 2, 30, "both tasks")
    assert sorted(r[1] for r in env.runs()) == ["d", "r@reports"]


def test_worker_on_one_queue_leaves_the_other(env: Env) -> None:
    client = env.client(task_routes={T + "routed": {"queue": "reports"}})
    client.send_task(T + "routed", args=["r"])
    client.send_task(T + "record", args=["d"])
    with workers(env, "only-reports", concurrency=1, app=APP, queues="reports"):
        wait_for(lambda: len(env.runs()) == 1, 30, "the reports task")
    assert [r[1] for r in env.runs()] == ["r@reports"]
    assert count(env, "SELECT count(*) FROM {schema}.message WHERE queue = 'celery'") == 1


def test_beat_runs_a_periodic_task_on_schedule(shared: Env, tmp_path: Path) -> None:
    env = shared
    beat = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.acceptance.launch",  # celery -A APP beat, without the umbrella
            APP,
            "beat",
            "-l",
            "info",
            "--schedule",
            str(tmp_path / "beat-schedule"),
        ],
        cwd=ROOT,
        env=env.environ(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: len(env.runs()) >= 3, 30, "three periodic runs")
    finally:
        os.killpg(beat.pid, signal.SIGTERM)
        beat.wait(30)
    ticks = [r for r in env.runs() if r[1] == "tick"]
    assert len(ticks) >= 3
    assert len(set(r[0] for r in ticks)) == len(ticks)  # each tick is its own task
    spacing = env.scalar(
        "SELECT extract(epoch FROM max(at) - min(at)) / (count(*) - 1)"
        " FROM {schema}.task_runs WHERE label = 'tick'"
    )
    assert 0.5 <= spacing <= 2.0  # scheduled every second


def test_prefetched_message_behind_a_long_task_is_not_redelivered(env: Env) -> None:
    client = env.client()
    client.send_task(T + "sleep", args=["long", 4.0])
    client.send_task(T + "record", args=["waiting"])
    environ = {"PGQ_VISIBILITY_TIMEOUT": "1", "TEST_PREFETCH": "2"}
    # One slot, prefetch 2: the second message waits in the worker for 4 vts.
    with workers(env, "one-slot", concurrency=1, app=APP, environ=environ):
        wait_for(lambda: len(env.runs()) == 2, 30, "both tasks")
        wait_for(lambda: count(env, "SELECT count(*) FROM {schema}.message") == 0, 30, "acks")
    assert Counter(r[1] for r in env.runs()) == {"long": 1, "waiting": 1}
