"""Flow control meets exactly-once (docs/design/flow-control.md, "Composition"): an
atomic task's unique key and its concurrency slot are released exactly when the commit
that ends its delivery removes its row — never while its run is open — and a run that
is rolled back (a SIGKILL before its commit, a retry) keeps them held until the
delivery that follows commits. Real workers, real sessions, a real SIGKILL.

Tasks: tests/acceptance/atomic_flow_app.py (atomic_app's tables, points and gates).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from pg_transport import DuplicateTask
from tests.acceptance.harness import Env, start_worker, wait_for

APP = "tests.acceptance.atomic_flow_app"
T = "tests.acceptance.atomic_flow_app."
VT = 2.0
QUICK = {"PGQ_POLLING_INTERVAL": "0.2", "PGQ_VISIBILITY_TIMEOUT": str(VT)}

# 18 sessions: the run's meter saw 16 side by side.
pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(300), pytest.mark.sessions(18)]


@pytest.fixture
def env(env: Env) -> Env:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        for ddl in (
            "CREATE TABLE {schema}.counter (id int PRIMARY KEY, n int NOT NULL)",
            "INSERT INTO {schema}.counter VALUES (1, 0)",
            "CREATE TABLE {schema}.audit (task_id text NOT NULL, label text NOT NULL)",
            "CREATE TABLE {schema}.points (task_id text, point text, pid int,"
            " at timestamptz DEFAULT clock_timestamp())",
            "CREATE TABLE {schema}.gates (label text PRIMARY KEY)",
        ):
            conn.execute(sql.SQL(ddl).format(schema=sql.Identifier(env.schema)))
    return env


@pytest.fixture
def app(env: Env) -> Celery:
    return env.client(result_backend=env.broker_url)


@pytest.fixture
def stopped() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for worker in started:
        worker.kill()


def start(env: Env, name: str) -> Any:
    return start_worker(env, name, pool="prefork", concurrency=2, app=APP, environ=dict(QUICK))


def open_gate(env: Env, label: str) -> None:
    env.scalar("INSERT INTO {schema}.gates VALUES (%s) RETURNING 1", label)


def reached(env: Env, task_id: str, point: str) -> int:
    return int(
        env.scalar(
            "SELECT count(*) FROM {schema}.points WHERE task_id = %s AND point = %s",
            task_id,
            point,
        )
    )


def state(env: Env, task_id: str) -> str | None:
    found = env.scalar("SELECT status FROM {schema}.result WHERE task_id = %s", task_id)
    return None if found is None else str(found)


def audited(env: Env, task_id: str) -> int:
    return int(env.scalar("SELECT count(*) FROM {schema}.audit WHERE task_id = %s", task_id))


def row_of(env: Env, task_id: str) -> tuple[Any, ...] | None:
    """(visible_at, due_at, read_ct) of a task's message, None once it is gone. A
    message parked for a slot has ``due_at`` set and is visible again at the earliest
    holder's lease end, when a claim judges it again."""
    with psycopg.connect(env.pg_url) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT visible_at, due_at, read_ct FROM {}.message"
                " WHERE payload->'headers'->>'id' = %s"
            ).format(sql.Identifier(env.schema)),
            [task_id],
        ).fetchone()
    return None if row is None else tuple(row)


def kill_child_running(env: Env, worker: Any, task_id: str) -> None:
    """SIGKILL the prefork child that reached ``task_id``'s body (before its commit)."""
    pid = int(
        env.scalar(
            "SELECT pid FROM {schema}.points WHERE task_id = %s ORDER BY at DESC LIMIT 1",
            task_id,
        )
    )
    os.kill(pid, signal.SIGKILL)


def held_key(app: Celery, key: str, label: str) -> str:
    """Publish a task of ``key``: the holder's id when the key is held (DuplicateTask),
    else "" (the new task was queued)."""
    try:
        app.send_task(
            T + "held",
            kwargs={"label": label},
            unique_key=key,
            unique_while="queued_or_running",
            unique_conflict="raise",
        )
    except DuplicateTask as dup:
        return str(dup.existing_id)
    return ""


