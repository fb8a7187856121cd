"""A Celery app for the ordering acceptance tests (tests/acceptance/test_ordering.py).

Every task records its run in ``<schema>.ordering_runs``: its key and number in the key,
the attempt (Celery's retries), the worker process, when it started and when it ended
(the database's clock, one clock for every worker) and the ordering headers it was
delivered with. ``follows_missing`` signals are recorded in ``<schema>.ordering_signals``
by a receiver connected here, in the worker's main process where pgq sends them.
Configured by environment as tests/acceptance/app.py; queue ``relaxed`` is a relaxed
ordering queue, every other one strict.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from celery.exceptions import Reject
from psycopg import sql

from pg_transport import signals

app = Celery("ordering", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=int(os.environ.get("TEST_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_priority=None,
    broker_transport_options={"queue_ordering": {"relaxed": "relaxed"}},
)

TABLES = """
CREATE TABLE {schema}.ordering_runs (
    seq bigserial PRIMARY KEY, task text NOT NULL, task_id text NOT NULL, okey text,
    n integer, attempt integer NOT NULL, pid integer NOT NULL, queue text,
    header_key text, missing text,
    started timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz);
CREATE TABLE {schema}.ordering_signals (
    sender text, queue text, task_id text, follows text, pid integer,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
"""

_local = threading.local()


def _db() -> psycopg.Connection[Any]:
    """This thread's session (a threads pool runs tasks in several at once)."""
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        conn = psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def _exec(query: str, *params: Any) -> Any:
    text = sql.SQL(query).format(schema=sql.Identifier(os.environ["PGQ_SCHEMA"]))
    return _db().execute(text, params)


def _header(task: Any, name: str) -> Any:
    """A message header as the task sees it (Celery puts them on the request)."""
    headers = getattr(task.request, "headers", None)
    if isinstance(headers, dict) and name in headers:
        return headers[name]
    return getattr(task.request, name, None)


def _start(task: Any, key: str | None, n: int | None) -> int:
    row = _exec(
        "INSERT INTO {schema}.ordering_runs (task, task_id, okey, n, attempt, pid, queue,"
        " header_key, missing) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING seq",
        task.name.rsplit(".", 1)[-1],
        task.request.id,
        key,
        n,
        task.request.retries,
        os.getpid(),
        (task.request.delivery_info or {}).get("routing_key"),
        _header(task, "pgq-ordering-key"),
        _header(task, "pgq-follows-missing"),
    ).fetchone()
    return int(row[0])


def _end(seq: int) -> None:
    _exec("UPDATE {schema}.ordering_runs SET ended = clock_timestamp() WHERE seq = %s", seq)


@app.task(bind=True)
def step(self: Any, key: str | None, n: int | None, seconds: float = 0.0) -> None:
    seq = _start(self, key, n)
    if seconds:
        time.sleep(seconds)
    _end(seq)


@app.task(bind=True)
def stall(self: Any, key: str, n: int, seconds: float) -> None:
    """Sleeps on its first delivery only (a test kills its worker then)."""
    first = (
        _exec("SELECT 1 FROM {schema}.ordering_runs WHERE task_id = %s", self.request.id).fetchone()
        is None
    )
    seq = _start(self, key, n)
    if first:
        time.sleep(seconds)
    _end(seq)


@app.task(bind=True, max_retries=3)
def retry_first(self: Any, key: str, n: int) -> None:
    """Number 1 asks for a retry on its first attempt."""
    seq = _start(self, key, n)
    _end(seq)
    if n == 1 and self.request.retries == 0:
        raise self.retry(countdown=0.2)


@app.task(bind=True, acks_on_failure_or_timeout=False)
def fail_first(self: Any, key: str, n: int) -> None:
    """Number 1 fails: its message is rejected without requeue (dead-lettered)."""
    seq = _start(self, key, n)
    _end(seq)
    if n == 1:
        raise ValueError(f"{key}:{n} fails")


@app.task(bind=True)
def requeue_first(self: Any, key: str, n: int) -> None:
    """Number 1 gives its message back every time, until max_attempts ends it."""
    seq = _start(self, key, n)
    _end(seq)
    if n == 1:
        raise Reject(f"{key}:{n} again", requeue=True)


# shared=False: only this app knows it, so the default key is found through this app,
# not through Celery's fallback app, in a thread that made no app of its own.
@app.task(bind=True, ordering_key="customer", shared=False)
def customer_step(self: Any, customer: str, n: int) -> None:
    seq = _start(self, customer, n)
    time.sleep(0.01)
    _end(seq)


@signals.follows_missing.connect
def record_follows_missing(sender: str, queue: str, task_id: str, follows: str, **_: Any) -> None:
    _exec(
        "INSERT INTO {schema}.ordering_signals (sender, queue, task_id, follows, pid)"
        " VALUES (%s, %s, %s, %s, %s)",
        sender,
        queue,
        task_id,
        follows,
        os.getpid(),
    )
