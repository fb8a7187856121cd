"""What the ordering figures cost `pgq status`: its queries against an earlier commit's.

    python -m benchmarks.status_ordering --rows 1000000 --against bd8fc5c

Fills a throwaway schema with the backlog of tests/benchmarks/test_metrics_scale.py
(ready, in flight, delayed over three queues), adds 1,000 messages parked behind 200
ordering keys and 100 parked followers, then times, interleaved, with JIT on and off:
status_queues as of ``--against`` (read with ``git show``), status_queues and
status_blocked as they are now. Medians of ``--runs`` runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.sql import load_named
from pg_transport.sql.loader import compose, parse_named
from tests.benchmarks.test_metrics_scale import FILL
from tests.pg import find_postgres

PARKED = """
INSERT INTO {schema}.message (queue, priority, payload, okey, visible_at, due_at, enqueued_at)
SELECT 'default', n %% 3, '{{}}', 'k' || n %% 200, 'infinity', now(),
       now() - interval '1 minute'
FROM generate_series(1, 1000) AS n
"""
FOLLOWERS = """
INSERT INTO {schema}.message (queue, payload, follows, follow_until, visible_at, due_at)
SELECT 'default', '{{}}', 't', now() + interval '5 minutes', now() + interval '5 minutes', now()
FROM generate_series(1, 100)
"""


def earlier_status_queues(commit: str, schema: str) -> str:
    # status.sql moved from sql/ to ops/; an earlier commit may have it at either place.
    for path in ("pg_transport/ops/status.sql", "pg_transport/sql/status.sql"):
        shown = subprocess.run(
            ["git", "show", f"{commit}:{path}"], check=False, capture_output=True, text=True
        )
        if shown.returncode == 0:
            text = shown.stdout
            break
    else:
        raise SystemExit(f"no status.sql at {commit}")
    return compose(parse_named(text)["status_queues"], schema).as_string(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--against", default="main")
    args = parser.parse_args()
    url = find_postgres()
    schema = "pgq_bench_status_" + uuid.uuid4().hex[:8]
    connector = Connector(url)
    ensure_schema(connector, schema, auto_migrate=True)
    now = load_named("status.sql", schema, "pg_transport.ops")
    queries = {
        f"status_queues ({args.against})": earlier_status_queues(args.against, schema),
        "status_queues": now["status_queues"],
        "status_blocked": now["status_blocked"],
    }
    ident = {"schema": sql.Identifier(schema)}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL(FILL).format(**ident), {"rows": args.rows})
            conn.execute(sql.SQL(PARKED).format(**ident), {})
            conn.execute(sql.SQL(FOLLOWERS).format(**ident))
            conn.execute(sql.SQL("VACUUM ANALYZE {schema}.message").format(**ident))
            samples: dict[tuple[str, str], list[float]] = {
                (name, jit): [] for name in queries for jit in ("on", "off")
            }
            for query in queries.values():
                conn.execute(query).fetchall()
            for _ in range(args.runs):
                for (name, jit), found in samples.items():
                    conn.execute(sql.SQL("SET jit TO {}").format(sql.Identifier(jit)))
                    started = time.perf_counter()
                    conn.execute(queries[name]).fetchall()
                    found.append(time.perf_counter() - started)
            conn.execute("RESET jit")
            blocked: list[Any] = conn.execute(now["status_blocked"]).fetchall()
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {schema} CASCADE").format(**ident))
        connector.close()
    print(f"{args.rows} messages; blocked: {blocked}")
    for (name, jit), found in samples.items():
        print(
            f"{name:<28} jit {jit:<3}  median {statistics.median(found) * 1000:7.1f} ms"
            f"  (min {min(found) * 1000:.1f}, max {max(found) * 1000:.1f})"
        )


if __name__ == "__main__":
    main()
