"""A Celery app for the flow-limit acceptance tests (tests/acceptance/test_limits.py).

Every task records its run in ``<schema>.limit_runs``: its key, the worker process, when it
started and when it ended (the database's clock, one clock for every worker). The tasks'
limits are their attributes, written by each worker at its start (origin config).
Configured by environment as tests/acceptance/app.py.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

app = Celery("limits", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_priority=None,
)

TABLES = """
CREATE TABLE {schema}.limit_runs (
    seq bigserial PRIMARY KEY, task text NOT NULL, key text, pid integer NOT NULL,
    started timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz);
"""

_local = threading.local()


def _db() -> psycopg.Connection[Any]:
    """This thread's session (a threads pool runs tasks in several at once)."""
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        conn = psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def _run(task: str, key: str | None, seconds: float) -> None:
    schema = sql.Identifier(os.environ["PGQ_SCHEMA"])
    row = (
        _db()
        .execute(
            sql.SQL(
                "INSERT INTO {}.limit_runs (task, key, pid) VALUES (%s, %s, %s) RETURNING seq"
            ).format(schema),
            [task, key, os.getpid()],
        )
        .fetchone()
    )
    assert row is not None
    if seconds:
        time.sleep(seconds)
    _db().execute(
        sql.SQL("UPDATE {}.limit_runs SET ended = clock_timestamp() WHERE seq = %s").format(schema),
        [row[0]],
    )


@app.task(concurrency_key="customer_id", concurrency_limit=2)
def per_customer(customer_id: str, seconds: float) -> None:
    """At most 2 of a customer at once, across the fleet."""
    _run("per_customer", customer_id, seconds)


@app.task(pgq_rate_limit="5/s")
def paced() -> None:
    """At most 5 starts a second across the fleet (burst 1)."""
    _run("paced", None, 0.0)


@app.task
def capped(seconds: float) -> None:
    """No limit of its own: its queue's concurrency (queue:celery) caps it."""
    _run("capped", None, seconds)
