"""A Celery app exercising Celery features on pgq: Reject, failures, routes, beat.

Configured by environment like app.py (PGQ_BROKER_URL, PGQ_SCHEMA, TEST_PG_URL);
tasks record runs in ``<schema>.task_runs``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery
from celery.exceptions import Reject
from psycopg import sql

app = Celery("features", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=int(os.environ.get("TEST_PREFETCH", "4")),
    worker_hijack_root_logger=False,
    task_reject_on_worker_lost=os.environ.get("TEST_REJECT_ON_LOST", "0") == "1",
    task_acks_on_failure_or_timeout=os.environ.get("TEST_ACK_ON_FAILURE", "1") == "1",
    task_routes={"tests.acceptance.features_app.routed": {"queue": "reports"}},
    beat_schedule={
        "tick": {
            "task": "tests.acceptance.features_app.record",
            "schedule": 1.0,
            "args": ("tick",),
        },
    },
)


def _record(task_id: str, label: str) -> int:
    with psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True) as conn:
        table = sql.SQL("{}.task_runs").format(sql.Identifier(os.environ["PGQ_SCHEMA"]))
        conn.execute(
            sql.SQL("INSERT INTO {} (task_id, label, pid) VALUES (%s, %s, %s)").format(table),
            [task_id, label, os.getpid()],
        )
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE task_id = %s").format(table), [task_id]
        ).fetchone()
    return int(row[0]) if row else 0


@app.task(bind=True)
def record(self: Any, label: str) -> str:
    _record(self.request.id, label)
    return label


@app.task(bind=True)
def routed(self: Any, label: str) -> str:
    _record(self.request.id, f"{label}@{self.request.delivery_info.get('routing_key')}")
    return label


@app.task(bind=True)
def reject(self: Any, label: str, requeue: bool) -> None:
    runs = _record(self.request.id, label)
    if runs == 1:
        raise Reject("first delivery refused", requeue=requeue)


@app.task(bind=True)
def fail(self: Any, label: str) -> None:
    _record(self.request.id, label)
    raise RuntimeError("this task always fails")


@app.task(bind=True)
def die(self: Any, label: str) -> None:
    """Kill the process running it on the first run only (the pool child, under prefork)."""
    if _record(self.request.id, label) == 1:
        os._exit(1)


@app.task(bind=True)
def sleep(self: Any, label: str, seconds: float) -> None:
    _record(self.request.id, label)
    time.sleep(seconds)
