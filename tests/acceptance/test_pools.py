"""Every Celery pool consumes alike: prefork, threads and solo run the consumer engine on
Celery's event loop, gevent drives the same engine through kombu's blocking
``drain_events``. Each pool gets the same delivery checks, on real workers."""

from __future__ import annotations

import time
from collections import Counter

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.harness import Env, start_worker, wait_for, workers

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"
SLOW = "tests.acceptance.app.slow_mark"
POOLS = ["prefork", "threads", "solo", "gevent"]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.sessions(9)  # the most of two runs, -n 0
def test_a_pool_runs_each_task_once_in_priority_order_and_dead_letters_what_it_cannot(
    env: Env, pool: str
) -> None:
    client = env.client()
    # A backlog at mixed priorities, with a row no publisher would write in the middle.
    sent = [(n % 3 * 4, f"t{n}") for n in range(60)]
    for priority, label in sent[:30]:
        client.send_task(MARK, args=[label], priority=priority)
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {}.message (queue, payload) VALUES ('celery', '[1]')").format(
                sql.Identifier(env.schema)
            )
        )
    for priority, label in sent[30:]:
        client.send_task(MARK, args=[label], priority=priority)
    with workers(env, f"{pool}-1", pool=pool, concurrency=1) as (worker,):
        wait_for(lambda: len(env.runs()) >= len(sent), 60, f"{len(sent)} runs on {pool}")
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            30,
            "every message acked or dead-lettered",
        )
        # Idle now: a task sent next is woken for, not polled for.
        started = time.monotonic()
        client.send_task(MARK, args=["late"])
        wait_for(lambda: len(env.runs()) == len(sent) + 1, 30, "a task sent to the idle worker")
        assert time.monotonic() - started < 30
        assert worker.proc.poll() is None
    runs = [r[1] for r in env.runs()]
    assert Counter(runs) == Counter([label for _, label in sent] + ["late"])
    # One worker, one at a time: the higher priorities first (the backlog was there
    # before the worker started).
    priority_of = {label: priority for priority, label in sent}
    order = [priority_of[label] for label in runs[: len(sent)]]
    assert order == sorted(order, reverse=True)
    reason = env.scalar("SELECT reason FROM {schema}.dead_letter")
    assert reason.startswith("payload is a JSON array, not an object")


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.sessions(9)  # 8 the most of four runs per pool, -n 0 (was 10 before h-fast3)
def test_a_pool_s_killed_worker_s_task_runs_again_once_and_a_long_one_keeps_its_lease(
    env: Env, pool: str
) -> None:
    vt = 1.5
    environ = {"PGQ_VISIBILITY_TIMEOUT": str(vt)}
    client = env.client()
    # Long enough to be killed mid-run (the kill follows its start within ~50 ms).
    crashed = client.send_task(SLOW, args=["crash", 2.0])
    first = start_worker(env, f"{pool}-doomed", pool=pool, concurrency=1, environ=environ)
    try:
        wait_for(lambda: env.runs(), 30, "the task to start on the first worker")
    finally:
        first.kill()  # SIGKILL to the whole process group, mid-task
    first.proc.wait(10)
    # A task that runs for three visibility timeouts: renewed, never redelivered.
    client.send_task(SLOW, args=["long", 3 * vt])
    with workers(env, f"{pool}-survivor", pool=pool, concurrency=2, environ=environ):
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "both tasks to finish and be acked",
        )
    runs = [(r[0], r[1]) for r in env.runs()]
    assert runs.count((crashed.id, "crash")) == 2  # killed once, run again once
    assert [label for _, label in runs].count("long") == 1
