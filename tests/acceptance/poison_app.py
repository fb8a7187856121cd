"""A Celery app whose task kills its worker on every delivery, and poison hooks.

The hooks write to ``<schema>.poison_log``: one row per handler call, so the test
sees what the app was told. One handler always raises, to prove a failing hook
loses nothing and is recorded on the dead-letter row.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql
from psycopg.types.json import Json

from pg_transport import identity, signals

app = Celery("poison", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, worker_hijack_root_logger=False)

identity.register("tests.acceptance.poison_app.run_pipeline", execution_id=1, organization_id=0)


def _exec(query: str, *params: Any) -> None:
    with psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True) as conn:
        conn.execute(sql.SQL(query).format(schema=sql.Identifier(os.environ["PGQ_SCHEMA"])), params)


@app.task(bind=True)
def run_pipeline(self: Any, organization_id: int, execution_id: str, step: str = "") -> None:
    _exec(
        "INSERT INTO {schema}.task_runs (task_id, label, pid) VALUES (%s, %s, %s)",
        self.request.id,
        step,
        os.getpid(),
    )
    os._exit(1)  # the worker dies with the task, every time


@signals.message_poisoned.connect
def mark_pipeline_failed(
    sender: str,
    queue: str,
    task_id: str,
    identity: dict[str, Any],
    args: Any,
    kwargs: Any,
    attempts: int,
    dead_letter_id: int,
    **_: Any,
) -> None:
    _exec(
        "INSERT INTO {schema}.poison_log (sender, queue, task_id, identity, attempts,"
        " dead_letter_id) VALUES (%s, %s, %s, %s, %s, %s)",
        sender,
        queue,
        task_id,
        Json(identity),
        attempts,
        dead_letter_id,
    )


@signals.message_poisoned.connect
def flaky_hook(sender: str, **_: Any) -> None:
    raise RuntimeError("the status service is down")
