"""The Celery app of the result-backend benchmark (``python -m benchmarks.backends``).

Broker: pgq (``BENCH_BROKER_URL``, schema ``PGQ_SCHEMA``); result backend:
``BENCH_RESULT_BACKEND`` (pgq, Redis or Celery's ``db+postgresql``), options
``BENCH_RESULT_OPTIONS`` (JSON). The tasks stamp wall-clock times, so that a chord's body
can tell how long after its header's last task ended it started.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

BROKER = os.environ.get("BENCH_BROKER_URL", "pgq://")
BACKEND = os.environ.get("BENCH_RESULT_BACKEND", BROKER)

app = Celery("bench_backends", broker=BROKER, backend=BACKEND)
app.conf.update(
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_backend_transport_options=json.loads(os.environ.get("BENCH_RESULT_OPTIONS") or "{}"),
    database_engine_options={"pool_size": 10, "max_overflow": 10},
)


@app.task(name="bench.stamp")
def stamp() -> float:
    """When this task ended (wall clock: the body runs in another process)."""
    return time.time()


@app.task(name="bench.nap")
def nap(seconds: float) -> None:
    time.sleep(seconds)


@app.task(name="bench.gather")
def gather(ends: list[Any]) -> float:
    """Seconds from the header's last task's end to this body's start."""
    return time.time() - max(float(e) for e in ends)
