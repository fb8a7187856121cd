"""Remote control, events and queue expiry across real workers: routing lives in Postgres."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for, workers

pytestmark = pytest.mark.acceptance


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


MARK = "tests.acceptance.app.mark"


@pytest.mark.sessions(15)  # the most of two runs, -n 0
def test_inspect_ping_reaches_every_worker(env: Env) -> None:
    with workers(env, "w1", "w2", "w3", concurrency=1):
        client = env.client()
        # The reply limit ends the wait once all three answered (without it, a broadcast
        # waits out its whole timeout); a worker that does not answer is still missing.
        replies = client.control.inspect(timeout=5, limit=3).ping()
        assert replies is not None
        assert sorted(name.split("@")[0] for name in replies) == ["w1", "w2", "w3"]
        assert all(reply == {"ok": "pong"} for reply in replies.values())
        stats = client.control.inspect(timeout=5, destination=[next(iter(replies))]).stats()
        assert stats and "pool" in next(iter(stats.values()))


@pytest.mark.sessions(7)  # the most of two runs, -n 0
def test_control_rate_limit_revoke_and_shutdown(env: Env) -> None:
    with workers(env, "ctl", concurrency=1) as (worker,):
        client = env.client()
        # limit=1: back as soon as the one worker answered, not after the whole timeout.
        answer = client.control.rate_limit(MARK, "10/m", reply=True, timeout=5, limit=1)
        assert answer and "rate limit set successfully" in str(answer)
        revoked = client.control.revoke("some-task-id", reply=True, timeout=5, limit=1)
        assert revoked and "revoked" in str(revoked).lower()
        client.control.shutdown(reply=False)
        assert worker.proc.wait(30) == 0


@pytest.mark.sessions(12)  # the most of two runs, -n 0
def test_killed_workers_control_queue_expires_and_stops_collecting(env: Env) -> None:
    expires = 3.0
    environ = {"TEST_CONTROL_EXPIRES": str(expires)}
    client = env.client(control_queue_expires=expires)
    doomed = start_worker(env, "doomed", concurrency=1, environ=environ)
    survivor = start_worker(env, "survivor", concurrency=1, environ=environ)
    try:
        control_queue = "doomed@%s.celery.pidbox"
        pidbox = env.scalar(
            "SELECT name FROM {schema}.queue WHERE name LIKE 'doomed@%%.celery.pidbox'"
        )
        assert pidbox, f"no control queue like {control_queue}"
        doomed.kill()
        doomed.proc.wait(10)
        for _ in range(100):
            client.control.broadcast("ping", reply=False)
        # The survivor's consumer reaps the dead worker's queue once it expires.
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.queue WHERE name = %s", pidbox) == 0,
            expires + 15,
            "the dead worker's control queue to expire",
        )
        assert env.scalar("SELECT count(*) FROM {schema}.message WHERE queue = %s", pidbox) == 0
        assert env.scalar("SELECT count(*) FROM {schema}.binding WHERE queue = %s", pidbox) == 0
        for _ in range(10):
            client.control.broadcast("ping", reply=False)
        assert env.scalar("SELECT count(*) FROM {schema}.message WHERE queue = %s", pidbox) == 0
    finally:
        survivor.stop()


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_event_receiver_sees_task_events(env: Env) -> None:
    seen: list[str] = []
    done = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        seen.append(event["type"])
        if event["type"] == "task-succeeded":
            done.set()

    client = env.client()
    with workers(env, "evented", concurrency=1, args=("-E",)), client.connection_for_read() as conn:
        receiver = client.events.Receiver(conn, handlers={"*": on_event})
        consumer = threading.Thread(
            target=receiver.capture, kwargs={"limit": None, "timeout": 30, "wakeup": False}
        )
        consumer.daemon = True
        consumer.start()
        wait_for(
            lambda: (
                "worker-online" in seen
                or "worker-heartbeat" in seen
                or env.scalar("SELECT count(*) FROM {schema}.binding WHERE exchange = 'celeryev'")
            ),
            30,
            "the event receiver to bind",
        )
        client.send_task(MARK, args=["evented"])
        assert done.wait(30), f"events seen: {seen}"
        # Stopped and joined while its connection and schema still exist: a capture
        # thread left running would meet the next test's dropped schema.
        receiver.should_stop = True
        consumer.join(10)
        assert not consumer.is_alive(), "the event receiver did not stop"
    for kind in ("task-received", "task-started", "task-succeeded"):
        assert kind in seen
