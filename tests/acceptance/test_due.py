"""A delayed message, a retry's countdown and a lapsed lease start on time on an idle worker.

An idle consumer asks when the first message of its queues that is not visible yet falls
due and claims then, instead of finding it at its next poll (up to polling_interval, a
second by default, late). The bounds here are loose (the machine is shared); the
precision benchmark (benchmarks/countdown.py) measures p50 and p99.
"""

from __future__ import annotations

import random
from statistics import median

import pytest

from pg_transport.db.pool import Connector
from pg_transport.store import Store
from tests.acceptance.harness import Env, wait_for, workers

pytestmark = pytest.mark.acceptance

APP = "tests.acceptance.timing_app"
COUNTDOWNS = 20
# Visibility timeouts of the claims a consumer makes before dying: longer than a worker
# takes to start (under a second on an idle machine; the test asserts it started in
# time), apart enough that each redelivery is timed alone.
LEASES = (4.0, 4.7, 5.4)


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
    # Found at the next poll instead, they would start ~0.5 s late on average.
    assert median(late) < 0.1, sorted(late)
    assert max(late) < 0.4, sorted(late)
    assert min(late) > -0.01, sorted(late)  # never early


def test_a_retry_countdown_starts_when_due(env: Env) -> None:
    with workers(env, "retrying", pool="prefork", concurrency=1, app=APP):
        client = env.client()
        for n in range(3):
            client.send_task("tests.acceptance.timing_app.retry_once", args=[0.5 + 0.3 * n])
        wait_for(lambda: count_runs(env) == 6, 30, "every retry to run")
    late = lateness(env)
    assert len(late) == 3
    assert max(late) < 0.2, late
    assert min(late) > -0.01, late


def test_lapsed_leases_are_redelivered_when_they_run_out(env: Env) -> None:
    client = env.client()
    for _ in range(3):
        client.send_task("tests.acceptance.timing_app.lapsed")
    # A consumer claims them one by one, each with its own visibility timeout, and dies
    # without a word: nothing renews or releases them.
    connector = Connector(env.pg_url)
    store = Store(connector, env.schema)
    try:
        for vt in LEASES:
            assert len(store.claim(["celery"], [vt], 1)) == 1
    finally:
        connector.close()
    expiries = env.scalar("SELECT array_agg(visible_at ORDER BY visible_at) FROM {schema}.message")
    with workers(env, "heir", pool="prefork", concurrency=2, app=APP):
        assert env.scalar("SELECT min(visible_at) > now() FROM {schema}.message"), (
            "the worker took longer to start than the leases last"
        )
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
    assert max(late) < 0.2, late
    assert min(late) > -0.01, late
