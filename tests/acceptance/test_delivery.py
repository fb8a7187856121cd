"""Real celery workers on pgq: exactly-once under load, crash redelivery, priority."""

from __future__ import annotations

import time
from collections import Counter

import pytest

import pg_transport
from tests.acceptance.harness import (
    Env,
    start_worker,
    terminate_backends_of,
    wait_for,
    workers,
)

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"
SLOW = "tests.acceptance.app.slow_mark"


@pytest.mark.sessions(14)  # the most of two runs, -n 0
def test_two_workers_run_every_task_exactly_once(env: Env) -> None:
    total = 2000
    client = env.client()
    # One commit for the backlog (pg_transport.batch): the workers start after it.
    with client.producer_or_acquire() as producer, pg_transport.batch():
        ids = [client.send_task(MARK, args=[f"t{n}"], producer=producer).id for n in range(total)]
    with workers(env, "w1", "w2", concurrency=4):
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.task_runs") >= total,
            240,
            f"{total} task runs",
        )
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "every message to be acked",
        )
    runs = env.runs()
    per_id = Counter(r[0] for r in runs)
    assert set(per_id) == set(ids)
    assert max(per_id.values()) == 1
    assert len({r[2] for r in runs}) >= 2, "both workers should have taken part"


@pytest.mark.sessions(8)  # side by side, the run's meter
def test_a_worker_runs_the_tasks_of_a_batch_once_each_after_its_commit(env: Env) -> None:
    total = 300
    client = env.client()
    with workers(env, "w1", concurrency=4):
        with pg_transport.batch():
            ids = [client.send_task(MARK, args=[f"b{n}"]).id for n in range(total)]
            # The idle worker would have started the first of them by now, had they
            # been published one by one.
            before_commit = env.scalar("SELECT clock_timestamp()")
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.task_runs") >= total,
            120,
            f"{total} task runs",
        )
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "every message to be acked",
        )
    per_id = Counter(r[0] for r in env.runs())
    assert set(per_id) == set(ids)
    assert max(per_id.values()) == 1
    assert env.scalar("SELECT min(at) FROM {schema}.task_runs") > before_commit


@pytest.mark.sessions(8)  # the most of two runs, -n 0
def test_sigkilled_worker_task_runs_again_once_after_vt(env: Env) -> None:
    vt = 3.0
    environ = {"PGQ_VISIBILITY_TIMEOUT": str(vt)}
    client = env.client()
    # Long enough to be killed mid-run (the kill follows its start within ~50 ms).
    result = client.send_task(SLOW, args=["crash", 2.0])
    first = start_worker(env, "doomed", concurrency=2, environ=environ)
    try:
        wait_for(lambda: env.runs(), 30, "the task to start on the first worker")
    finally:
        first.kill()  # SIGKILL to the whole process group, mid-task
    first.proc.wait(10)
    killed_at = time.monotonic()
    with workers(env, "survivor", concurrency=2, environ=environ):
        wait_for(lambda: len(env.runs()) >= 2, 60, "the task to run again")
        redelivered_after = time.monotonic() - killed_at
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "the redelivered task to be acked",
        )
    runs = env.runs()
    assert [r[0] for r in runs] == [result.id, result.id]
    assert runs[0][2] != runs[1][2]
    # Not before the lease ran out (minus the time the kill took to be seen).
    assert redelivered_after >= vt - 1.5


@pytest.mark.sessions(12)  # the most of two runs, -n 0
def test_long_task_is_not_redelivered_while_renewed(env: Env) -> None:
    environ = {"PGQ_VISIBILITY_TIMEOUT": "1"}
    client = env.client()
    client.send_task(SLOW, args=["long", 3.0])
    with workers(env, "a", "b", concurrency=2, environ=environ):
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "the long task to finish and be acked",
        )
    assert len(env.runs()) == 1  # 3x its vt, yet no second run


@pytest.mark.sessions(7)  # the most of two runs, -n 0
def test_priority_order(env: Env) -> None:
    client = env.client()
    sent = [(0, "low"), (9, "high"), (5, "mid"), (255, "top"), (9, "high2")]
    for prio, label in sent:
        client.send_task(MARK, args=[label], priority=prio)
    environ = {"TEST_PREFETCH": "1"}
    with workers(env, "solo", concurrency=1, environ=environ):
        wait_for(lambda: len(env.runs()) == len(sent), 60, "all tasks")
    assert [r[1] for r in env.runs()] == ["top", "high", "high2", "mid", "low"]


@pytest.mark.sessions(2)  # the most of two runs, -n 0
def test_purge_returns_the_count(env: Env) -> None:
    client = env.client()
    for n in range(7):
        client.send_task(MARK, args=[f"p{n}"])
    assert client.control.purge() == 7
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0


@pytest.mark.sessions(1)  # the most of two runs, -n 0
def test_passive_declare_and_qsize_report_the_count(env: Env) -> None:
    client = env.client()
    for n in range(5):
        client.send_task(MARK, args=[f"c{n}"])
    with client.connection_for_write() as conn:
        ok = conn.default_channel.queue_declare("celery", passive=True)
        assert ok.message_count == 5
        queue = conn.SimpleQueue("celery")
        assert queue.qsize() == 5
        queue.close()


@pytest.mark.sessions(7)  # side by side, the run's meter
def test_worker_reconnects_after_its_backends_are_terminated(env: Env) -> None:
    client = env.client()
    with workers(env, "phoenix", concurrency=2) as (worker,):
        client.send_task(MARK, args=["before"])
        wait_for(lambda: len(env.runs()) == 1, 30, "the first task")
        assert terminate_backends_of(env, worker) >= 1
        client.send_task(MARK, args=["after"])
        wait_for(lambda: len(env.runs()) == 2, 60, "a task after the reconnect")
        assert worker.proc.poll() is None
    assert [r[1] for r in env.runs()] == ["before", "after"]


@pytest.mark.sessions(6)  # side by side, the run's meter
def test_idle_workers_are_woken_by_a_publish_and_a_killed_one_holds_nothing(
    env: Env,
) -> None:
    # Only a wake-up can start these tasks in time: the poll is a minute away, and a
    # task a dead worker had taken would wait out this visibility timeout.
    environ = {"PGQ_VISIBILITY_TIMEOUT": "300", "PGQ_POLLING_INTERVAL": "60"}
    with workers(env, "doomed", "alive", concurrency=2, environ=environ) as (doomed, alive):
        doomed.kill()
        doomed.proc.wait(10)
        client = env.client()
        started = time.monotonic()
        for n in range(4):
            client.send_task(MARK, args=[f"h{n}"])
        wait_for(lambda: len(env.runs()) == 4, 30, "every task, on the live worker")
        assert time.monotonic() - started < 30
        assert {r[2] for r in env.runs()} == {alive.proc.pid}
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            30,
            "every task to be acked",
        )
        # Killed, not stopped: with no poll due for a minute, a warm shutdown waits out
        # the event loop's longest sleep (10 s); the acks are already checked above.
        alive.kill()
        alive.proc.wait(10)
