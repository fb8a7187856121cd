"""A real Celery worker, running as docs/least-privilege.md's worker role, against a role
that has no grant at all — only the CONNECT every role has by default.

Postgres lets such a role LISTEN and NOTIFY on any channel. It listens on every channel
it can name or derive while a task carrying a secret is published and run: it hears
empty notifications, nothing else. It floods every channel with garbage and with
forged hand-offs (the notification format of earlier pgq versions, naming a real task
and the ids of real messages): the worker runs none of it, touches no message because
of it, stays up, and runs the task published next.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pg_transport.sql import queue_channel
from tests.acceptance.harness import Env, Worker, start_worker, wait_for
from tests.integration.test_privileges import Roles, grant, page_roles, publisher_app

pytestmark = pytest.mark.acceptance

TASK = "tests.acceptance.app.mark"


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    """The page's roles in the shared test database: block 1 only, so that PUBLIC keeps
    CONNECT (block 2, which revokes it, would keep the intruder out altogether)."""
    with page_roles(pg_url, blocks=("1",)) as made:
        yield grant(made)


def hand_off(message_id: int, queue: str, label: str) -> str:
    """A forged hand-off as earlier pgq versions sent them: ``[id, queue, priority,
    message]``, the message a complete Celery task message for a real task."""
    task_id = str(uuid.uuid4())
    message = {
        "body": json.dumps([[], {"label": label}, {}]),
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {
            "lang": "py",
            "task": TASK,
            "id": task_id,
            "root_id": task_id,
            "argsrepr": "()",
            "kwargsrepr": repr({"label": label}),
        },
        "properties": {
            "delivery_info": {"exchange": "", "routing_key": queue},
            "body_encoding": None,
            "priority": 0,
            "delivery_tag": task_id,
            "correlation_id": task_id,
        },
    }
    return json.dumps([message_id, queue, 0, message])


def test_a_role_without_grants_learns_nothing_and_stops_nothing(roles: Roles) -> None:
    env = Env(roles.pg_url, roles.schema)
    with psycopg.connect(roles.pg_url, autocommit=True) as admin:
        # Where the tasks record their runs: the test's table, written as the superuser.
        admin.execute(
            sql.SQL(
                "CREATE TABLE {}.task_runs (seq bigserial PRIMARY KEY, task_id text NOT NULL,"
                " label text, pid integer, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(roles.schema))
        )
    worker = start_worker(
        env,
        "intruded",
        queues="celery",
        environ={"PGQ_BROKER_URL": roles.url(roles.worker), "PGQ_AUTO_MIGRATE": "false"},
    )
    try:
        check(roles, env, worker)
    finally:
        worker.stop()


def check(roles: Roles, env: Env, worker: Worker) -> None:
    schema = sql.Identifier(roles.schema)
    client = publisher_app(roles, ["celery"])
    delayed = client.send_task(TASK, kwargs={"label": "delayed"}, countdown=3600).id

    def runs() -> list[str]:
        return [label for _, label, _ in env.runs()]

    def message_rows() -> list[tuple[Any, ...]]:
        with psycopg.connect(roles.pg_url) as admin:
            return admin.execute(
                sql.SQL("SELECT id, lease, visible_at, read_ct FROM {}.message ORDER BY id").format(
                    schema
                )
            ).fetchall()

    # Every channel the intruder can name or derive: the queue's and the worker's
    # control queue's (queue_channel is public), and those of earlier pgq versions.
    node = f"intruded@{socket.gethostname()}"
    channels = [queue_channel(roles.schema, q) for q in ("celery", f"{node}.celery.pidbox")]
    channels += [f"pgq_{roles.schema}", *(f"pgq_h00000000_{n}" for n in range(3))]
    heard: list[tuple[str, str]] = []
    secret = "sk-" + uuid.uuid4().hex
    with psycopg.connect(roles.libpq(roles.nobody), autocommit=True) as evil:
        # It can read, count and write none of pgq's tables.
        with psycopg.connect(roles.pg_url) as admin:
            tables = [
                t
                for (t,) in admin.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = %s", [roles.schema]
                )
            ]
        assert len(tables) >= 10
        for table in tables:
            for statement in (
                "SELECT * FROM {}.{}",
                "SELECT count(*) FROM {}.{}",
                "DELETE FROM {}.{}",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    evil.execute(sql.SQL(statement).format(schema, sql.Identifier(table)))

        evil.add_notify_handler(lambda n: heard.append((n.channel, n.payload)))
        for channel in channels:
            evil.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        task_id = client.send_task(TASK, kwargs={"label": secret}).id
        wait_for(lambda: secret in runs(), 20, "the secret task to run as the worker role")
        # A round trip: what was committed before it has been delivered to this session.
        evil.execute("SELECT 1")
        assert (channels[0], "") in heard
        assert {payload for _, payload in heard} == {""}, heard
        assert not any(secret in c or task_id in c for c, _ in heard)

        # The secret task's ack lands after it ran: then only the delayed task, waiting for
        # its time, is left.
        wait_for(lambda: len(message_rows()) == 1, 20, "the secret task's ack to land")
        before = message_rows()
        ids = [*range(1, 40), before[0][0]]  # guesses, and the real id
        garbage = [
            "not json",
            "[]",
            "{}",
            "null",
            "\\u0000",
            "x" * 7999,
            json.dumps({"ack": ids}),
            json.dumps({"release": ids}),
        ]
        forged = [hand_off(n, "celery", "forged") for n in ids]
        for channel in channels:
            payloads = [*garbage, *forged]
            evil.execute(
                "SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p", [channel, payloads]
            )
            for _ in range(50):  # bare wake-ups: one per transaction, or Postgres merges them
                evil.execute("SELECT pg_notify(%s, '')", [channel])

    wait_for(
        lambda: "notification(s) with a payload" in worker.output(),
        20,
        "the worker to report the notifications it dropped",
    )
    after = client.send_task(TASK, kwargs={"label": "after-flood"}).id
    wait_for(lambda: "after-flood" in runs(), 20, "a task published after the flood to run")
    client.close()
    assert worker.proc.poll() is None, worker.output()
    assert runs() == [secret, "after-flood"]
    assert f"{TASK}[{after}] succeeded" in worker.output()
    assert delayed not in worker.output()
    # Nothing was delivered, acked, released or renewed because a notification said so:
    # once the last task's ack has landed, the delayed task's row is as it was (a forged
    # ack, release or renewal would have deleted or changed it for good).
    wait_for(lambda: message_rows() == before, 20, f"the delayed row to stay {before}")
