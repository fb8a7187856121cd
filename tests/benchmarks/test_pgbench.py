"""pgbench runs pgq's own INSERT as a publish sends it: into the schema's message table,
a fresh key each time, the payload whole, durable or not as asked."""

from __future__ import annotations

import json

import psycopg
import pytest
from psycopg import sql

from benchmarks.pgbench import find_pgbench, pgbench_script, run_pgq_insert
from pg_transport.db.migrate import migrate

PAYLOAD = json.dumps({"body": "W1tdLCB7fSwge31d", "headers": {"id": "a b", "quote": "it's"}})


@pytest.fixture
def migrated(pg_url: str, schema: str) -> str:
    if find_pgbench() is None:
        pytest.skip("pgbench not installed")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        migrate(conn, schema)
    return schema


def test_the_script_sends_the_query_with_pgbench_variables() -> None:
    script = pgbench_script("INSERT INTO t VALUES (%(queue)s, %(publish_key)s, %(payload)s)")
    lines = script.splitlines()
    assert lines[0].startswith("\\set publish_key random(1, ")
    assert lines[1] == "INSERT INTO t VALUES (:queue, :publish_key, :payload);"
    # No key to draw where the query has none.
    assert pgbench_script("SELECT %(queue)s") == "SELECT :queue;\n"


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "committed"])
def test_pgq_s_insert_runs_through_pgbench(pg_url: str, migrated: str, durable: bool) -> None:
    found = run_pgq_insert(pg_url, migrated, "bench_q", PAYLOAD, seconds=1, durable=durable)
    assert found["status"] == "ok", found
    assert found["durable"] is durable
    assert found["latency_us"] == pytest.approx(1e6 / found["tps"])
    query = sql.SQL(
        "SELECT count(*), count(DISTINCT publish_key), count(*) FILTER (WHERE payload::text = %s),"
        " count(*) FILTER (WHERE queue = 'bench_q' AND read_ct = 0) FROM {}.message"
    ).format(sql.Identifier(migrated))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        [(rows, keys, whole, queued)] = conn.execute(query, (PAYLOAD,)).fetchall()
    # One row per transaction pgbench counted (its rate is over the second it ran).
    assert rows >= found["tps"] * 0.5 and rows == keys == whole == queued


def test_a_failing_run_says_why(pg_url: str, schema: str) -> None:
    if find_pgbench() is None:
        pytest.skip("pgbench not installed")
    # The schema was never migrated: no message table to insert into.
    found = run_pgq_insert(pg_url, schema, "bench_q", PAYLOAD, seconds=1, durable=True)
    assert found["status"] == "failed"
    assert "message" in found["reason"] and "does not exist" in found["reason"]
