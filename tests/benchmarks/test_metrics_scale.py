"""What `pgq status` / `pgq metrics` and the autoscaling queries cost at 1,000,000 messages.

Deselected by default (``pytest -m benchmark tests/benchmarks/test_metrics_scale.py -s``).
One ``INSERT … SELECT generate_series`` fills a test schema's ``message`` table with a
backlog over three queues (ready, in flight, delayed), then each query is timed (median
of several runs) and explained. It prints one JSON document, to compare run with run:

- ``status``: the status query as shipped (ops/status.sql), with its EXPLAIN summary;
- ``autoscaling``: the per-queue depth and age queries of docs/monitoring.md, and the
  exact oldest-ready age (status's figure) of one queue for comparison;
- ``proposal``: that exact age and a per-queue status query after adding the index
  proposed for schema.sql, ``message (queue, visible_at) INCLUDE (read_ct)`` — built
  here in the throwaway schema only — and what it costs a lease-renewal UPDATE.

The figures must be right at that size; the timings are reported, and only the bounded
queries (depth, and age with the index) are held to a bound.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.ops.status import collect
from pg_transport.sql import load_named
from pg_transport.store import Store
from tests.integration.test_docs import autoscaling_queries, for_queue

pytestmark = pytest.mark.benchmark

ROWS = 1_000_000
RUNS = 5

# 70% default, 20% callback, 10% orchestrator; about 2.4% in flight (claimed, lease
# running), 2.7% delayed an hour; the others ready for up to 1000 s. expected() below
# applies the same rules.
FILL = """
INSERT INTO {schema}.message (queue, priority, visible_at, read_ct, payload)
SELECT CASE WHEN g %% 10 < 7 THEN 'default' WHEN g %% 10 < 9 THEN 'callback'
            ELSE 'orchestrator' END,
       (g %% 3)::smallint,
       CASE WHEN g %% 41 = 1 OR g %% 37 = 0 THEN now() + interval '1 hour'
            ELSE now() - make_interval(secs => g / 1000.0) END,
       CASE WHEN g %% 41 = 1 THEN 1 ELSE 0 END,
       '{{}}'::json
FROM generate_series(1, %(rows)s) AS g
"""

# The index proposed for pg_transport/sql/schema.sql (a new migration), and the
# per-queue status query it makes cheap where status.sql's GROUP BY reads every row.
PROPOSED_INDEX = (
    "CREATE INDEX message_ready_idx ON {schema}.message (queue, visible_at) INCLUDE (read_ct)"
)
PROPOSED_STATUS = """
WITH RECURSIVE mq AS (
    (SELECT queue FROM {schema}.message ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT m.queue FROM {schema}.message AS m WHERE m.queue > mq.queue
            ORDER BY m.queue LIMIT 1)
    FROM mq WHERE mq.queue IS NOT NULL
), names AS (
    SELECT name AS queue FROM {schema}.queue
    UNION SELECT queue FROM mq WHERE queue IS NOT NULL
    UNION SELECT DISTINCT queue FROM {schema}.dead_letter
)
SELECT names.queue, r.ready, f.in_flight, f.delayed, d.dead,
       extract(epoch FROM now() - r.oldest)::float8
FROM names
CROSS JOIN LATERAL (
    SELECT count(*) AS ready, min(m.visible_at) AS oldest FROM {schema}.message AS m
    WHERE m.queue = names.queue AND m.visible_at <= now()) AS r
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE m.read_ct > 0) AS in_flight,
           count(*) FILTER (WHERE m.read_ct = 0) AS delayed
    FROM {schema}.message AS m WHERE m.queue = names.queue AND m.visible_at > now()) AS f
CROSS JOIN LATERAL (
    SELECT count(*) AS dead FROM {schema}.dead_letter AS d WHERE d.queue = names.queue) AS d
