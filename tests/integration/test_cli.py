"""The pgq command against a real Postgres: migrate, purge, and errors at the boundary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from pg_transport.db.migrate import latest_version
from pg_transport.db.pool import mask_url
from pg_transport.ops.cli import main
from pg_transport.sql import load_migrations
from pg_transport.store import Store
from tests.integration.conftest import Peek

UNREACHABLE = "pgq://postgres@127.0.0.1:1/test"
# Tables are what migrating creates: compared with a schema built from schema.sql.
QUEUE_TABLES = {"schema_version", "queue", "message", "dead_letter"}


def pgq_command() -> list[str]:
    """The installed console script, else the module (a checkout without scripts)."""
    script = Path(sys.executable).parent / "pgq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pg_transport.ops.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(extra)
    return env


def run_pgq(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*pgq_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**env),
    )


def invoke(*args: str, **env: str) -> Result:
    unset: dict[str, str | None] = {"PGQ_URL": None, "PGQ_SCHEMA": None}
    return CliRunner(env={**unset, **env}).invoke(main, list(args))


def tables(pg_url: str, schema: str) -> set[str]:
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", [schema]
        ).fetchall()
    return {r[0] for r in rows}


def message(n: int) -> dict[str, Any]:
    return {"body": f"m{n}", "properties": {}, "headers": {}}


def test_migrate_creates_then_reports_up_to_date(pg_url: str, broker_url: str, schema: str) -> None:
    first = invoke("migrate", "--url", broker_url, "--schema", schema)
    assert first.exit_code == 0, first.output
    assert f"pgq schema {schema!r}" in first.stdout
    names = ", ".join(m.name for m in load_migrations())
    count = len(load_migrations())
    assert f"applied {count} migration{'s' if count > 1 else ''} ({names})" in first.stdout
    assert f"now at version {latest_version()}" in first.stdout
    assert tables(pg_url, schema) >= QUEUE_TABLES

    again = invoke("migrate", "--url", broker_url, "--schema", schema)
    assert again.exit_code == 0, again.output
    assert f"is up to date (version {latest_version()})" in again.stdout
    assert "applied" not in again.stdout
    assert tables(pg_url, schema) >= QUEUE_TABLES


def test_url_and_schema_come_from_the_environment(
    pg_url: str, broker_url: str, schema: str
) -> None:
    result = invoke("migrate", PGQ_URL=broker_url, PGQ_SCHEMA=schema)
    assert result.exit_code == 0, result.output
    assert f"pgq schema {schema!r}" in result.stdout
    assert tables(pg_url, schema) >= QUEUE_TABLES


def test_purge_deletes_waiting_messages_and_prints_the_count(
    broker_url: str,
    schema: str,
    store: Store,  # the store fixture migrates the schema
) -> None:
    store.declare_queue("jobs")  # as a worker or a producer does
    for n in range(4):
        store.publisher.publish("jobs", message(n))
    store.publisher.publish("jobs", message(9), delay=3600)  # delayed: still waiting, so purged
    store.publisher.publish("other", message(5))
    [held] = store.claim(["jobs"], [30.0], 1)  # in flight: its worker keeps it

    result = invoke("purge", "jobs", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "4 waiting messages purged from queue 'jobs'"
    assert store.size("other") == 1
    assert store.ack([held.token]) == 1

    again = invoke("purge", "jobs", "--url", broker_url, "--schema", schema)
    assert again.stdout.strip() == "0 waiting messages purged from queue 'jobs'"


def test_purge_of_a_queue_that_does_not_exist_fails_naming_it(
    broker_url: str, schema: str, store: Store
) -> None:
    store.declare_queue("jobs")
    store.publisher.publish("jobs", message(1))
    result = invoke("purge", "jbos", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 1
    assert "no queue 'jbos'" in result.output
    assert "nothing was purged" in result.output
    assert store.size("jobs") == 1


def test_demo_help_says_what_happens_without_a_url() -> None:
    result = invoke("demo", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "embedded Postgres" in text
    assert "libpq's defaults" not in text  # what every other command does without one


def test_purge_of_a_missing_schema_says_to_migrate(broker_url: str, schema: str) -> None:
    result = run_pgq("purge", "jobs", "--url", broker_url, "--schema", schema)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: pgq schema {schema!r} at {mask_url(broker_url)} does not exist: "
        "run `pgq migrate` first"
    ]


@pytest.mark.parametrize("command", [["migrate"], ["purge", "jobs"], ["demo"]])
def test_unreachable_server_is_one_line_without_traceback(command: list[str]) -> None:
    result = run_pgq(*command, "--url", UNREACHABLE)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: cannot connect to Postgres at {UNREACHABLE}")


def test_malformed_url_is_one_line_without_traceback() -> None:
    result = run_pgq("migrate", "--url", "pgq://host:port-is-not-a-number/db")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("Error: ")


def test_demo_refuses_a_schema_that_exists(pg_url: str, broker_url: str, schema: str) -> None:
    # The demo drops its schema at the end: it must never adopt one it did not create.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(psycopg.sql.Identifier(schema)))
    result = run_pgq("demo", "--url", broker_url, "--schema", schema)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: schema {schema!r} already exists; the demo drops its schema at the end, "
        "so give it a new name with --schema (or leave --schema out)"
    ]
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [schema])
        assert row.fetchone() == (1,)


# -- values from rows, printed -------------------------------------------------------
# What someone able to write rows could put in them for an operator's terminal: colour,
# carriage return and backspace (overwrite what was printed), a bidi override.
HOSTILE = "x\x1b[31mred\rover\x08\u202eevil"
SHOWN = "x\\x1b[31mred\\rover\\x08\\u202eevil"


def raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on, but the line feeds between output lines."""
    return [c for c in text if c != "\n" and unicodedata.category(c) in {"Cc", "Cf", "Zl", "Zp"}]


