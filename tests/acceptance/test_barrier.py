"""Barriers on real celery workers: every callback body's effect exactly once, even
with a worker SIGKILLed mid-run; a failed part fires the errback once."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from barrier import Barrier
from pg_transport.fanin.backend import forget
from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


APP = "tests.acceptance.app."
# A killed worker's messages come back after this many seconds.
ENVIRON = {"PGQ_VISIBILITY_TIMEOUT": "2"}


@pytest.fixture
def client(env: Env) -> Iterator[Celery]:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.barrier_effects (seq bigserial PRIMARY KEY, label text NOT NULL,"
                " results json NOT NULL, pid integer)"
            ).format(sql.Identifier(env.schema))
        )
    client = env.client()
    yield client
    forget(client)


def effects(env: Env) -> list[tuple[str, Any]]:
    with psycopg.connect(env.pg_url) as conn:
        return conn.execute(
            sql.SQL("SELECT label, results FROM {}.barrier_effects").format(
                sql.Identifier(env.schema)
            )
        ).fetchall()


def dispatch_all(client: Celery, barriers: int, parts: int, seconds: float) -> None:
    b = Barrier(client)
    for n in range(barriers):
        label = f"b{n}"
        b.dispatch(
            label,
            [
                client.signature(APP + "barrier_part", args=[label, i, seconds])
                for i in range(parts)
            ],
            client.signature(APP + "barrier_collect", kwargs={"label": label}),
            errback=client.signature(APP + "barrier_errback", kwargs={"label": label}),
        )


def dispatch_slow_callback(client: Celery) -> None:
    """A barrier whose callback writes its side effect, then dawdles (first run only):
    the worker running it is the one the test kills."""
    Barrier(client).dispatch(
        "slow",
        [client.signature(APP + "barrier_part", args=["slow", i]) for i in range(2)],
        client.signature(APP + "barrier_collect", kwargs={"label": "slow", "seconds": 120}),
    )


def callback_pid(env: Env, label: str) -> int | None:
    return env.scalar(
        "SELECT pid FROM {schema}.task_runs WHERE label = %s", f"callback-start:{label}"
    )


def run_with_kills(
    env: Env, client: Celery, barriers: int, parts: int, kills: int
) -> dict[str, Any]:
    """Barriers x parts on two workers; ``kills`` times a worker is SIGKILLed mid-run
    (the first time: the one inside the slow callback's body) and replaced."""
    total = barriers * parts + 2
    started = time.monotonic()
    live = [start_worker(env, f"w{n}", concurrency=4, environ=ENVIRON) for n in range(2)]
    killed_at: list[int] = []
    try:
        dispatch_slow_callback(client)
        dispatch_all(client, barriers, parts, seconds=0.01)
        pid = wait_for(lambda: callback_pid(env, "slow"), 120, "the slow callback to start")
        for k in range(kills):
            wait_for(
                lambda k=k: (
                    env.scalar("SELECT count(*) FROM {schema}.barrier_part")
                    >= total * (k + 1) // (kills + 1)
                ),
                120,
                "parts to progress",
            )
            doomed = next((w for w in live if w.proc.pid == pid), live[0]) if k == 0 else live[0]
            doomed.kill()  # SIGKILL: parts and callbacks in flight on it die with it
            doomed.proc.wait(10)
            killed_at.append(env.scalar("SELECT count(*) FROM {schema}.barrier_part"))
            live.remove(doomed)
            if k + 1 < kills:
                live.append(start_worker(env, f"r{k}", concurrency=4, environ=ENVIRON))
        wait_for(
            lambda: (
                env.scalar(
                    "SELECT count(*) FROM {schema}.barrier WHERE status NOT IN ('armed', 'fired')"
                )
                == barriers + 1
            ),
            120 + total * 0.02,
            "every barrier to finish",
        )
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "every message to be acked",
        )
    finally:
        for worker in live:
            worker.stop()
    elapsed = time.monotonic() - started

    statuses = env.scalar(
        "SELECT json_object_agg(status, n) FROM (SELECT status, count(*) AS n"
        " FROM {schema}.barrier GROUP BY status) AS s"
    )
    assert statuses == {"completed": barriers + 1}
    done = effects(env)
    # Every callback body's side effect exactly once, the killed one included.
    assert Counter(label for label, _ in done) == {
        "slow": 1,
        **{f"b{n}": 1 for n in range(barriers)},
    }
    for label, results in done:
        count = 2 if label == "slow" else parts
        assert results == [{"label": label, "index": i} for i in range(count)]
    starts = Counter(r[1] for r in env.runs() if r[1].startswith("callback-start:"))
    assert starts["callback-start:slow"] == 2  # it did run twice: killed, then redelivered
    assert not [r for r in env.runs() if r[1].startswith("errback:")]
    return {
        "seconds": round(elapsed, 1),
        "parts_done_at_kills": killed_at,
        "callback_bodies_rerun": sum(starts.values()) - (barriers + 1),
    }


