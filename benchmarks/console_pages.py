"""Page times of ``pgq web`` with a deep backlog: 1,000,000 messages over 20 queues.

    python -m benchmarks.console_pages                       # 1,000,000 messages
    python -m benchmarks.console_pages --rows 100000 --json  # quicker

What happens:

* a fresh schema on the test Postgres (``--url``, default ``PGQ_TEST_URL`` or the local
  server) is filled with one ``INSERT … SELECT generate_series``: ``--rows`` messages
  with a Celery payload over ``--queues`` queues, about 90% ready, 5% in flight (read
  once, lease running) and 5% delayed an hour; 2,000 dead letters, 200 barriers, two
  schedule entries; then ``VACUUM ANALYZE``;
* the console's history is filled as an hour of ticks at 10 s would leave it (360 ticks
  of every queue), so the charts draw a full hour;
* a real ``pgq web`` process is started (10 s sampling); after its first tick, every page
  is fetched ``--runs`` times in a row over HTTP, and the median, p95 and max are kept;
* for comparison in the same run: what a page would cost if it counted per request, the
  query of ``pgq status`` (one GROUP BY over ``message``, the sampler's work once per
  interval), timed the same number of times.

Reported: per page, median/p95/max milliseconds and the ratio of the status query's median
to the page's; whether every page's p95 is under ``--budget-ms`` (300). Exit status 0
when it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from pg_transport.db.pool import Connector
from pg_transport.ops.status import collect
from pg_transport.store import Store
from tests.acceptance import console as web
from tests.acceptance.harness import Env, prepare, wait_for
from tests.pg import drop_schema, find_postgres, new_schema_name

PAYLOAD = {
    "body": "W1s0Ml0sIHsiZXhlY3V0aW9uX2lkIjogImV4ZWMtNyJ9LCB7fV0=",
    "content-encoding": "utf-8",
    "content-type": "application/json",
    "headers": {"lang": "py", "task": "app.tasks.work", "id": "00000000-0000-0000-0000-0"},
    "properties": {"body_encoding": "base64", "delivery_tag": "x", "priority": 0},
}

FILL = """
INSERT INTO {schema}.message (queue, priority, visible_at, read_ct, payload)
SELECT 'queue-' || pg_catalog.lpad((g %% %(queues)s)::text, 2, '0'),
       0,
       CASE WHEN g %% 20 = 1 THEN now() + interval '1 hour'
            WHEN g %% 20 = 2 THEN now() + interval '30 seconds'
            ELSE now() - make_interval(secs => (%(rows)s - g) / 1000.0) END,
       CASE WHEN g %% 20 = 2 THEN 1 ELSE 0 END,
       %(payload)s::json
FROM generate_series(1, %(rows)s) AS g
"""
DEAD = """
INSERT INTO {schema}.dead_letter (message_id, queue, read_ct, enqueued_at, reason, task_name,
                                  task_id, identity, hooks, payload)
SELECT g, 'queue-' || pg_catalog.lpad((g %% %(queues)s)::text, 2, '0'), 5, now(),
       CASE WHEN g %% 2 = 0 THEN 'delivered 5 times; max_attempts is 5' ELSE 'rejected' END,
       'app.tasks.work', 'task-' || g, '{{"execution_id": 7}}',
       '[{{"receiver": "app.hooks.mark_failed", "ok": true}}]', %(payload)s::json
FROM generate_series(1, 2000) AS g
"""
BARRIERS = """
INSERT INTO {schema}.barrier (id, status, total, remaining, callback, expires_at, stuck_timeout)
SELECT 'exec-' || g, CASE WHEN g %% 4 = 0 THEN 'completed' ELSE 'armed' END, 10,
       CASE WHEN g %% 4 = 0 THEN 0 ELSE 3 END, '{{"task": "app.tasks.aggregate"}}',
       now() + make_interval(secs => g), interval '10 minutes'
FROM generate_series(1, 200) AS g
"""
SCHEDULE = """
INSERT INTO {schema}.beat_entry (name, task, schedule, origin)
VALUES ('nightly', 'app.tasks.report', '{{"crontab": "0 3 * * *"}}', 'command'),
       ('heartbeat', 'app.tasks.ping', '{{"every": 30, "aligned": false}}', 'command')
