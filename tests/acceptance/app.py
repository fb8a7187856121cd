"""A plain Celery app for acceptance tests: it knows nothing of pgq but its URL.

Configured by environment: PGQ_BROKER_URL (the broker), PGQ_SCHEMA (read by the
transport itself), TEST_PG_URL (where tasks record that they ran).
"""

from __future__ import annotations

import os
import time

import psycopg
from celery import Celery
from psycopg import sql

app = Celery("acceptance", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.task_default_queue = os.environ.get("TEST_QUEUE", "celery")
app.conf.update(
    task_acks_late=os.environ.get("TEST_ACKS_LATE", "1") == "1",
    worker_prefetch_multiplier=int(os.environ.get("TEST_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_priority=None,
)

_conn: psycopg.Connection | None = None


def _db() -> psycopg.Connection:
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True)
    return _conn


def runs_table() -> sql.Composed:
    return sql.SQL("{}.task_runs").format(sql.Identifier(os.environ["PGQ_SCHEMA"]))


def record(task_id: str, label: str = "") -> None:
    _db().execute(
        sql.SQL("INSERT INTO {} (task_id, label, pid) VALUES (%s, %s, %s)").format(runs_table()),
        [task_id, label, os.getpid()],
    )


@app.task(bind=True)
def mark(self, label: str = "") -> str:
    record(self.request.id, label)
    return label


@app.task(bind=True)
def slow_mark(self, label: str = "", seconds: float = 1.0) -> str:
    record(self.request.id, label)
    time.sleep(seconds)
    return label


@app.task
def noop() -> None:
    return None
