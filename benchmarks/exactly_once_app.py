"""The tasks of ``python -m benchmarks.exactly_once``: each increments one counter row and
inserts one audit row. ``atomic_bump`` does it in its atomic run's transaction
(``pg_transport.AtomicTask``); ``plain_bump`` in a transaction of its own, committed
before Celery acks (``acks_late``), as tasks do on any broker.

Configured by environment: BENCH_BROKER (a pgq:// or redis:// URL), BENCH_PG_URL (the
database of the counter), BENCH_TABLES (the schema of ``counter`` and ``audit``),
PGQ_SCHEMA (pgq's), BENCH_VT (the visibility timeout, seconds, on either broker).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

import pg_transport

BROKER = os.environ.get("BENCH_BROKER", "pgq://")
VT = float(os.environ.get("BENCH_VT", "5"))
TABLES = os.environ.get("BENCH_TABLES", "bench")

app = Celery("exactly_once", broker=BROKER)
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    broker_transport_options={"visibility_timeout": VT},
    task_ignore_result=True,
)
if BROKER.startswith("pgq"):
    app.conf.result_backend = BROKER

BUMP = sql.SQL("UPDATE {}.counter SET n = n + 1 WHERE id = 1").format(sql.Identifier(TABLES))
AUDIT = sql.SQL("INSERT INTO {}.audit (i) VALUES (%s)").format(sql.Identifier(TABLES))

_local = threading.local()


def _plain_conn() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or conn.broken or getattr(_local, "pid", 0) != os.getpid():
        conn = psycopg.connect(
            os.environ["BENCH_PG_URL"], application_name=f"bench-plain:{os.getpid()}"
        )
        _local.conn, _local.pid = conn, os.getpid()
    return conn


if BROKER.startswith("pgq"):  # (a worker on another broker refuses atomic tasks)

    @app.task(bind=True, base=pg_transport.AtomicTask, ignore_result=True)
    def atomic_bump(self: Any, i: int) -> None:
        conn = self.transaction.connection
        conn.execute(BUMP)
        conn.execute(AUDIT, [i])


# A terminated session fails the run: retried, as an application on any broker would.
@app.task(
    ignore_result=True,
    autoretry_for=(psycopg.OperationalError,),
    retry_backoff=False,
    default_retry_delay=0,
    max_retries=None,
)
def plain_bump(i: int) -> None:
    conn = _plain_conn()
    with conn.transaction():
        conn.execute(BUMP)
        conn.execute(AUDIT, [i])
