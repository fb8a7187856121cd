"""The Celery app of the flow-limits benchmark (``python -m benchmarks.flow_limits``).

Configured by environment (``FLOW_*``, read by :func:`app_from_env`), so the worker
subprocesses and the harness that publishes build the same app with the same limits:

* ``flow.paced``: pgq's global rate ``pgq_rate_limit`` (``FLOW_RATE``, burst ``FLOW_BURST``), across
  the fleet;
* ``flow.celery_paced``: Celery's own ``rate_limit`` at the same rate, which each worker
  applies on its own;
* ``flow.per_key``: at most ``FLOW_CONCURRENCY`` tasks of a key at once
  (``concurrency_key="key"``), across the fleet.
* ``flow.unique``: a unique task (``pg_transport.UniqueTask``, ``unique_key="key"``,
  held while queued or running) that records its start, then waits for the harness's
  gate (an advisory lock the harness holds through the publishers' race,
  ``benchmarks.unique_race``) before it ends.

Every task records its own start: one row (with its task id) in ``<FLOW_RUNS>.runs``
whose ``started`` is the database's ``clock_timestamp()`` when the task body begins
(one clock for every worker process, none of it the publisher's); ``flow.per_key``
sleeps its task time and then sets ``ended``. Each worker (named by ``FLOW_WORKER``)
records when it is ready in ``<FLOW_RUNS>.ready``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from celery import Celery, current_task, signals
from psycopg import sql

import pg_transport

__all__ = [
    "CELERY_PACED",
    "CLAIMS",
    "PACED",
    "PER_KEY",
    "TABLES",
    "UNIQUE",
    "app",
    "app_from_env",
    "make_app",
]

PACED = "flow.paced"
CELERY_PACED = "flow.celery_paced"
PER_KEY = "flow.per_key"
UNIQUE = "flow.unique"
#: The advisory lock (two int4 keys: this and the runs schema's) the harness holds while
#: its publishers race; a ``flow.unique`` task waits for it (shared) before it ends.
GATE = 47

ENV_BROKER_URL = "FLOW_BROKER_URL"
ENV_QUEUE = "FLOW_QUEUE"
ENV_TRANSPORT_OPTIONS = "FLOW_TRANSPORT_OPTIONS"
ENV_PG_URL = "FLOW_PG_URL"
ENV_RUNS = "FLOW_RUNS"
ENV_RATE = "FLOW_RATE"
ENV_BURST = "FLOW_BURST"
ENV_CONCURRENCY = "FLOW_CONCURRENCY"
ENV_WORKER = "FLOW_WORKER"
ENV_GATE = "FLOW_GATE"

TABLES = """
CREATE SCHEMA {runs};
CREATE TABLE {runs}.runs (
    seq bigserial PRIMARY KEY, task text NOT NULL, tid text, key text, worker text NOT NULL,
    pid integer NOT NULL, started timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended timestamptz);
CREATE TABLE {runs}.ready (worker text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {runs}.claims (id bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""

# Every lease the claim grants, when the claim grants it (the row trigger fires as the
# claim's UPDATE writes the row: after the gates). Added to the pgq schema by the harness
# (not pgq's): the rate's bound is on grants; a start follows its grant by the worker's lag.
CLAIMS = """
CREATE FUNCTION {runs}.claimed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {runs}.claims (id) VALUES (NEW.id);
    RETURN NULL;
END $$;
CREATE TRIGGER flow_bench_claimed AFTER UPDATE OF lease ON {schema}.message
    FOR EACH ROW WHEN (NEW.lease <> OLD.lease) EXECUTE FUNCTION {runs}.claimed();
"""

_local = threading.local()


def _db() -> psycopg.Connection[Any]:
    """This thread's session (a threads pool runs tasks in several at once; a prefork
    child must not use its parent's socket)."""
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        conn = psycopg.connect(os.environ[ENV_PG_URL], autocommit=True)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def _runs() -> sql.Identifier:
    return sql.Identifier(os.environ[ENV_RUNS])


def _start(task: str, key: str | None) -> int:
    row = (
        _db()
        .execute(
            sql.SQL("INSERT INTO {}.runs (task, tid, key, worker, pid) "
                    "VALUES (%s, %s, %s, %s, %s) RETURNING seq").format(_runs()),
            [task, current_task.request.id, key, os.environ.get(ENV_WORKER, "?"), os.getpid()],
        )
        .fetchone()
    )  # fmt: skip
    assert row is not None
    return int(row[0])


def paced() -> None:
    _start(PACED, None)


def celery_paced() -> None:
    _start(CELERY_PACED, None)


def per_key(key: str, seconds: float) -> None:
    seq = _start(PER_KEY, key)
    if seconds > 0:
        time.sleep(seconds)
    _db().execute(
        sql.SQL("UPDATE {}.runs SET ended = clock_timestamp() WHERE seq = %s").format(_runs()),
        [seq],
    )


def unique(key: str) -> None:
    _start(UNIQUE, key)
    conn = _db()
    gate = [GATE, _gate_key()]
    conn.execute("SELECT pg_advisory_lock_shared(%s::int4, %s::int4)", gate)
    conn.execute("SELECT pg_advisory_unlock_shared(%s::int4, %s::int4)", gate)


def _gate_key() -> int:
    """The gate's second key (``FLOW_GATE``, a number the harness picks per run, so two
    runs never share a gate)."""
    return int(os.environ.get(ENV_GATE, "0"))


def make_app(
    broker_url: str,
    queue: str,
    transport_options: Mapping[str, Any] | None,
    rate: str,
    concurrency: int,
    burst: int = 1,
) -> Celery:
    """The benchmark app; identical in the workers and in the publisher."""
    app = Celery("flow_limits", broker=broker_url)
    app.conf.update(
        broker_transport_options=dict(transport_options or {}),
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        task_acks_late=True,
        # A claimed message is a start (docs/flow-control.md, "Prefetch").
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )
    app.task(name=PACED, ignore_result=True, pgq_rate_limit=rate, pgq_rate_burst=burst)(paced)
    app.task(name=CELERY_PACED, ignore_result=True, rate_limit=rate)(celery_paced)
    app.task(
        name=PER_KEY,
        ignore_result=True,
        concurrency_key="key",
        concurrency_limit=concurrency,
    )(per_key)
    app.task(
        name=UNIQUE,
        base=pg_transport.UniqueTask,
        ignore_result=True,
        unique_key="key",
        unique_while="queued_or_running",
    )(unique)
    return app


def app_from_env(environ: Mapping[str, str] = os.environ) -> Celery:
    """The worker's app; ``memory://`` when imported outside a worker."""
    return make_app(
        environ.get(ENV_BROKER_URL, "memory://"),
        environ.get(ENV_QUEUE, "flow"),
        json.loads(environ.get(ENV_TRANSPORT_OPTIONS, "{}")),
        environ.get(ENV_RATE, "50/s"),
        int(environ.get(ENV_CONCURRENCY, "3")),
        int(environ.get(ENV_BURST, "1")),
    )


app = app_from_env()


def _ready(sender: Any = None, **_: Any) -> None:
    if ENV_RUNS in os.environ:
        name = os.environ.get(ENV_WORKER, "?")
        with psycopg.connect(os.environ[ENV_PG_URL], autocommit=True) as conn:
            conn.execute(
                sql.SQL("INSERT INTO {}.ready (worker) VALUES (%s)").format(_runs()), [name]
            )


signals.worker_ready.connect(_ready)
