"""``pgq demo`` end to end: the real console script, a real Celery worker, real Postgres."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.publish.publisher import Publisher
from pg_transport.store import Store
from tests.pg import drop_schema, new_schema_name

pytestmark = pytest.mark.acceptance

# The demo promises "well under a minute"; the subprocess gets more before it is killed.
BUDGET = 60.0


def run_demo(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = Path(sys.executable).parent / "pgq"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pg_transport.ops.cli"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    environ.update(env)
    started = time.monotonic()
    result = subprocess.run(
        [*command, "demo", *args],
        capture_output=True,
        text=True,
        timeout=2 * BUDGET,
        env=environ,
        cwd="/",
    )
    return result, time.monotonic() - started


def assert_story(result: subprocess.CompletedProcess[str], elapsed: float) -> None:
    out = result.stdout
    assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{result.stderr}"
    assert "Traceback" not in out + result.stderr
    assert elapsed < BUDGET, f"the demo took {elapsed:.1f} s"
    assert "queue 'pgq-demo' holds 3 messages" in out
    # Published while no worker ran, the priority-9 task is the first one run.
    assert "it drained the queue, highest priority first:" in out
    assert re.search(r"1st\s+add\(20, 22\) = 42\s+priority 9", out), out
    for call in (
        "add(1, 2) = 3",
        "add(2, 3) = 5",
        "add(5, 5) = 10",
        "add(6, 7) = 13",
        "add(100, -1) = 99",
    ):
        assert call in out
    assert len(re.findall(r"sent -> running in the worker: [\d.]+ m?s", out)) == 3
    assert "Worker stopped (warm shutdown, exit code 0)." in out
    assert "queue 'pgq-demo' is empty: every message was acked" in out
    assert re.search(r"demo OK: 6 tasks, each ran exactly once, in [\d.]+ s", out)


def schema_exists(pg_url: str, schema: str) -> bool:
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [schema])
        return row.fetchone() == (1,)


@pytest.fixture
def decoy(pg_url: str) -> Iterator[Store]:
    """A migrated schema holding a waiting message in the demo's own queue name."""
    name = new_schema_name()
    connector = Connector(pg_url)
    ensure_schema(connector, name, auto_migrate=True)
    store = Store(connector, name)
    Publisher(connector, name).publish(
        "pgq-demo", {"body": "not the demo's", "properties": {}, "headers": {}}
    )
    yield store
    connector.close()
    drop_schema(pg_url, name)


def test_demo_on_a_given_server(pg_url: str, broker_url: str, schema: str, decoy: Store) -> None:
    # PGQ_SCHEMA names a real schema: the demo must neither publish into it nor drain it.
    result, elapsed = run_demo("--url", broker_url, "--schema", schema, PGQ_SCHEMA=decoy.schema)
    assert_story(result, elapsed)
    assert f"dropped schema {schema!r}" in result.stdout
    assert not schema_exists(pg_url, schema)
    assert decoy.size("pgq-demo") == 1


def test_demo_with_an_embedded_postgres() -> None:
    pytest.importorskip("pgserver", reason="pgq demo without --url needs pgq[embedded]")
    result, elapsed = run_demo()
    assert_story(result, elapsed)
    assert re.search(r"postgres\s+PostgreSQL \S+ \(embedded, started in [\d.]+ s\)", result.stdout)
    assert "stopped the embedded Postgres" in result.stdout
    match = re.search(r"schema\s+'(pgq_demo_[0-9a-f]+)'", result.stdout)
    assert match and f"dropped schema {match.group(1)!r}" in result.stdout
