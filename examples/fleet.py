"""The example app of the compose fleet (docker/docker-compose.yaml).

A plain Celery app: pgq is its broker and its result backend (the same URL, ``PGQ_URL``:
Postgres is the only moving part, see docs/results.md) and the heartbeat step that lets
``pgq health`` tell a consuming worker from a stuck one. Each kind of task
is routed to a queue of its own, so each queue gets workers sized for its work and a
visibility timeout tuned to it (``PGQ_VISIBILITY_TIMEOUT_<QUEUE>`` in the compose file).

Send work from any process that imports this module::

    from fleet import add, orchestrate
    add.delay(2, 3).get()      # queue "default"; 5, from Postgres
    orchestrate.delay("job-1") # queue "orchestrator"
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import Celery

from pg_transport.ops import health

logger = logging.getLogger("fleet")

app = Celery(
    "fleet",
    broker=os.environ.get("PGQ_URL") or "pgq://",
    backend=os.environ.get("PGQ_URL") or "pgq://",
)
app.conf.update(
    task_default_queue="default",
    task_routes={
        "fleet.orchestrate": {"queue": "orchestrator"},
        "fleet.callback": {"queue": "callback"},
        "fleet.tick": {"queue": "scheduler"},
    },
    # Ack after the task ran: a worker that dies mid-task leaves its message to come
    # back when the queue's visibility timeout passes, instead of losing it.
    task_acks_late=True,
    # One message per free slot: long tasks do not hoard a backlog that idle
    # replicas (compose --scale) could be running.
    worker_prefetch_multiplier=1,
    # Results in the same Postgres; the workers delete them a day after they are stored.
    result_expires=86400,
    broker_connection_retry_on_startup=True,
    # Sent by `celery -A fleet beat -S pgq` (the compose file runs two): once per slot
    # however many beats run, kept in Postgres (docs/beat.md).
    beat_schedule={"tick-every-30s": {"task": "fleet.tick", "schedule": 30.0}},
)
health.install(app)


@app.task(name="fleet.add")  # type: ignore[untyped-decorator]  # Celery is untyped
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="fleet.orchestrate")  # type: ignore[untyped-decorator]  # Celery is untyped
def orchestrate(job: str, seconds: float = 0.0) -> str:
    """A long-running coordinator: its queue's visibility timeout is long to match."""
    time.sleep(seconds)
    callback.delay(job, {"status": "done"})
    return job


@app.task(name="fleet.callback")  # type: ignore[untyped-decorator]  # Celery is untyped
def callback(job: str, result: dict[str, Any]) -> None:
    logger.info("job %s finished: %s", job, result)


@app.task(name="fleet.tick")  # type: ignore[untyped-decorator]  # Celery is untyped
def tick() -> float:
    """Periodic housekeeping, one at a time (its worker runs the solo pool)."""
    return time.time()
