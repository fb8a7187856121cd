"""A task pgq dead-letters ends FAILED in the app's result backend (pgq's or Redis's):
``.get()`` raises at once instead of waiting for ever, and ``pgq dead requeue`` makes it
PENDING again."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery, states
from celery.exceptions import Reject

from pg_transport.results.errors import DeadLettered
from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for, workers

# The sessions a test holds at most (side by side, the run's meter: 10); a test may say
# otherwise.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(11)]


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


APP = "tests.acceptance.results_app"
T = "tests.acceptance.results_app."
REDIS = "redis://127.0.0.1:6379/0"


def client(env: Env, backend: str | None = None) -> Celery:
    url = backend or env.broker_url
    app = Celery("client", broker=env.broker_url, backend=url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": env.schema}
    return app


def raised_at(result: Any, box: dict[str, Any]) -> threading.Thread:
    """A thread waiting on ``result``; it records what get() raised, and when."""

    def wait() -> None:
        try:
            box["value"] = result.get(timeout=60)
        except Exception as exc:
            box["error"], box["at"] = exc, datetime.now(timezone.utc)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def dead_at(env: Env) -> tuple[int, datetime]:
    row = env.scalar("SELECT json_build_array(id, dead_at) FROM {schema}.dead_letter")
    return int(row[0]), datetime.fromisoformat(row[1])


def redis_available() -> bool:
    try:
        import redis

        redis.Redis.from_url(REDIS, socket_connect_timeout=1).ping()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("backend", ["pgq", "redis"])
def test_a_rejected_task_fails_within_a_second(env: Env, backend: str) -> None:
    if backend == "redis" and not redis_available():
        pytest.skip("no Redis on 127.0.0.1:6379")
    url = REDIS if backend == "redis" else None
    app = client(env, url)
    environ = {"TEST_RESULT_BACKEND": url} if url else {}
    with workers(env, f"rej-{backend}", app=APP, environ=environ):
        result = app.send_task(T + "reject")
        box: dict[str, Any] = {}
        waiter = raised_at(result, box)
        waiter.join(60)
        wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.dead_letter"), 10, "a row")
        dead_id, dead = dead_at(env)
        # Celery stores the task's own Reject first (REJECTED, a ready state); the
        # dead-lettering then ends it as FAILURE, naming the dead letter.
        error = box.get("error")
        assert isinstance(error, Exception) and (box["at"] - dead).total_seconds() < 1.0, box

        def final() -> Any:
            meta = app.backend.get_task_meta(result.id, cache=False)
            return meta if isinstance(meta["result"], DeadLettered) else None

        meta = wait_for(final, 10, "the result to name its dead letter")
    assert meta["status"] == states.FAILURE
    assert "rejected without requeue" in str(meta["result"])
    assert f"dead letter {dead_id}" in str(meta["result"])


def test_a_poisoned_task_fails_within_a_second_and_requeue_makes_it_pending(env: Env) -> None:
    app = client(env)
    environ = {"PGQ_MAX_ATTEMPTS_CELERY": "1", "PGQ_VISIBILITY_TIMEOUT": "1"}
    result = app.send_task(T + "die")
    box: dict[str, Any] = {}
    waiter = raised_at(result, box)
    first = start_worker(
        env, "die-1", pool="solo", concurrency=1, app=APP, environ=environ, may_exit=True
    )
    wait_for(lambda: len(env.runs()) == 1, 30, "the task's one delivery")
    assert first.proc.wait(30) != 0  # the task took its worker down
    # The next worker's claim finds it past max_attempts: dead-lettered, never run again.
    second = start_worker(env, "die-2", pool="solo", concurrency=1, app=APP, environ=environ)
    try:
        waiter.join(60)
    finally:
        second.stop()
    dead_id, dead = dead_at(env)
    error = box.get("error")
    assert isinstance(error, DeadLettered), box
    assert f"dead letter {dead_id}" in str(error) and "max_attempts" in str(error)
    assert (box["at"] - dead).total_seconds() < 1.0
    assert len(env.runs()) == 1

    from click.testing import CliRunner

    from pg_transport.ops.cli import main

    out = CliRunner().invoke(
        main, ["dead", "requeue", str(dead_id), "--url", env.broker_url, "--schema", env.schema]
    )
    assert out.exit_code == 0, out.output
    assert client(env).AsyncResult(result.id).state == states.PENDING


def test_an_undecodable_task_fails(env: Env) -> None:
    from kombu import Connection, Producer

    app = client(env)
    with Connection(env.broker_url, transport_options={"schema": env.schema}) as conn:
        Producer(conn).publish(
            "{not json",
            routing_key="celery",
            serializer=None,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": T + "echo", "id": "bad-body", "lang": "py"},
        )
    started = time.monotonic()
    with (
        workers(env, "undecodable", app=APP, concurrency=1),
        pytest.raises(DeadLettered, match="undecodable body"),
    ):
        app.AsyncResult("bad-body").get(timeout=30)
    assert time.monotonic() - started < 30
    assert env.runs() == []


def test_a_dead_lettered_link_error_runs_once(env: Env) -> None:
    app = client(env)
    errback = app.signature(T + "on_error", kwargs={"label": "rejected"})
    with workers(env, "link", app=APP):
        result = app.send_task(T + "reject", link_error=errback)
        with pytest.raises((Reject, DeadLettered)):
            result.get(timeout=30)
        wait_for(lambda: [r for r in env.runs() if r[1] == "errback:rejected"], 30, "the errback")
        time.sleep(1.0)  # anything more it would run comes within this second
    assert [r[1] for r in env.runs()].count("errback:rejected") == 1


def test_a_dead_lettered_task_is_a_failed_task_to_monitors(env: Env) -> None:
    """A worker sending task events (-E, what Flower reads) sends task-failed for a task
    it dead-letters (here: larger than the worker's max_message_bytes)."""
    app = client(env)
    failed: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"task-failed": failed.append}, app=app)

        def capture() -> None:
            for _ in receiver.itercapture(limit=None, timeout=30, wakeup=False):
                if failed:
                    return

        thread = threading.Thread(target=capture, daemon=True)
        thread.start()
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.binding WHERE exchange = 'celeryev'"),
            30,
            "the event receiver's queue",
        )
        environ = {"PGQ_MAX_MESSAGE_BYTES": "4096"}
        with workers(env, "events", app=APP, args=("-E",), environ=environ):
            result = app.send_task(T + "echo", args=["x" * 10_000])
            with pytest.raises(DeadLettered, match="exceeds max_message_bytes 4096"):
                result.get(timeout=30)
            thread.join(30)
    assert [e["uuid"] for e in failed] == [result.id]
    assert "DeadLettered" in failed[0]["exception"]
