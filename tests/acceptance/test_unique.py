"""Unique tasks through a real Celery worker with pgq as broker and result backend: the
duplicates of a queued task are never run, each names the task that holds its key, whose
result they resolve to, and the key is free again once that task ran."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import psycopg
import pytest
from celery import chord, group
from celery.result import AsyncResult
from kombu import Connection, Queue
from psycopg import sql

import pg_transport
from pg_transport import DuplicateTask
from pg_transport.message.unique import UniqueError
from tests.acceptance.harness import QUICK_STOP, Env, workers
from tests.acceptance.test_results import APP, T, client
from tests.integration.test_privileges import Roles, grant, options, page_roles, publisher_app

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    env.extra.update(QUICK_STOP)
    return env


def test_duplicates_run_once_and_resolve_to_the_holders_result(env: Env) -> None:
    app = client(env)
    first = app.send_task(
        T + "echo", args=["first"], unique_key="report-1", unique_while="queued_or_running"
    )
    holders = set()
    for n in range(5):  # queued, no worker yet: every one a duplicate
        with pytest.raises(DuplicateTask) as dup:
            app.send_task(
                T + "echo", args=[f"dup-{n}"], unique_key="report-1", unique_conflict="raise"
            )
        holders.add(dup.value.existing_id)
    assert holders == {first.id}
    with workers(env, "w-unique", app=APP):
        assert first.get(timeout=30) == "first"
        assert app.AsyncResult(holders.pop()).get(timeout=5) == "first"
        # The key left with its message: a new publish is a new task, and runs.
        again = app.send_task(T + "echo", args=["again"], unique_key="report-1")
        assert again.id != first.id and again.get(timeout=30) == "again"
    assert [task_id for task_id, label, _ in env.runs() if label == "echo"] == [first.id, again.id]


# -- a plain task's duplicate delay() resolves to the holder (result alias) -------------


def read_elsewhere(env: Env, task_id: str) -> str:
    """``AsyncResult(task_id).get()`` in another process (a fresh app, which published
    nothing): what a duplicate's id resolves to anywhere but where it was sent."""
    script = (
        "import sys\n"
        "from celery import Celery\n"
        "import pg_transport\n"
        "app = Celery('reader', broker=sys.argv[1], backend=sys.argv[1])\n"
        "app.conf.broker_transport_options = {'schema': sys.argv[2]}\n"
        "print(app.AsyncResult(sys.argv[3]).get(timeout=30))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, env.broker_url, env.schema, task_id],
        capture_output=True,
        text=True,
        timeout=90,
        env=env.environ(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.sessions(12)  # side by side, the run's meter: 11
def test_a_plain_duplicate_delay_resolves_to_the_holders_result(env: Env) -> None:
    app = client(env)
    first = app.send_task(T + "echo", args=["first"], unique_key="report-2")
    # Celery picks the duplicate's id before it publishes: a new id, whose result is the
    # holder's, here and in any other process.
    again = app.send_task(T + "echo", args=["again"], unique_key="report-2")
    assert again.id != first.id
    assert again.state == "PENDING"
    with workers(env, "w-alias", app=APP):
        assert again.get(timeout=30) == "first"
        assert again.state == "SUCCESS" and again.ready()
        assert app.AsyncResult(again.id).get(timeout=5) == "first"
        assert read_elsewhere(env, again.id) == "first"
    assert [task_id for task_id, label, _ in env.runs() if label == "echo"] == [first.id]


@pytest.mark.sessions(20)  # side by side, the run's meter: 19
def test_concurrent_duplicates_each_resolve_to_the_one_that_ran(env: Env) -> None:
    app = client(env)
    n = 6
    start = threading.Barrier(n)
    sent: list[AsyncResult] = []
    lock = threading.Lock()

    def publish(label: str) -> None:
        start.wait(timeout=30)
        result = app.send_task(T + "echo", args=[label], unique_key="report-3")
        with lock:
            sent.append(result)

    threads = [threading.Thread(target=publish, args=(f"p{i}",)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(sent) == n
    with workers(env, "w-alias-race", app=APP):
        values = {result.id: result.get(timeout=30) for result in sent}
    runs = [(task_id, label) for task_id, label, _ in env.runs() if label == "echo"]
    assert len(runs) == 1, runs
    ran = runs[0][0]
    held = app.AsyncResult(ran).get(timeout=5)
    assert set(values.values()) == {held}
    assert ran in values  # the holder is one of the racers; the others are its duplicates


@pytest.mark.sessions(11)  # side by side, the run's meter: 10
def test_a_duplicate_published_in_an_application_transaction_resolves(env: Env) -> None:
    app = client(env)
    with psycopg.connect(env.pg_url) as conn:
        with pg_transport.transaction(conn):
            first = app.send_task(T + "echo", args=["in-txn"], unique_key="report-4")
            # The holder is this very transaction's message, not yet committed.
            again = app.send_task(T + "echo", args=["dup-in-txn"], unique_key="report-4")
        conn.commit()
    with psycopg.connect(env.pg_url) as conn:
        with pg_transport.transaction(conn):
            # A holder committed before: a duplicate in a transaction that commits later.
            later = app.send_task(T + "echo", args=["dup-later"], unique_key="report-4")
        conn.commit()
    assert len({first.id, again.id, later.id}) == 3
    with workers(env, "w-alias-txn", app=APP):
        assert again.get(timeout=30) == "in-txn"
        assert later.get(timeout=30) == "in-txn"
    assert [task_id for task_id, label, _ in env.runs() if label == "echo"] == [first.id]


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    with page_roles(pg_url, blocks=("1",)) as made:
        yield grant(made)


@pytest.mark.sessions(14)  # side by side, the run's meter: 13
def test_a_publisher_roles_duplicate_resolves_where_it_was_sent(roles: Roles) -> None:
    """docs/least-privilege.md's publisher, with docs/results.md's one function to wait on
    results: no right to store a result, so the duplicate's alias lives in the process
    that sent it (where its AsyncResult is), and nothing is stored for it."""
    env = Env(roles.pg_url, roles.schema, extra=dict(QUICK_STOP))
    with psycopg.connect(roles.pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL(
                "CREATE TABLE {}.task_runs (seq bigserial PRIMARY KEY, task_id text NOT NULL,"
                " label text, pid integer, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(roles.schema))
        )
    with roles.connect(roles.owner) as owner:
        owner.execute(
            sql.SQL("GRANT EXECUTE ON FUNCTION {}.result_read(text[]) TO {}").format(
                sql.Identifier(roles.schema), sql.Identifier(roles.publisher)
            )
        )
    environ = {"PGQ_BROKER_URL": roles.url(roles.worker), "PGQ_AUTO_MIGRATE": "false"}
    web = publisher_app(roles, ["celery"])
    web.conf.result_backend = roles.url(roles.publisher)
    web.conf.result_backend_transport_options = options(roles)
    with Connection(roles.url(roles.worker), transport_options=options(roles)) as conn:
        Queue("celery").bind(conn.channel()).declare()  # as a worker does at its start
    try:
        first = web.send_task(T + "echo", args=["first"], unique_key="report-5")
        again = web.send_task(T + "echo", args=["again"], unique_key="report-5")
        assert again.id != first.id
        with workers(env, "w-alias-role", app=APP, queues="celery", environ=environ):
            assert again.get(timeout=30) == "first"
        assert env.scalar("SELECT count(*) FROM {schema}.result WHERE task_id = %s", again.id) == 0
        assert [t for t, label, _ in env.runs() if label == "echo"] == [first.id]
    finally:
        web.close()


# -- chords ---------------------------------------------------------------------------


def test_a_unique_key_on_a_chords_part_is_refused_naming_the_option(env: Env) -> None:
    """A duplicate is never run: a header part that is one would leave its chord
    uncounted for good, a body that is one would answer with another task's result. So
    either is refused before it is sent, naming unique_key."""
    app = client(env)
    part = app.signature(T + "echo", args=["p"], options={"unique_key": "part"})
    body = app.signature(T + "echo", args=[])
    with pytest.raises(UniqueError, match=r"unique_key='part'.*part of chord.*may not be unique"):
        chord([part, app.signature(T + "echo", args=["q"])], body).apply_async()
    # Options given to the chord's apply_async go to every part: the same refusal.
    plain = [app.signature(T + "echo", args=[n]) for n in ("a", "b")]
    with pytest.raises(UniqueError, match="unique_key='all'"):
        chord(plain, body).apply_async(unique_key="all")
    unique_body = app.signature(T + "echo", args=[], options={"unique_key": "body"})
    with pytest.raises(UniqueError, match=r"unique_key='body'.*body of a chord"):
        chord(plain, unique_body).apply_async()
    # The body was refused before the chord was armed or any part sent.
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0
    # A group's parts may be unique: no chord counts them.
    sent = group(
        app.signature(T + "echo", args=["g"], options={"unique_key": "g"}),
        app.signature(T + "echo", args=["g2"], options={"unique_key": "g2"}),
    ).apply_async()
    assert len(sent.results) == 2
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 2