ORDER BY names.queue
"""
# A lease renewal of 10,000 in-flight messages (the renew query's shape): it moves
# visible_at, which the proposed index covers, so it can no longer be a HOT update.
# The exact figure of pgq_queue_oldest_ready_age_seconds, for one queue.
OLDEST_READY = """
SELECT extract(epoch FROM now() - min(visible_at))::float8 FROM {schema}.message
WHERE queue = {queue} AND visible_at <= now()
"""
RENEW_10K = """
UPDATE {schema}.message SET visible_at = now() + make_interval(secs => 3600)
WHERE id IN (SELECT id FROM {schema}.message
             WHERE queue = 'default' AND read_ct = 1 LIMIT 10000)
"""
HOT_COUNTS = """
SELECT pg_stat_get_xact_tuples_updated(%(table)s::regclass),
       pg_stat_get_xact_tuples_hot_updated(%(table)s::regclass)
"""


def expected(rows: int) -> dict[str, tuple[int, int, int]]:
    """queue: (ready, in flight, delayed), by FILL's rules."""
    counts: dict[str, list[int]] = {}
    for g in range(1, rows + 1):
        queue = "default" if g % 10 < 7 else "callback" if g % 10 < 9 else "orchestrator"
        state = 1 if g % 41 == 1 else 2 if g % 37 == 0 else 0
        counts.setdefault(queue, [0, 0, 0])[state] += 1
    return {q: (c[0], c[1], c[2]) for q, c in sorted(counts.items())}


def timed(run: Callable[[], Any], runs: int = RUNS) -> tuple[float, Any]:
    """Median seconds of ``runs`` runs (after one warm-up), and the last result."""
    result = run()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        result = run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples), result


def fetch_one(conn: psycopg.Connection[Any], query: sql.Composed) -> Any:
    return conn.execute(query).fetchone()


def explain(conn: psycopg.Connection[Any], query: Any) -> dict[str, Any]:
    """The plan's total time, node types, and whether it reads the whole table."""
    text = query if isinstance(query, str) else query.as_string(conn)
    (plan,) = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text).fetchone() or [None]
    top = plan[0]
    nodes: list[str] = []
    workers: list[int] = []

    def walk(node: dict[str, Any]) -> None:
        workers.append(int(node.get("Workers Launched", 0)))
        label = node["Node Type"]
        if "Relation Name" in node:
            label += f" on {node['Relation Name']}"
        if "Index Name" in node:
            label += f" using {node['Index Name']}"
        nodes.append(label)
        for child in node.get("Plans", []):
            walk(child)

    walk(top["Plan"])
    return {
        "execution_ms": round(top["Execution Time"], 2),
        "full_scan_of_message": any(n.endswith("Seq Scan on message") for n in nodes),
        "parallel_workers": max(workers),
        "nodes": list(dict.fromkeys(nodes)),
    }


@pytest.fixture
def filled(pg_url: str, schema: str) -> Iterator[Store]:
    connector = Connector(pg_url)
    ensure_schema(connector, schema, auto_migrate=True)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(sql.SQL(FILL).format(schema=sql.Identifier(schema)), {"rows": ROWS})
        print(f"\ninserted {ROWS} rows in {time.perf_counter() - started:.1f}s")
        # What autovacuum does to a table this size soon after: statistics, and the
        # visibility map that lets index-only scans skip the heap.
        conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(sql.Identifier(schema)))
    yield Store(connector, schema)
    connector.close()


