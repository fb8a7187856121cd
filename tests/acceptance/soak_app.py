"""A Celery app for restart and chaos runs: its task records every run, whatever happens.

Configured by environment like ``tests.acceptance.app`` (PGQ_BROKER_URL, PGQ_SCHEMA,
TEST_PG_URL, TEST_ACKS_LATE, TEST_PREFETCH, TEST_QUEUE). The difference is the
recording: ``app.mark`` writes on one shared connection and fails the task when that
connection was cut (a server restart), which would lose the proof that the task ran.
Here each thread has its own recording connection, a dead one is replaced and the
INSERT retried until the server is back; the INSERT is keyed by a run id generated
once per run, so a retry after a lost commit answer cannot record one run twice.

Each run records the task id, its run id, the worker's node name (unique per worker
incarnation: the chaos run starts every replacement under a new name), the pid, and
the server's clock time. The recording session is named ``soak-record:<pid>``, not
``pgq:<pid>``: terminating a worker's pgq sessions leaves the evidence alone.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

app = Celery("soak", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.task_default_queue = os.environ.get("TEST_QUEUE", "celery")
app.conf.update(
    task_acks_late=os.environ.get("TEST_ACKS_LATE", "1") == "1",
    worker_prefetch_multiplier=int(os.environ.get("TEST_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,  # a restart or a chaos run must not end a worker
    worker_hijack_root_logger=False,
    task_default_priority=None,
)

MARK = "tests.acceptance.soak_app.mark"
# How long a run keeps trying to record itself while the server is away.
RECORD_PATIENCE = 120.0

_local = threading.local()


def _connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(
            os.environ["TEST_PG_URL"],
            autocommit=True,
            connect_timeout=5,
            application_name=f"soak-record:{os.getpid()}",
        )
        _local.conn = conn
    return conn


def _drop_connection() -> None:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    _local.conn = None
    if conn is not None and not conn.closed:
        conn.close()


def record(task_id: str, label: str, node: str, redelivered: bool) -> None:
    """Insert one run; retried on a fresh connection until the server answers."""
    query = sql.SQL(
        "INSERT INTO {}.task_runs (task_id, run_id, label, pid, node, redelivered)"
        " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (run_id) DO NOTHING"
    ).format(sql.Identifier(os.environ["PGQ_SCHEMA"]))
    params = [task_id, uuid.uuid4(), label, os.getpid(), node, redelivered]
    for attempt in Retrying(
        retry=retry_if_exception_type((psycopg.OperationalError, psycopg.InterfaceError)),
        wait=wait_fixed(0.2),
        stop=stop_after_delay(RECORD_PATIENCE),
        before_sleep=lambda _state: _drop_connection(),
        reraise=True,
    ):
        with attempt:
            _connection().execute(query, params)


@app.task(bind=True)
def mark(self: Any, label: str = "", seconds: float = 0.0) -> str:
    """Record this run, then work for ``seconds`` (a window for a kill to land in)."""
    info = self.request.delivery_info or {}
    record(self.request.id, label, self.request.hostname or "", bool(info.get("redelivered")))
    if seconds:
        time.sleep(seconds)
    return label


def prepare_runs(pg_url: str, schema: str) -> None:
    """Add the columns this app records to the ``task_runs`` of ``harness.prepare``,
    and the table where chaos drivers record what they did."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "ALTER TABLE {runs} ADD COLUMN run_id uuid UNIQUE,"
                " ADD COLUMN node text, ADD COLUMN redelivered boolean;"
                " CREATE TABLE {events} (seq bigserial PRIMARY KEY, kind text NOT NULL,"
                " node text NOT NULL, pid integer, detail text,"
                " at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(
                runs=sql.Identifier(schema, "task_runs"),
                events=sql.Identifier(schema, "chaos_events"),
            )
        )
