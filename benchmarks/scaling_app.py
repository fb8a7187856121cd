"""The Celery app of ``python -m benchmarks.scaling``: one no-op task, nothing recorded.

Configured by environment (PGQ_BROKER_URL, PGQ_SCHEMA, PGQ_* options). Remote control is
off, so the only broker traffic is the task queue's: what is measured is the tasks' cost.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("scaling", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    worker_enable_remote_control=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


@app.task(name="benchmarks.scaling.noop")
def noop(n: int) -> int:
    return n
