"""A task that kills its worker every time ends in dead_letter, identity recovered."""

from __future__ import annotations

import pytest
from psycopg import sql

from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


APP = "tests.acceptance.poison_app"
TASK = "tests.acceptance.poison_app.run_pipeline"


def test_worker_killing_task_is_dead_lettered_after_max_attempts(env: Env) -> None:
    import psycopg

    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.poison_log (sender text, queue text, task_id text,"
                " identity jsonb, attempts int, dead_letter_id bigint)"
            ).format(sql.Identifier(env.schema))
        )
    attempts = 3
    environ = {"PGQ_MAX_ATTEMPTS_CELERY": str(attempts), "PGQ_VISIBILITY_TIMEOUT": "1"}
    # Positional organization_id, keyword execution_id: both layouts are recovered.
    result = env.client().send_task(TASK, args=[42], kwargs={"execution_id": "exec-7"})

    for delivery in range(1, attempts + 1):
        worker = start_worker(
            env,
            f"solo{delivery}",
            pool="solo",
            concurrency=1,
            app=APP,
            environ=environ,
            may_exit=True,
        )
        wait_for(lambda d=delivery: len(env.runs()) >= d, 30, f"delivery {delivery}")
        assert worker.proc.wait(30) != 0  # os._exit(1) took the worker down
    # One more worker: its claim finds the message past max_attempts.
    last = start_worker(env, "solo-last", pool="solo", concurrency=1, app=APP, environ=environ)
    try:
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.poison_log"), 30, "the poison hook"
        )
    finally:
        last.stop()

    assert len(env.runs()) == attempts  # never delivered again
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0
    dead = env.scalar(
        "SELECT json_build_object('id', id, 'task_id', task_id, 'task_name', task_name,"
        " 'identity', identity, 'read_ct', read_ct, 'hooks', hooks) FROM {schema}.dead_letter"
    )
    assert dead["task_id"] == result.id and dead["task_name"] == TASK
    assert dead["identity"] == {"organization_id": 42, "execution_id": "exec-7"}
    assert dead["read_ct"] == attempts
    outcomes = {h["receiver"].rsplit(".", 1)[-1]: h["ok"] for h in dead["hooks"]}
    assert outcomes == {"mark_pipeline_failed": True, "flaky_hook": False}
    told = env.scalar(
        "SELECT json_build_object('sender', sender, 'task_id', task_id, 'identity', identity,"
        " 'attempts', attempts, 'dead_letter_id', dead_letter_id) FROM {schema}.poison_log"
    )
    assert told == {
        "sender": TASK,
        "task_id": result.id,
        "identity": {"organization_id": 42, "execution_id": "exec-7"},
        "attempts": attempts,
        "dead_letter_id": dead["id"],
    }


def test_an_undecodable_body_is_dead_lettered_not_dropped(env: Env) -> None:
    from kombu import Connection, Producer

    from tests.acceptance.harness import workers

    with Connection(env.broker_url, transport_options={"schema": env.schema}) as conn:
        Producer(conn).publish(
            "{not json",
            routing_key="celery",
            serializer=None,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "tests.acceptance.app.mark", "id": "bad-body", "lang": "py"},
        )
    with workers(env, "decoder", concurrency=1):
        # Celery logs "Can't decode message body" and acks it: pgq keeps it instead.
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.dead_letter"),
            30,
            "the undecodable message in dead_letter",
        )
    assert env.runs() == []
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0
    reason = env.scalar("SELECT reason FROM {schema}.dead_letter")
    assert reason.startswith("undecodable body: DecodeError")
    assert env.scalar("SELECT task_id FROM {schema}.dead_letter") == "bad-body"


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_dead_letters_every_row_it_cannot_run_and_goes_on(env: Env, pool: str) -> None:
    """Rows no pgq publisher writes (random JSON shapes, wrong types, NUL escapes, a
    payload nested past Python's recursion limit, one over max_message_bytes) in the
    queue of a real worker, before and after real tasks: the worker runs the tasks, keeps
    every bad row in dead_letter with a reason, and is still running."""
    import psycopg

    from tests.integration.test_trust import hostile_rows

    shapes = hostile_rows()
    client = env.client()
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        insert = sql.SQL(
            "INSERT INTO {}.message (queue, payload) VALUES ('celery', %s::json)"
        ).format(sql.Identifier(env.schema))
        client.send_task("tests.acceptance.app.mark", args=["first"])
        for _, text in shapes:
            conn.execute(insert, [text])
        client.send_task("tests.acceptance.app.mark", args=["last"])
    worker = start_worker(
        env, f"fuzz-{pool}", pool=pool, concurrency=2, environ={"PGQ_MAX_MESSAGE_BYTES": "4096"}
    )
    try:
        wait_for(
            lambda: sorted(r[1] for r in env.runs()) == ["first", "last"], 60, "both real tasks"
        )
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0,
            60,
            "every row to leave the queue",
        )
        client.send_task("tests.acceptance.app.mark", args=["after"])
        wait_for(lambda: len(env.runs()) == 3, 30, "a task sent after them")
        assert worker.proc.poll() is None, "the worker stopped"
    finally:
        worker.stop()
    assert env.scalar("SELECT count(*) FROM {schema}.dead_letter") == len(shapes), (
        "every bad row is kept: none lost, none run"
    )
    assert env.scalar("SELECT count(*) FROM {schema}.dead_letter WHERE reason = ''") == 0
