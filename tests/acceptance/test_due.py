"""A delayed message, a retry's countdown and a lapsed lease start on time on an idle worker.

An idle consumer asks when the first message of its queues that is not visible yet falls
due and claims then, instead of finding it at its next poll (up to polling_interval, a
second by default, late). Each test first measures how late a task published visible
at once starts on the same worker (the wake-up, the claim and the pool's hand-off: what a
loaded machine slows down) and bounds the delayed ones by that plus a margin a poll
would overrun. The precision benchmark (benchmarks/countdown.py) measures p50 and p99.
"""

from __future__ import annotations

import random
from datetime import datetime, timezone
from statistics import median

import pytest

from pg_transport.db.pool import Connector
from pg_transport.store import Store
from tests.acceptance.harness import Env, wait_for, workers

# The sessions a test holds at most (the most of two runs, -n 0); a test may say otherwise.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(10)]  # side by side, the run's meter: 9

APP = "tests.acceptance.timing_app"
COUNTDOWNS = 20
# Visibility timeouts of the claims a consumer makes before dying, counted from once the
# worker runs: apart enough that each redelivery is timed alone.
LEASES = (1.5, 2.2, 2.9)
BASELINE = 3  # tasks published visible at once, to measure the worker's own latency


def baseline(env: Env) -> float:
    """How late (seconds, the most of BASELINE) a task published visible at once starts
    on the running worker: an eta of now is no delay, published visible and woken for."""
    client = env.client()
    before = count_runs(env)
    for _ in range(BASELINE):
        client.send_task("tests.acceptance.timing_app.due", eta=datetime.now(timezone.utc))
        # One at a time: each is timed alone, as each delayed one is.
        wait_for(lambda n=before + 1: count_runs(env) >= n, 30, "a baseline task to run")
        before += 1
    late = lateness(env)
    env.scalar("DELETE FROM {schema}.task_runs RETURNING 1")
    return max(late)


def lateness(env: Env) -> list[float]:
    """How late each run with an eta label started (seconds), in run order."""
    with_eta = "label NOT IN ('first', 'lapsed')"
    rows = env.scalar(
        "SELECT array_agg(extract(epoch FROM at - label::timestamptz) ORDER BY seq)"
        f" FROM {{schema}}.task_runs WHERE {with_eta}"
    )
    return [float(x) for x in rows or []]


def count_runs(env: Env) -> int:
    return int(env.scalar("SELECT count(*) FROM {schema}.task_runs"))


def test_countdowns_start_when_due(env: Env) -> None:
    rng = random.Random(7)
    with workers(env, "punctual", pool="prefork", concurrency=2, app=APP):
        base = baseline(env)
        client = env.client()
        with client.producer_or_acquire() as producer:
            for _ in range(COUNTDOWNS):
                client.send_task(
                    "tests.acceptance.timing_app.due",
                    countdown=rng.uniform(0.2, 2.0),
                    producer=producer,
                )
        wait_for(lambda: count_runs(env) == COUNTDOWNS, 30, "every countdown to run")
    late = lateness(env)
    assert len(late) == COUNTDOWNS
    # Found at the next poll instead, they would start ~0.5 s late on average (a poll
    # each second), up to 1 s: on time means as late as a task published visible is.
    assert median(late) < base + 0.1, (base, sorted(late))
    assert max(late) < base + 0.4, (base, sorted(late))
    assert min(late) > -0.01, sorted(late)  # never early


def test_a_retry_countdown_starts_when_due(env: Env) -> None:
    with workers(env, "retrying", pool="prefork", concurrency=1, app=APP):
        base = baseline(env)
        client = env.client()
        for n in range(3):
            client.send_task("tests.acceptance.timing_app.retry_once", args=[0.5 + 0.3 * n])
        wait_for(lambda: count_runs(env) == 6, 30, "every retry to run")
    late = lateness(env)
    assert len(late) == 3
    assert max(late) < base + 0.2, (base, late)
    assert min(late) > -0.01, late


def test_lapsed_leases_are_redelivered_when_they_run_out(env: Env) -> None:
    client = env.client()
    for _ in range(3):
        client.send_task("tests.acceptance.timing_app.lapsed")
    # A consumer claims them, leased for longer than any worker takes to start, and
    # dies without a word: nothing renews or releases them.
    connector = Connector(env.pg_url)
    store = Store(connector, env.schema)
    try:
        for _ in LEASES:
            assert len(store.claim(["celery"], [3600.0], 1)) == 1
    finally:
        connector.close()
    with workers(env, "heir", pool="prefork", concurrency=2, app=APP):
        base = baseline(env)
        # The leases run out LEASES from now, as though the consumer had claimed them
        # just now: counted from a running worker, whatever its start-up took.
        expiries = env.scalar(
            "WITH l AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM {schema}.message),"
            " u AS (UPDATE {schema}.message AS m SET visible_at = clock_timestamp()"
            " + make_interval(secs => (%s::float8[])[l.n]) FROM l WHERE m.id = l.id"
            " RETURNING m.visible_at)"
            " SELECT array_agg(visible_at ORDER BY visible_at) FROM u",
            list(LEASES),
        )
        # Anything that wakes the idle worker makes it ask when its queues next fall due
        # (the baseline's tasks did so before the leases were shortened): a task due
        # long after them.
        env.client().send_task("tests.acceptance.timing_app.due", countdown=3600)
        wait_for(lambda: count_runs(env) == 3, 30, "the redeliveries")
    late = env.scalar(
        "SELECT array_agg(extract(epoch FROM r.at - e.at) ORDER BY r.at)"
        " FROM (SELECT at, row_number() OVER (ORDER BY at) AS n FROM {schema}.task_runs) AS r"
        " JOIN (SELECT e AS at, row_number() OVER (ORDER BY e) AS n"
        " FROM unnest(%s::timestamptz[]) AS e) AS e"
        " ON e.n = r.n",
        expiries,
    )
    late = [float(x) for x in late]
    assert len(late) == 3
    assert max(late) < base + 0.2, (base, late)
    assert min(late) > -0.01, late
