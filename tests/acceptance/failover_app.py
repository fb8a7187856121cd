"""The Celery app of the failover test: each run of a task is recorded once, durably.

Configured by environment: PGQ_BROKER_URL (a multi-host URL), PGQ_SCHEMA, and where runs
are recorded: TEST_PG_URL and TEST_RUNS_SCHEMA, a server apart from the failing one, so
that a record is never lost or held up with the broker's commits. A run is recorded
under an id of its own: a record sent again after a lost answer is still one row.
"""

from __future__ import annotations

import os
import time
import uuid

import psycopg
from celery import Celery
from psycopg import sql

app = Celery("failover", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    worker_hijack_root_logger=False,
)

RECORD = sql.SQL(
    "INSERT INTO {}.runs (run_id, task_id, n) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING"
)
_conn: psycopg.Connection | None = None


def record(task_id: str, n: int) -> None:
    global _conn
    run_id = uuid.uuid4()
    query = RECORD.format(sql.Identifier(os.environ["TEST_RUNS_SCHEMA"]))
    deadline = time.monotonic() + 60
    while True:
        try:
            if _conn is None or _conn.closed:
                _conn = psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True)
            _conn.execute(query, [run_id, task_id, n])
            return
        except psycopg.OperationalError:
            if _conn is not None:
                _conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@app.task(bind=True)
def work(self, n: int, seconds: float = 0.02) -> int:
    record(self.request.id, n)
    time.sleep(seconds)
    return n
