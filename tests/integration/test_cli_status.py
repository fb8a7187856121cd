"""`pgq status` against a real Postgres: queue depths by state, dead letters, clients."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from pg_transport.db.pool import mask_url
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.integration.test_cli import UNREACHABLE, invoke, run_pgq
from tests.pg import metered_database, to_broker_url


def message(n: int) -> dict[str, Any]:
    return {"body": f"m{n}", "properties": {}, "headers": {}}


def status(url: str, schema: str, *args: str) -> dict[str, Any]:
    result = invoke("status", "--json", "--url", url, "--schema", schema, *args)
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_counts_each_state_per_queue(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    # jobs: 1 dead, 1 in flight, 1 delayed, 2 ready (one of them deliverable for 2 minutes).
    store.publisher.publish("jobs", message(0))
    [doomed] = store.claim(["jobs"], [30.0], 1)
    assert store.dead_letter(doomed.token, "rejected") is not None
    store.publisher.publish("jobs", message(1))
    [held] = store.claim(["jobs"], [300.0], 1)
    store.publisher.publish("jobs", message(2), delay=3600)
    store.publisher.publish("jobs", message(3))
    store.publisher.publish("jobs", message(4))
    peek(
        "UPDATE {schema}.message SET visible_at = now() - interval '120 seconds'"
        " WHERE payload->>'body' = 'm3'"
    )
    # other: only a dead letter; idle: declared, empty.
    store.publisher.publish("other", message(5))
    [other] = store.claim(["other"], [30.0], 1)
    assert store.dead_letter(other.token, "rejected") is not None
    store.declare_queue("idle")

    report = status(broker_url, schema)
    assert report["schema"] == schema
    queues = {q.pop("queue"): q for q in report["queues"]}
    assert list(queues) == ["idle", "jobs", "other"]
    age = queues["jobs"].pop("oldest_ready_age_s")
    assert 120 <= age < 180
    # The delayed message falls due in an hour; the one in flight (lease of 300 s) is
    # not delayed and does not count.
    due = queues["jobs"].pop("next_due_in_s")
    assert 3500 < due <= 3600
    nothing = {"oldest_ready_age_s": None, "next_due_in_s": None}
    # No ordered message: nothing held back (test_status_ordering counts what is); no fair
    # queue (test_metrics tells fair ones apart).
    unordered = {
        "blocked_keys": 0,
        "blocked": 0,
        "oldest_blocked_age_s": None,
        "following": 0,
        "fair": False,
        # No unique task (test_flow_reads counts the keys held).
        "unique_queued": 0,
        "unique_running": 0,
    }
    assert queues == {
        "idle": {"ready": 0, "in_flight": 0, "delayed": 0, "dead": 0, **nothing, **unordered},
        "jobs": {"ready": 2, "in_flight": 1, "delayed": 1, "dead": 1, **unordered},
        "other": {"ready": 0, "in_flight": 0, "delayed": 0, "dead": 1, **nothing, **unordered},
    }
    assert report["barriers"] == []

    # A released claim is ready again; an expired lease too (its consumer died).
    assert store.release([held.token]) == 1
    jobs = next(q for q in status(broker_url, schema)["queues"] if q["queue"] == "jobs")
    assert (jobs["ready"], jobs["in_flight"], jobs["delayed"]) == (3, 0, 1)

    table = invoke("status", "--url", broker_url, "--schema", schema)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0] == f"pgq schema {schema!r} at {mask_url(broker_url)}"
    assert lines[1].split() == [
        "QUEUE",
        "READY",
        "IN",
        "FLIGHT",
        "DELAYED",
        "DEAD",
        "OLDEST",
        "READY",
        "NEXT",
        "DUE",
        "IN",
    ]
    assert lines[2].split() == ["idle", "0", "0", "0", "0", "-", "-"]
    assert lines[3].split()[:5] == ["jobs", "3", "0", "1", "1"]
    assert lines[3].split()[5] == "2m"  # "2m 0s": oldest ready for two minutes
    assert lines[3].split()[7] in ("59m", "1h")  # the delayed one falls due in an hour
    assert lines[4].split() == ["other", "0", "0", "0", "1", "-", "-"]
    assert lines[5].startswith("clients: ")


def test_queues_unused_past_their_expiry_are_not_listed(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    # The pidbox and event queues of Celery processes: x-expires 10 s and 60 s.
    for name, expires_ms in (
        ("stopped@host.celery.pidbox", 10_000),
        ("celeryev.gone", 60_000),
        ("running@host.celery.pidbox", 10_000),
    ):
        store.declare_queue(name, expires_ms=expires_ms)
        store.publisher.publish(name, message(1))
    store.declare_queue("celery")  # no expiry: listed however long it is unused
    # The first two were last used (consumed) before their expiry; nothing deletes
    # them until some consumer's maintenance runs.
    peek(
        "UPDATE {schema}.queue SET last_used = now() - interval '2 minutes'"
        " WHERE name IN ('stopped@host.celery.pidbox', 'celeryev.gone', 'celery')"
    )
    listed = [q["queue"] for q in status(broker_url, schema)["queues"]]
    assert listed == ["celery", "running@host.celery.pidbox"]
    table = invoke("status", "--url", broker_url, "--schema", schema).stdout
    assert "stopped@host" not in table and "celeryev.gone" not in table
    metrics = invoke("metrics", "--url", broker_url, "--schema", schema).stdout
    # Celery's own queues are summed by kind, never a queue label.
    assert 'pgq_celery_queue_messages{kind="control"} 1' in metrics
    assert "running@host" not in metrics
    assert "stopped@host" not in metrics and "celeryev.gone" not in metrics


def test_an_empty_schema_has_no_queues(broker_url: str, schema: str, store: Store) -> None:
    assert status(broker_url, schema)["queues"] == []
    table = invoke("status", "--url", broker_url, "--schema", schema)
    assert table.stdout.splitlines()[1] == "no queues"


@pytest.fixture
def lonely_database(pg_url: str) -> Iterator[str]:
    """A database of its own: pg_stat_activity there shows only this test's sessions."""
    name = "pgq_t_status_" + uuid.uuid4().hex[:10]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test role cannot create databases")
    metered_database(name)
    yield urlsplit(pg_url)._replace(path=f"/{name}").geturl()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_clients_are_pgq_processes_connected_to_the_database(lonely_database: str) -> None:
    url = to_broker_url(lonely_database)
    assert invoke("migrate", "--url", url).exit_code == 0
    # This command's own session is not a client.
    assert status(url, "pgq")["clients"] == {"processes": 0, "sessions": 0, "by_process": []}

    with ExitStack() as stack:

        def session(application_name: str) -> None:
            stack.enter_context(psycopg.connect(lonely_database, application_name=application_name))

        # Two worker processes (the transport names sessions pgq:<pid>), one with three
        # sessions (claims, LISTEN, lease renewal), and a session that is not pgq's.
        for name in ("pgq:900001", "pgq:900001", "pgq:900001", "pgq:900002", "psql"):
            session(name)
        clients = status(url, "pgq")["clients"]
        assert (clients["processes"], clients["sessions"]) == (2, 4)
        # Each process with its sessions, most first: what it holds of max_connections.
        assert [(p["name"], p["sessions"]) for p in clients["by_process"]] == [
            ("pgq:900001", 3),
            ("pgq:900002", 1),
        ]
        table = invoke("status", "--url", url).stdout.splitlines()
        assert table[-3] == "clients: 2 processes, 4 sessions"
        assert re.fullmatch(r"  pgq:900001 from \S+: 3 sessions, 0 active", table[-2]), table
        assert re.fullmatch(r"  pgq:900002 from \S+: 1 session, 0 active", table[-1]), table


