"""Real workers ride out a restart of the Postgres server in the middle of a drain.

A throwaway cluster (never the shared server) holds the queue *and* the table the
tasks record their runs in. 5,000 tasks are published, two workers start draining,
and after at least 1,000 runs the server is restarted with ``pg_ctl restart`` — a
clean fast shutdown, and an immediate one (a crash: no shutdown checkpoint, crash
recovery on start). Every session is cut; the workers must reconnect and finish, and
once both have connected again, each runs part of a batch published after the restart.
The task is ``soak_app.mark``, not ``app.mark``: the latter records on a connection
the restart cuts, so the run fails (and, acks_late, is acked) without its record.

Duplicates are allowed only for messages in flight at the restart, and those are
bounded: a worker holds at most concurrency x prefetch_multiplier claimed, unacked
messages (running or reserved). A held message runs twice only if its ack was lost:
either the ack was attempted while the server was shutting down or down (it is retried
once, at once, on a fresh connection, which fails too while the server is away: the
worker logs "Couldn't ack"), or, in the crash, its commit was lost with WAL the server
had not yet written (acks commit with synchronous_commit=off). Its lease then lapses
after the vt and it is delivered again; messages claimed after the restart are acked
normally. So duplicates <= workers x held-per-worker; the test allows twice that as a
margin, and after a fast restart (no commit is lost) it checks the exact account:
duplicates <= failed acks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pg_transport
from tests.acceptance.cluster import (
    Cluster,
    ClusterUnavailable,
    find_bindir,
    run_as,
    throwaway_cluster,
)
from tests.acceptance.harness import Env, Worker, prepare, wait_for, workers
from tests.acceptance.soak_app import MARK, prepare_runs
from tests.pg import new_schema_name

# Its workers and data are on a throwaway cluster of its own: no session on the test
# server (measured, -n 0), the least a test may declare.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(1)]

SOAK_APP = "tests.acceptance.soak_app"
TOTAL = 5000
RESTART_AFTER = 1000
WORKERS = 2
CONCURRENCY = 4
PREFETCH = 4
# Short, so that a message whose ack was lost in the restart comes back quickly.
VT = 5.0
DUPLICATE_BOUND = WORKERS * CONCURRENCY * PREFETCH * 2
# Published once both workers are back; each must run some of them.
AFTER = 200


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    try:
        find_bindir()
        run_as()
    except ClusterUnavailable as exc:
        pytest.skip(f"cannot start a throwaway Postgres cluster to restart: {exc}")
    with throwaway_cluster() as started:
        yield started


def query(env: Env, text: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(env.pg_url, connect_timeout=5) as conn:
        composed = sql.SQL(text).format(schema=sql.Identifier(env.schema))
        return conn.execute(composed, params).fetchall()


def scalar_or_none(env: Env, text: str) -> Any:
    """A scalar, or None while the server is restarting (the poll tries again)."""
    try:
        rows = query(env, text)
    except psycopg.OperationalError:
        return None
    return rows[0][0] if rows else None


def runs_recorded(env: Env) -> Any:
    return scalar_or_none(env, "SELECT count(*) FROM {schema}.task_runs")


def distinct_runs(env: Env) -> Any:
    return scalar_or_none(env, "SELECT count(DISTINCT task_id) FROM {schema}.task_runs")


def messages_left(env: Env) -> Any:
    return scalar_or_none(env, "SELECT count(*) FROM {schema}.message")


def publish(env: Env, total: int, label: str = "r", *, one_commit: bool = False) -> list[str]:
    """``one_commit``: in one pg_transport.batch (for a backlog published before any
    worker starts, where a commit per task would only take time)."""
    client = env.client()
    with (
        client.producer_or_acquire() as producer,
        pg_transport.batch() if one_commit else nullcontext(),
    ):
        return [
            client.send_task(MARK, args=[f"{label}{n}"], producer=producer).id for n in range(total)
        ]


def reconnected(worker: Worker) -> bool:
    """Whether the worker connected again since it started (Celery logs each connect)."""
    return worker.output().count("Connected to pgq://") >= 2


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_workers_reconnect_after_server_restart_and_every_task_runs(
    cluster: Cluster, mode: str
) -> None:
    t0 = time.monotonic()
    env = prepare(cluster.url(), new_schema_name())
    prepare_runs(env.pg_url, env.schema)
    ids = publish(env, TOTAL, one_commit=True)
    t_published = time.monotonic()
    started_before = cluster.start_time()
    environ = {"PGQ_VISIBILITY_TIMEOUT": str(VT), "TEST_PREFETCH": str(PREFETCH)}

    with workers(
        env, "r1", "r2", app=SOAK_APP, concurrency=CONCURRENCY, environ=environ
    ) as running:
        t_ready = time.monotonic()
        wait_for(
            lambda: (runs_recorded(env) or 0) >= RESTART_AFTER,
            60,
            f"{RESTART_AFTER} runs before the restart",
        )
        runs_before = runs_recorded(env)
        t_restart = time.monotonic()
        cluster.restart(mode)
        t_back = time.monotonic()
        wait_for(lambda: distinct_runs(env) == TOTAL, 90, f"all {TOTAL} tasks to run")
        t_all_ran = time.monotonic()
        wait_for(lambda: messages_left(env) == 0, 3 * VT + 30, "every message to be acked")
        t_acked = time.monotonic()
        # The backlog may be gone before a worker is back: one whose first try came while
        # the server was still going down waits out Celery's retry interval (2 s) while
        # the other drains. So each worker is seen back, then given work of its own: idle
        # and listening, each is woken for part of a fresh batch.
        wait_for(lambda: all(reconnected(w) for w in running), 60, "every worker to connect again")
        after_ids = publish(env, AFTER, label="a")
        wait_for(
            lambda: distinct_runs(env) == TOTAL + AFTER,
            60,
            f"the {AFTER} tasks published after the restart to run",
        )
        wait_for(
            lambda: messages_left(env) == 0, 30, "the tasks published after the restart to be acked"
        )
        alive = {w.name: w.proc.poll() is None for w in running}
        lost = {w.name: w.output().count("Connection to broker lost") for w in running}
        failed_acks = sum(w.output().count("Couldn't ack") for w in running)

    assert cluster.start_time() != started_before, "the server was not restarted"
    assert all(alive.values()), f"a worker died in the restart: {alive}"
    runs = query(env, "SELECT task_id, node FROM {schema}.task_runs ORDER BY seq")
    per_id = Counter(r[0] for r in runs)
    published_after = set(after_ids)
    assert set(per_id) == set(ids) | published_after, "some task never ran"
    assert messages_left(env) == 0
    assert scalar_or_none(env, "SELECT count(*) FROM {schema}.dead_letter") == 0
    nodes_after = {node for task_id, node in runs if task_id in published_after}
    assert len(nodes_after) == WORKERS, f"a worker did not consume after the restart: {nodes_after}"
    duplicates = sum(n - 1 for n in per_id.values())
    print(
        f"\nrestart -m {mode}: {TOTAL} tasks and {AFTER} after, {len(runs)} runs, "
        f"{duplicates} duplicates (bound {DUPLICATE_BOUND}), {failed_acks} failed acks, "
        f"{runs_before} runs before the restart, "
        f"'Connection to broker lost' per worker {lost}; "
        f"publish {t_published - t0:.1f}s, workers ready {t_ready - t_published:.1f}s, "
        f"restart took {t_back - t_restart:.1f}s, all ran {t_all_ran - t_ready:.1f}s "
        f"after ready, all acked {t_acked - t_all_ran:.1f}s later, "
        f"total {time.monotonic() - t0:.1f}s"
    )
    assert duplicates <= DUPLICATE_BOUND, (
        f"{duplicates} tasks ran twice: more than the {DUPLICATE_BOUND} that could have "
        "been in flight at the restart"
    )
    if mode == "fast":
        # A clean shutdown loses no commit: every second run is a logged failed ack.
        assert duplicates <= failed_acks, (
            f"{duplicates} duplicates but only {failed_acks} failed acks were logged"
        )
