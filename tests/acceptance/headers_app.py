"""The acceptance app, with one task whose request raises after the worker's pool took a
slot for it: what any exception Celery raises there would do."""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request

from tests.acceptance.app import app, record

__all__ = ["app"]


class RaisingRequest(Request):  # type: ignore[misc]
    """Celery calls ``revoked()`` when it hands the request to the pool, after the
    prefork pool's slot is taken."""

    def revoked(self) -> bool:
        raise RuntimeError("raised after the pool slot was taken")


@app.task(bind=True, Request=RaisingRequest)
def cannot_run(self: Any, label: str = "") -> None:
    record(self.request.id, label)  # never: its request raises first