# -- unique keys ----------------------------------------------------------------------
def test_an_atomic_tasks_key_is_held_until_the_commit_of_the_delivery_that_ends_it(
    env: Env, app: Celery, stopped: list[Any]
) -> None:
    worker = start(env, "a")
    stopped.append(worker)
    first = app.send_task(
        T + "held",
        kwargs={"label": "k", "gate": "g1", "again_gate": "g2"},
        unique_key="atomic-key",
        unique_while="queued_or_running",
    ).id
    wait_for(lambda: reached(env, first, "written:first") == 1, 60, "the first run's body")
    # The run is open (its writes uncommitted): the key is held.
    assert held_key(app, "atomic-key", "while-open") == first
    kill_child_running(env, worker, first)
    # Rolled back by the kill: nothing of it stands, the message comes back, and its
    # redelivery holds the key while it runs.
    wait_for(lambda: reached(env, first, "written:again") == 1, 60, "the redelivery's body")
    assert audited(env, first) == 0 and state(env, first) is None
    assert held_key(app, "atomic-key", "while-redelivered") == first
    open_gate(env, "g2")
    wait_for(lambda: state(env, first) == "SUCCESS", 60, "the redelivery's commit")
    # The commit that stored the result removed the row: the key is free at once.
    assert row_of(env, first) is None
    assert held_key(app, "atomic-key", "after") == ""
    assert audited(env, first) == 1


def test_an_atomic_retry_keeps_the_key_until_the_retry_commits(
    env: Env, app: Celery, stopped: list[Any]
) -> None:
    stopped.append(start(env, "a"))
    first = app.send_task(
        T + "held",
        kwargs={"label": "r", "retry": True, "again_gate": "g2"},
        unique_key="atomic-retry",
        unique_while="queued_or_running",
    ).id
    # The first run raised Retry (rolled back); its retry runs and waits at g2.
    wait_for(lambda: reached(env, first, "written:again") == 1, 60, "the retry's body")
    assert audited(env, first) == 0
    assert held_key(app, "atomic-retry", "while-retrying") == first
    open_gate(env, "g2")
    wait_for(lambda: state(env, first) == "SUCCESS", 60, "the retry's commit")
    assert row_of(env, first) is None
    assert held_key(app, "atomic-retry", "after") == ""
    assert audited(env, first) == 1


# -- concurrency slots ----------------------------------------------------------------
def parked_for_a_slot(env: Env, task_id: str) -> bool:
    row = row_of(env, task_id)
    return row is not None and row[1] is not None


def test_an_atomic_tasks_slot_is_held_until_the_commit_of_the_delivery_that_ends_it(
    env: Env, app: Celery, stopped: list[Any]
) -> None:
    worker = start(env, "a")
    stopped.append(worker)
    # (A client that names tasks by string gives the key itself: the task's default
    # concurrency_key is applied where the task is known.)
    first = app.send_task(
        T + "slotted",
        kwargs={"tenant": "acme", "label": "a", "gate": "g1", "again_gate": "g2"},
        concurrency_key="acme",
    ).id
    wait_for(lambda: reached(env, first, "written:first") == 1, 60, "the first run's body")
    second = app.send_task(
        T + "slotted", kwargs={"tenant": "acme", "label": "b"}, concurrency_key="acme"
    ).id
    # The worker has a free process; a claim judged the second message and parked it:
    # the first's open run holds the tenant's one slot.
    wait_for(lambda: parked_for_a_slot(env, second), 60, "the second parked for the slot")
    assert reached(env, second, "written:first") == 0
    before = row_of(env, second)
    assert before is not None
    kill_child_running(env, worker, first)
    wait_for(lambda: reached(env, first, "written:again") == 1, 60, "the redelivery's body")
    # The killed run was rolled back; its redelivery holds the slot while it runs. The
    # second is judged again when it falls due (it was parked until the first lease's
    # end): parked anew, until the redelivery's lease end, and not run.
    assert audited(env, first) == 0
    wait_for(
        lambda: (
            (row := row_of(env, second)) is not None and row[1] is not None and row[0] > before[0]
        ),
        60,
        "the second judged again and parked behind the redelivery",
    )
    assert reached(env, second, "written:first") == 0
    open_gate(env, "g2")
    wait_for(lambda: state(env, second) == "SUCCESS", 60, "the second's run")
    assert state(env, first) == "SUCCESS"
    # The second started after the first's commit: the result committed with the
    # delete that freed the slot, and the second's body came after it.
    assert env.scalar(
        "SELECT (SELECT min(at) FROM {schema}.points WHERE task_id = %s)"
        " > (SELECT max(at) FROM {schema}.points WHERE task_id = %s)",
        second,
        first,
    )
    assert audited(env, first) == 1 and audited(env, second) == 1
