"""The acceptance app plus tasks that record the time they were due (tests/acceptance/test_due.py).

Each records its run with the eta Celery gave it as the label, so a test reads how late
it started: the run's time (the database's clock) minus that eta.
"""

from __future__ import annotations

from typing import Any

from tests.acceptance.app import app, record

__all__ = ["app"]


@app.task(bind=True)
def due(self: Any) -> None:
    record(self.request.id, str(self.request.eta))


@app.task(bind=True, max_retries=3)
def retry_once(self: Any, countdown: float) -> None:
    if self.request.retries == 0:
        record(self.request.id, "first")
        raise self.retry(countdown=countdown)
    record(self.request.id, str(self.request.eta))


@app.task(bind=True)
def lapsed(self: Any) -> None:
    record(self.request.id, "lapsed")


@app.task
def relay(hops: int) -> None:
    """Publish from inside a task (a pool child's producer), ``hops`` times down a chain."""
    if hops > 0:
        relay.delay(hops - 1)