@pytest.mark.sessions(20)
def test_barriers_fire_once_with_a_worker_killed_mid_run(env: Env, client: Celery) -> None:
    stats = run_with_kills(env, client, barriers=200, parts=20, kills=1)
    print(f"200 barriers x 20 parts, 1 kill: {stats}")


@pytest.mark.soak
def test_soak_barriers_with_repeated_kills(env: Env, client: Celery) -> None:
    stats = run_with_kills(env, client, barriers=500, parts=20, kills=3)
    print(f"500 barriers x 20 parts, 3 kills: {stats}")


@pytest.mark.sessions(8)  # the most of two runs, -n 0
def test_failure_retry_zero_parts_and_the_workers_sweeper(env: Env, client: Celery) -> None:
    b = Barrier(client)
    b.dispatch(
        "failing",
        [
            client.signature(APP + "barrier_part", args=["failing", 0]),
            client.signature(APP + "barrier_failing_part", args=["failing", 1]),
            client.signature(APP + "barrier_part", args=["failing", 2]),
        ],
        client.signature(APP + "barrier_collect", kwargs={"label": "failing"}),
        errback=client.signature(APP + "barrier_errback", kwargs={"label": "failing"}),
    )
    b.dispatch(
        "flaky",
        [
            client.signature(APP + "barrier_part", args=["flaky", 0]),
            client.signature(APP + "barrier_flaky_part", args=["flaky", 1]),
        ],
        client.signature(APP + "barrier_collect", kwargs={"label": "flaky"}),
    )
    b.dispatch("empty", [], client.signature(APP + "barrier_collect", kwargs={"label": "empty"}))
    # A part no worker consumes: only the workers' sweeper can end this barrier.
    b.dispatch(
        "stranded",
        [client.signature(APP + "barrier_part", args=["stranded", 0], queue="nobody")],
        client.signature(APP + "barrier_collect", kwargs={"label": "stranded"}),
        errback=client.signature(APP + "barrier_errback", kwargs={"label": "stranded"}),
        ttl=1,
    )
    worker = start_worker(env, "solo", concurrency=2, environ={"PGQ_BARRIER_SWEEP_INTERVAL": "0.2"})
    try:
        wait_for(
            lambda: (
                env.scalar(
                    "SELECT count(*) FROM {schema}.barrier"
                    " WHERE status IN ('completed', 'failed', 'expired')"
                )
                == 4
            ),
            60,
            "every barrier to finish",
        )
        wait_for(
            lambda: (
                env.scalar("SELECT count(*) FROM {schema}.message WHERE queue <> 'nobody'") == 0
            ),
            60,
            "every message to be acked",
        )
    finally:
        worker.stop()
    assert sorted(effects(env)) == [
        ("empty", []),
        ("flaky", [{"label": "flaky", "index": 0}, {"label": "flaky", "index": 1}]),
    ]
    assert len([r for r in env.runs() if r[1].startswith("flaky-part:")]) == 2
    errbacks = sorted(r[1] for r in env.runs() if r[1].startswith("errback:"))
    assert errbacks == [
        "errback:failing:failed:part 1 failed: ValueError('part 1 of failing fails')",
        "errback:stranded:expired:ttl",
    ]
    shown = b.show("failing")
    assert shown is not None and shown["status"] == "failed" and shown["parts_failed"] == 1
    assert b.counts() == {"armed": 0, "fired": 0, "completed": 2, "failed": 1, "expired": 1}
