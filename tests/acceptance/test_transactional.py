"""Transactional enqueue against a real worker, for each way an application holds its
transaction (a psycopg connection, a SQLAlchemy Session, Django's atomic() joined).

A task exists if and only if the order row it is about committed: the worker runs it
and finds the row after a commit, runs nothing after a rollback or a rolled-back
savepoint, never sees the message before the commit (it is idle, and the commit's
wake-up brings it: its poll is a minute away), and a producer killed before its commit
leaves nothing, one killed at any moment leaves a task for every committed row.

"Nothing ran" is shown without sleeping: a sentinel task published after the one that
must not run is waited for; the worker claims by id, so had the earlier message been
visible it would have been claimed first.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.harness import ROOT, Env, Worker, prepare, start_worker, wait_for
from tests.acceptance.txn_fronts import FRONTS, Fronts, setup_django
from tests.pg import drop_schema, new_schema_name

# The sessions a test holds at most (the most of two runs, -n 0); a test may say otherwise.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(10)]


@pytest.fixture(scope="module")
def env(pg_url: str) -> Iterator[Env]:
    schema = new_schema_name()
    env = prepare(pg_url, schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {}.orders (id bigserial PRIMARY KEY, label text)").format(
                sql.Identifier(schema)
            )
        )
    yield env
    drop_schema(pg_url, schema)


@pytest.fixture(scope="module")
def worker(env: Env) -> Iterator[Worker]:
    # Polling a minute apart: within the tests' waits only a wake-up brings a message.
    w = start_worker(env, "txn", environ={"PGQ_POLLING_INTERVAL": "60"})
    yield w
    # Killed: nothing is checked after the tests, and a warm shutdown waits out the
    # event loop's longest sleep (10 s) when no poll is due sooner.
    w.kill()
    w.proc.wait(10)


@pytest.fixture(scope="module")
def fronts(env: Env) -> Iterator[Fronts]:
    setup_django()
    f = Fronts(env.pg_url, env.broker_url, env.schema)
    yield f
    f.close()


def ran(env: Env) -> dict[str, str]:
    """label -> found/missing, for every order task the worker ran."""
    out: dict[str, str] = {}
    for _, label, _ in env.runs():
        outcome, _, name = label.partition(":")
        out[name] = outcome
    return out


def messages_about(env: Env, label: str) -> int:
    return int(
        env.scalar(
            "SELECT count(*) FROM {schema}.message WHERE payload::text LIKE %s", f"%{label}%"
        )
    )


def sentinel(fronts: Fronts, env: Env, prefix: str) -> None:
    """Publish a task apart (from a thread of its own: no transaction there) after
    everything before, and wait for the worker to have run it."""
    label = f"sentinel.{prefix}.{uuid.uuid4().hex[:6]}"
    thread = threading.Thread(target=fronts.enqueue, args=[label])
    thread.start()
    thread.join()
    wait_for(lambda: label in ran(env), 30, f"the sentinel {label} to run")


@pytest.mark.parametrize("front", FRONTS)
def test_the_worker_runs_the_task_at_the_commit_and_finds_its_row(
    front: str, env: Env, worker: Worker, fronts: Fronts
) -> None:
    label = f"{front}-commit"
    with fronts.transaction(front) as txn:
        txn.order(label)
        # The worker is awake and claims after our insert, and does not see it.
        sentinel(fronts, env, label)
        assert label not in ran(env)
    # Woken by the commit (its poll is a minute away).
    wait_for(lambda: label in ran(env), 20, f"{label} to run after the commit")
    assert ran(env)[label] == "found"


@pytest.mark.parametrize("front", FRONTS)
def test_a_rollback_runs_nothing_and_leaves_no_message(
    front: str, env: Env, worker: Worker, fronts: Fronts
) -> None:
    label = f"{front}-rollback"
    with pytest.raises(ZeroDivisionError), fronts.transaction(front) as txn:
        txn.order(label)
        1 / 0  # noqa: B018
    assert messages_about(env, label) == 0
    sentinel(fronts, env, label)
    assert label not in ran(env)


@pytest.mark.parametrize("front", FRONTS)
def test_a_rolled_back_savepoint_takes_only_its_tasks(
    front: str, env: Env, worker: Worker, fronts: Fronts
) -> None:
    with fronts.transaction(front) as txn:
        txn.order(f"{front}-sp-before")
        with pytest.raises(ZeroDivisionError), txn.savepoint():
            txn.order(f"{front}-sp-inside")
            1 / 0  # noqa: B018
        txn.order(f"{front}-sp-after")
    wait_for(
        lambda: {f"{front}-sp-before", f"{front}-sp-after"} <= set(ran(env)),
        20,
        "the tasks outside the savepoint to run",
    )
    sentinel(fronts, env, front)
    outcomes = ran(env)
    assert outcomes[f"{front}-sp-before"] == outcomes[f"{front}-sp-after"] == "found"
    assert f"{front}-sp-inside" not in outcomes
    assert messages_about(env, f"{front}-sp-inside") == 0


def producer(env: Env, front: str, mode: str, label: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.acceptance.txn_producer", front, mode, label],
        cwd=ROOT,
        env=env.environ(PGAPPNAME=f"txn-producer-{label}"),
        stdout=subprocess.PIPE,
        text=True,
    )


def kill_and_wait_for_its_sessions(env: Env, proc: subprocess.Popen[str], label: str) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # The server ends a dead client's sessions (rolling back what was open) when it
    # notices the socket closed.
    wait_for(
        lambda: env.scalar(
            "SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name = %s",
            f"txn-producer-{label}",
        ),
        20,
        "the killed producer's sessions to end",
    )


@pytest.mark.sessions(12)  # side by side, the run's meter
@pytest.mark.parametrize("front", FRONTS)
def test_a_producer_killed_before_its_commit_leaves_nothing(
    front: str, env: Env, worker: Worker, fronts: Fronts
) -> None:
    label = f"{front}-killed"
    proc = producer(env, front, "hold", label)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"  # ordered and enqueued, not committed
    finally:
        kill_and_wait_for_its_sessions(env, proc, label)
    assert messages_about(env, label) == 0
    assert env.scalar("SELECT count(*) FROM {schema}.orders WHERE label = %s", label) == 0
    sentinel(fronts, env, label)
    assert label not in ran(env)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.sessions(14)  # side by side, the run's meter
def test_a_producer_killed_at_any_moment_leaves_a_task_for_every_committed_row(
    front: str, env: Env, worker: Worker, fronts: Fronts
) -> None:
    prefix = f"{front}-loop"
    proc = producer(env, front, "loop", prefix)
    try:
        wait_for(
            lambda: env.scalar(
                "SELECT count(*) >= 20 FROM {schema}.orders WHERE label LIKE %s", f"{prefix}-%"
            ),
            60,
            "the producer to commit 20 orders",
        )
    finally:
        kill_and_wait_for_its_sessions(env, proc, prefix)
    with psycopg.connect(env.pg_url) as conn:
        committed = {
            row[0]
            for row in conn.execute(
                sql.SQL("SELECT label FROM {}.orders WHERE label LIKE %s").format(
                    sql.Identifier(env.schema)
                ),
                [f"{prefix}-%"],
            )
        }

    def tasks() -> dict[str, str]:
        return {k: v for k, v in ran(env).items() if k.startswith(f"{prefix}-")}

    wait_for(lambda: set(tasks()) >= committed, 30, "a task for every committed order")
    sentinel(fronts, env, prefix)
    assert set(tasks()) == committed  # no task without its row, no row without its task
    assert set(tasks().values()) == {"found"}
