"""A real Celery worker, running as docs/least-privilege.md's worker role, and a role
granted only what the page gives publishers: every remote-control command that role can
send — through Celery's control client, or as one plain kombu publish that declares
nothing, to the control exchange or straight to the worker's mailbox — is refused by the
database and stored nowhere. The worker keeps running the task the commands aimed at, runs
the publisher's next task, and still answers remote control sent as the workers' role.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection, Exchange, Producer
from psycopg import sql

from pg_transport.errors import NotPermitted
from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for
from tests.integration.test_privileges import Roles, grant, options, page_roles, publisher_app

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"
SLOW = "tests.acceptance.app.slow_mark"


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    with page_roles(pg_url, blocks=("1",)) as made:
        yield grant(made)


def command(method: str, **arguments: Any) -> dict[str, Any]:
    """A remote-control message as Celery's control client sends it."""
    return {
        "method": method,
        "arguments": arguments,
        "destination": None,
        "pattern": None,
        "matcher": None,
    }


def test_a_publisher_role_cannot_stop_revoke_or_reconfigure_a_worker(roles: Roles) -> None:
    env = Env(roles.pg_url, roles.schema, extra=dict(QUICK_STOP))
    with psycopg.connect(roles.pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL(
                "CREATE TABLE {}.task_runs (seq bigserial PRIMARY KEY, task_id text NOT NULL,"
                " label text, pid integer, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(roles.schema))
        )
    worker = start_worker(
        env,
        "bounded",
        pool="prefork",  # a revoke with terminate=True would kill the running task
        concurrency=1,
        queues="celery",
        environ={"PGQ_BROKER_URL": roles.url(roles.worker), "PGQ_AUTO_MIGRATE": "false"},
    )
    mailbox = f"bounded@{socket.gethostname()}.celery.pidbox"
    client = publisher_app(roles, ["celery"])
    try:
        running = client.send_task(SLOW, kwargs={"label": "running", "seconds": 3}).id
        wait_for(lambda: "running" in [r[1] for r in env.runs()], 30, "the slow task to start")

        commands = [
            command("shutdown"),
            command("revoke", task_id=running, terminate=True, signal="SIGKILL"),
            command("pool_restart", modules=None, reload=False),
            command("rate_limit", task_name=MARK, rate_limit="1/h"),
            command("cancel_consumer", queue="celery"),
        ]
        attempts: list[Callable[[], Any]] = [
            lambda: client.control.shutdown(),
            lambda: client.control.revoke(running, terminate=True),
            lambda: client.control.pool_restart(),
            lambda: client.control.rate_limit(MARK, "1/h"),
            lambda: client.control.cancel_consumer("celery"),
        ]
        with Connection(roles.url(roles.publisher), transport_options=options(roles)) as conn:
            fanout = Exchange("celery.pidbox", "fanout", no_declare=True)
            for body in commands:
                # The attack: one publish, nothing declared, to the control
                # exchange; and the same straight to the worker's mailbox by name.
                attempts.append(lambda b=body: Producer(conn.channel(), fanout).publish(b))
                attempts.append(
                    lambda b=body: Producer(conn.channel()).publish(b, routing_key=mailbox)
                )
            for attempt in attempts:
                with pytest.raises(NotPermitted):
                    attempt()
        assert env.scalar("SELECT count(*) FROM {schema}.message WHERE queue LIKE '%%.pidbox'") == 0

        after = client.send_task(MARK, kwargs={"label": "after"}).id
        wait_for(
            lambda: f"{MARK}[{after}] succeeded" in worker.output(),
            30,
            "the publisher's next task to run",
        )
        output = worker.output()
        assert f"{SLOW}[{running}] succeeded" in output, output
        for obeyed in (
            "Got shutdown from remote",
            "flagged as revoked",
            "New rate limit",
            "Pool restart",
            "Terminating",
        ):
            assert obeyed not in output, output
        assert worker.proc.poll() is None, output
        # The workers' role still drives it: remote control works as before.
        operator = Celery("operator", broker=roles.url(roles.worker))
        operator.conf.broker_transport_options = options(roles)
        replies = operator.control.inspect(timeout=10, limit=1).ping()
        operator.close()
        assert replies and list(replies.values()) == [{"ok": "pong"}], replies
    finally:
        client.close()
        worker.stop()
    assert [label for _, label, _ in env.runs()] == ["running", "after"]