"""
# An hour of ticks at 10 s, as the console leaves it; the figures are the table's own
# (taken once) so the charts' queries read exactly what they would.
HISTORY = """
WITH ticks AS (
    INSERT INTO {schema}.console_tick (at, taken_at, inserted, deleted)
    SELECT t, t, (extract(epoch FROM t))::bigint * 10, (extract(epoch FROM t))::bigint * 9
    FROM generate_series(date_bin('10 seconds', now(), '2000-01-01') - interval '3590 seconds',
                         date_bin('10 seconds', now(), '2000-01-01') - interval '10 seconds',
                         interval '10 seconds') AS t
    RETURNING at
)
INSERT INTO {schema}.console_sample (at, queue, ready, in_flight, delayed, dead,
                                     oldest_ready_age)
SELECT ticks.at, 'queue-' || pg_catalog.lpad(q::text, 2, '0'), 45000, 2500, 2500, 100, 900
FROM ticks CROSS JOIN generate_series(0, %(queues)s - 1) AS q
"""


def execute(env: Env, query: str, **params: Any) -> float:
    started = time.perf_counter()
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(query).format(schema=sql.Identifier(env.schema)), params)
    return time.perf_counter() - started


def timed(run: Callable[[], Any], runs: int) -> dict[str, float]:
    run()  # warm-up: connections, plans, templates
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {
        "median_ms": round(statistics.median(times), 1),
        "p95_ms": round(times[max(0, int(len(times) * 0.95) - 1)], 1),
        "max_ms": round(times[-1], 1),
    }


def fetch(url: str) -> Callable[[], None]:
    def run() -> None:
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200, url
            answer.read()

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="Postgres (default: the test server)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=20)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--budget-ms", type=float, default=300.0)
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    args = parser.parse_args(argv)

    env = prepare(args.url or find_postgres(), new_schema_name())
    report: dict[str, Any] = {"rows": args.rows, "queues": args.queues, "runs": args.runs}
    try:
        payload = json.dumps(PAYLOAD)
        report["fill_s"] = round(
            execute(env, FILL, rows=args.rows, queues=args.queues, payload=payload), 1
        )
        execute(env, DEAD, queues=args.queues, payload=payload)
        execute(env, BARRIERS)
        execute(env, SCHEDULE)
        execute(env, HISTORY, queues=args.queues)
        execute(env, "VACUUM ANALYZE {schema}.message")
        execute(env, "VACUUM ANALYZE {schema}.dead_letter")

        connector = Connector(env.pg_url, application_name="pgq-bench")
        try:
            store = Store(connector, env.schema)
            status = timed(lambda: collect(store), args.runs)
        finally:
            connector.close()
        report["status_query"] = status

        dead_id = env.scalar("SELECT max(id) FROM {schema}.dead_letter")
        pages = {
            "queues": "/queues",
            "queue": "/queue?name=queue-07",
            "dead": "/dead",
            "dead filtered": "/dead?queue=queue-04&reason=max_attempts",
            "dead letter": f"/dead/{dead_id}",
            "barriers": "/barriers",
            "barrier": "/barriers?id=exec-5",
            "schedules": "/schedules",
            "processes": "/processes",
        }
        with web.console(env, interval=10) as console:
            # The console's own first tick: its sampler's GROUP BY, once per interval.
            wait_for(
                lambda: env.scalar(
                    "SELECT count(*) FROM {schema}.console_sample"
                    " WHERE at > now() - '20 s'::interval"
                ),
                120,
                "the console's first tick",
                step=0.5,
            )
            report["pages"] = {}
            for name, path in pages.items():
                page = timed(fetch(console.url + path), args.runs)
                page["status_query_ratio"] = round(status["median_ms"] / page["median_ms"], 1)
                report["pages"][name] = page
        report["budget_ms"] = args.budget_ms
        report["passed"] = all(p["p95_ms"] < args.budget_ms for p in report["pages"].values())
    finally:
        drop_schema(env.pg_url, env.schema)

    lines = [
        f"{args.rows:,} messages over {args.queues} queues (filled in {report['fill_s']} s); "
        f"`pgq status` query median {status['median_ms']} ms",
        f"{'page':<16}{'median ms':>10}{'p95 ms':>9}{'max ms':>9}{'status/page':>13}",
    ]
    for name, page in report["pages"].items():
        lines.append(
            f"{name:<16}{page['median_ms']:>10}{page['p95_ms']:>9}{page['max_ms']:>9}"
            f"{page['status_query_ratio']:>12}x"
        )
    print("\n".join(lines), file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