def hostile_rows(store: Store, peek: Peek) -> None:
    """A queue, a dead letter and a barrier whose every text field is HOSTILE."""
    store.publisher.publish(HOSTILE, message(0))
    store.publisher.publish(HOSTILE, message(1))
    [claimed] = store.claim([HOSTILE], [30.0], 1)
    dead_id = store.dead_letter(claimed.token, HOSTILE)
    assert dead_id is not None
    store.identify_dead_letter(
        dead_id, task_id=HOSTILE, task_name=HOSTILE, identity={HOSTILE: HOSTILE}, reasons=[]
    )
    callback = json.dumps({"task": HOSTILE, "options": {"task_id": HOSTILE}})
    peek(
        "INSERT INTO {schema}.barrier (id, total, remaining, callback, metadata, reason,"
        " expires_at, stuck_timeout) VALUES (%s, 2, 1, %s, %s, %s, now() + interval '1 hour',"
        " interval '1 hour')",
        HOSTILE,
        callback,
        json.dumps({HOSTILE: HOSTILE}),
        HOSTILE,
    )
    peek(
        "INSERT INTO {schema}.barrier_part (barrier_id, idx, task_id, outcome)"
        " VALUES (%s, 0, %s, 'succeeded')",
        HOSTILE,
        HOSTILE,
    )


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["dead", "list"],
        ["barrier", "show", HOSTILE],
        ["dead", "list", "--queue", "nothing-here" + HOSTILE],
        ["purge", HOSTILE],
        ["dead", "requeue", "--all"],
    ],
)
def test_row_values_are_escaped_in_human_output(
    broker_url: str, schema: str, store: Store, peek: Peek, command: list[str]
) -> None:
    hostile_rows(store, peek)
    result = invoke(*command, "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    assert raw_controls(result.stdout) == []
    assert SHOWN in result.stdout


@pytest.mark.parametrize("command", [["status"], ["dead", "list"], ["barrier", "show", HOSTILE]])
def test_json_output_escapes_them_and_keeps_them_exact(
    broker_url: str, schema: str, store: Store, peek: Peek, command: list[str]
) -> None:
    hostile_rows(store, peek)
    result = invoke(*command, "--json", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    assert raw_controls(result.stdout) == [] and result.stdout.isascii()
    found = json.loads(result.stdout)
    if command == ["status"]:
        assert HOSTILE in [q["queue"] for q in found["queues"]]
    elif command == ["dead", "list"]:
        [row] = found["dead_letters"]
        assert (row["queue"], row["task_name"], row["reason"]) == (HOSTILE,) * 3
        assert row["identity"] == {HOSTILE: HOSTILE}
    else:
        assert (found["id"], found["reason"], found["callback"]["task"]) == (HOSTILE,) * 3
        assert found["parts"][0]["task_id"] == HOSTILE