def test_status_and_autoscaling_queries_at_one_million_messages(
    filled: Store, pg_url: str, schema: str
) -> None:
    report: dict[str, Any] = {"rows": ROWS}
    want = expected(ROWS)  # here, not at import: collection must stay quick
    status_sql = load_named("status.sql", schema, "pg_transport.ops")["status_queues"]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # -- as shipped: pgq status / pgq metrics --
        seconds, status = timed(lambda: collect(filled))
        figures = {q.queue: (q.ready, q.in_flight, q.delayed) for q in status.queues}
        assert figures == want
        report["status"] = {
            "median_ms": round(seconds * 1000, 1),
            "explain": explain(conn, status_sql),
        }

        # -- docs/monitoring.md's autoscaling queries, per queue --
        queries = autoscaling_queries()
        autoscaling: dict[str, Any] = {}
        for queue, (ready, _, _) in want.items():
            for kind in ("depth", "age"):
                query = for_queue(queries[kind], schema, queue)
                seconds, row = timed(partial(fetch_one, conn, query))
                if kind == "depth":
                    assert row == (min(ready, 10_000),)
                else:
                    assert row is not None and 0 <= row[0] <= 1000  # FILL's oldest: 1000 s
                autoscaling[f"{kind}:{queue}"] = {
                    "median_ms": round(seconds * 1000, 2),
                    "explain": explain(conn, query),
                }
            oldest = sql.SQL(OLDEST_READY).format(
                schema=sql.Identifier(schema), queue=sql.Literal(queue)
            )
            seconds, row = timed(partial(fetch_one, conn, oldest))
            assert row is not None and 990 < row[0] < 1100
            autoscaling[f"oldest_ready_exact:{queue}"] = {
                "median_ms": round(seconds * 1000, 2),
                "explain": explain(conn, oldest),
            }
        report["autoscaling"] = autoscaling

        # -- the proposal: an index on (queue, visible_at) --
        ident = {"schema": sql.Identifier(schema)}
        renew = sql.SQL(RENEW_10K).format(**ident)
        table = f'"{schema}".message'

        def renew_once() -> float:
            """The share of HOT updates (counters pending in this backend, so a ratio)."""
            with conn.transaction():
                conn.execute(renew)
                row = conn.execute(HOT_COUNTS, {"table": table}).fetchone()
            assert row is not None and row[0] > 0
            return round(int(row[1]) / int(row[0]), 2)

        renew_before, hot_before = timed(renew_once, runs=3)
        conn.execute(sql.SQL("VACUUM {schema}.message").format(**ident))
        started = time.perf_counter()
        conn.execute(sql.SQL(PROPOSED_INDEX).format(**ident))
        build = time.perf_counter() - started
        conn.execute(sql.SQL("VACUUM ANALYZE {schema}.message").format(**ident))
        renew_after, hot_after = timed(renew_once, runs=3)
        proposal: dict[str, Any] = {
            "index": PROPOSED_INDEX.format(schema=schema),
            "build_s": round(build, 1),
            "renew_10k_rows": {
                "without_index": {"ms": round(renew_before * 1000, 1), "hot_share": hot_before},
                "with_index": {"ms": round(renew_after * 1000, 1), "hot_share": hot_after},
            },
        }
        query = sql.SQL(OLDEST_READY).format(**ident, queue=sql.Literal("default"))
        seconds, _ = timed(lambda: conn.execute(query).fetchone())
        age_plan = explain(conn, query)
        proposal["oldest_ready_exact:default"] = {
            "median_ms": round(seconds * 1000, 2),
            "explain": age_plan,
        }
        rewritten = sql.SQL(PROPOSED_STATUS).format(**ident)
        seconds, rows = timed(lambda: conn.execute(rewritten).fetchall())
        assert {r[0]: (r[1], r[2], r[3]) for r in rows} == want
        proposal["status_per_queue"] = {
            "median_ms": round(seconds * 1000, 1),
            "explain": explain(conn, rewritten),
        }
        report["proposal"] = proposal

    print(json.dumps(report, indent=2))
    # Bounded at any backlog: at most 10,000 rows for depth, one claim's walk for age,
    # and one index probe for the exact oldest age once the proposed index exists.
    for queue in want:
        for kind in ("depth", "age"):
            assert report["autoscaling"][f"{kind}:{queue}"]["median_ms"] < 200, (kind, queue)
    assert proposal["oldest_ready_exact:default"]["median_ms"] < 50
    assert not age_plan["full_scan_of_message"]
