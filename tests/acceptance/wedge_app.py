"""The acceptance app with the pgq heartbeat, in a worker whose pool never starts a task
(``TEST_WEDGE=1``): every slot of the prefork pool's semaphore is taken at start and
never given back, as an exception raised after Celery took a slot did before pgq's
delivery guard."""

from __future__ import annotations

import os
from typing import Any

from celery import bootsteps

from pg_transport.ops import health
from tests.acceptance.app import app

__all__ = ["app"]


class Wedge(bootsteps.StartStopStep):  # type: ignore[misc]
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        semaphore = c.controller.semaphore
        if os.environ.get("TEST_WEDGE") == "1" and semaphore is not None:
            while semaphore.value > 0:
                semaphore.acquire(lambda: None)


health.install(app)
app.steps["consumer"].add(Wedge)
