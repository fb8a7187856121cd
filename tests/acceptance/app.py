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
    control_queue_expires=float(os.environ.get("TEST_CONTROL_EXPIRES", "10")),
    worker_enable_remote_control=os.environ.get("TEST_REMOTE_CONTROL", "1") == "1",
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


@app.task(bind=True)
def find_order(self, label: str) -> bool:
    """Whether the order row the task is about exists when the task runs (the
    transactional-enqueue tests: tests/acceptance/test_transactional.py)."""
    found = (
        _db()
        .execute(
            sql.SQL("SELECT 1 FROM {}.orders WHERE label = %s").format(
                sql.Identifier(os.environ["PGQ_SCHEMA"])
            ),
            [label],
        )
        .fetchone()
        is not None
    )
    record(self.request.id, f"{'found' if found else 'missing'}:{label}")
    return found


# -- barrier (tests/acceptance/test_barrier*.py) ------------------------------
from psycopg.types.json import Json  # noqa: E402

from barrier import barrier_callback, current_connection  # noqa: E402  (connects the hooks)


def _effects_table() -> sql.Composed:
    return sql.SQL("{}.barrier_effects").format(sql.Identifier(os.environ["PGQ_SCHEMA"]))


@app.task(bind=True)
def barrier_part(self, label: str, index: int, seconds: float = 0.0) -> dict:
    record(self.request.id, f"part:{label}:{index}")
    if seconds:
        time.sleep(seconds)
    return {"label": label, "index": index}


@app.task(bind=True, max_retries=3)
def barrier_flaky_part(self, label: str, index: int) -> dict:
    # Fails its first run and retries: the retry must still count for the barrier.
    record(self.request.id, f"flaky-part:{label}:{index}:{self.request.retries}")
    if self.request.retries < 1:
        raise self.retry(countdown=0)
    return {"label": label, "index": index}


@app.task(bind=True)
def barrier_failing_part(self, label: str, index: int) -> None:
    record(self.request.id, f"failing-part:{label}:{index}")
    raise ValueError(f"part {index} of {label} fails")


@app.task(bind=True)
@barrier_callback
def barrier_collect(self, results: list, label: str, seconds: float = 0.0, **kwargs) -> int:
    # Every start is recorded outside the callback's transaction; the side effect
    # is written through it, so it commits exactly when the barrier completes.
    first_run = (
        not _db()
        .execute(
            sql.SQL("SELECT 1 FROM {} WHERE task_id = %s LIMIT 1").format(runs_table()),
            [self.request.id],
        )
        .fetchone()
    )
    record(self.request.id, f"callback-start:{label}")
    conn = current_connection() or _db()
    conn.execute(
        sql.SQL("INSERT INTO {} (label, results, pid) VALUES (%s, %s, %s)").format(
            _effects_table()
        ),
        [label, Json(results), os.getpid()],
    )
    if seconds and first_run:
        time.sleep(seconds)  # the test kills this worker here, after the side effect
    return len(results)


@app.task(bind=True)
def barrier_errback(self, info: dict, label: str) -> None:
    record(self.request.id, f"errback:{label}:{info['status']}:{info['reason']}")
