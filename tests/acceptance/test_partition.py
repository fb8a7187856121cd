"""A worker cut off from Postgres does not start prefetched tasks whose leases lapsed."""

from __future__ import annotations

from collections import Counter
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.harness import Env, start_worker, wait_for
from tests.proxy import CuttingProxy

pytestmark = pytest.mark.acceptance

APP = "tests.acceptance.lapse_app"
GATED = "tests.acceptance.lapse_app.gated"
MARK = "tests.acceptance.app.mark"
NOT_STARTED = "not started: its lease on message"


def test_a_cut_off_worker_does_not_start_prefetched_tasks_whose_leases_lapsed(
    env: Env, proxy: CuttingProxy
) -> None:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {}.gates (label text)").format(sql.Identifier(env.schema))
        )
    parts = urlsplit(env.broker_url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    proxied = f"pgq://{auth}127.0.0.1:{proxy.port}{parts.path}?sslmode=disable"
    leases = {"PGQ_VISIBILITY_TIMEOUT": "2"}
    client = env.client()
    block = client.send_task(GATED, args=["block"]).id
    marks = [client.send_task(MARK, args=[f"m{n}"]).id for n in range(3)]
    # One slot, busy with the gated task; the three others are prefetched behind it.
    cut = start_worker(
        env,
        "cut",
        pool="prefork",
        concurrency=1,
        app=APP,
        args=("--prefetch-multiplier", "4"),
        environ={"PGQ_BROKER_URL": proxied, **leases},
    )
    other = None
    try:
        wait_for(lambda: [r for r in env.runs() if r[0] == block], 30, "the gated task")
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message WHERE read_ct = 1") == 4,
            30,
            "every task claimed by the worker",
        )
        proxy.pause()  # the partition: no byte between the worker and Postgres
        # Its leases lapse; another worker runs the prefetched tasks.
        other = start_worker(env, "other", app=APP, environ=leases)
        wait_for(lambda: {r[1] for r in env.runs()} >= {"m0", "m1", "m2"}, 60, "the other worker")
        # The slot frees up: the cut-off worker's prefetched tasks are next in line.
        env.scalar("INSERT INTO {schema}.gates VALUES ('block') RETURNING 1")

        def settled() -> bool:
            labels = Counter(r[1] for r in env.runs())
            started = sum(labels[f"m{n}"] for n in range(3)) - 3
            return cut.output().count(NOT_STARTED) + started >= 3

        wait_for(settled, 60, "the cut-off worker to take its prefetched tasks")
        proxy.resume()
    finally:
        proxy.resume()
        cut.stop()
        if other is not None:
            other.stop()
    labels = Counter(r[1] for r in env.runs() if r[0] in marks)
    assert labels == {"m0": 1, "m1": 1, "m2": 1}, labels
    assert cut.output().count(NOT_STARTED) == 3, cut.output()[-3000:]