def test_missing_schema_says_to_migrate(broker_url: str, schema: str) -> None:
    result = invoke("status", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: pgq schema {schema!r} at {mask_url(broker_url)} does not exist: "
        "run `pgq migrate` first"
    ]


def test_unreachable_server_is_one_line_without_traceback() -> None:
    result = run_pgq("status", "--json", "--url", UNREACHABLE)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: cannot connect to Postgres at {UNREACHABLE}")


def test_barriers_by_status(broker_url: str, schema: str, store: Store, peek: Peek) -> None:
    for n, state in enumerate(["armed", "armed", "fired", "completed"]):
        peek(
            "INSERT INTO {schema}.barrier (id, status, total, remaining, callback, expires_at,"
            " stuck_timeout) VALUES (%s, %s, 1, %s, '{{}}', now() + interval '1 hour',"
            " interval '1 hour')",
            f"b{n}",
            state,
            1 if state == "armed" else 0,
        )
    report = status(broker_url, schema)
    assert report["barriers"] == [
        {"status": "armed", "count": 2},
        {"status": "completed", "count": 1},
        {"status": "fired", "count": 1},
    ]
    table = invoke("status", "--url", broker_url, "--schema", schema)
    assert "barriers: 2 armed, 1 completed, 1 fired" in table.stdout
