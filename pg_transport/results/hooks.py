"""The result side's Celery signal wiring, connected once by ``import pg_transport``:

* a task a pgq worker dead-letters ends FAILURE in whichever result backend its app uses
  (:mod:`pg_transport.results.deadletters`; Redis, a database or pgq's);
* a worker whose result backend is pgq's reaps expired results in that backend's
  database and schema while it runs (:class:`pg_transport.results.expiry.Reaper`).

The broker knows nothing of results: these hooks hang on Celery's and pgq's signals.
"""

from __future__ import annotations

import threading
from typing import Any

from celery import signals

from pg_transport.results import deadletters
from pg_transport.results.expiry import Reaper

__all__ = ["connect"]

# The reaper of this process's worker (one worker per process).
_reaper: dict[str, Reaper] = {}
_lock = threading.Lock()


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    from pg_transport.results.backend import PgqBackend  # a worker's: Celery is loaded

    backend = app.backend
    if not isinstance(backend, PgqBackend):
        return
    with _lock:
        running = _reaper.get("worker")
        if running is not None and running.is_alive():
            return
        reaper = _reaper["worker"] = Reaper(backend.connector, backend.schema)
        reaper.start()


def _on_worker_shutdown(**_: Any) -> None:
    with _lock:
        reaper = _reaper.pop("worker", None)
    if reaper is not None:
        reaper.stop()


def connect() -> None:
    """Connect the receivers (idempotent)."""
    deadletters.connect()
    signals.worker_ready.connect(
        _on_worker_ready, weak=False, dispatch_uid="pgq.results.reaper_start"
    )
    signals.worker_shutdown.connect(
        _on_worker_shutdown, weak=False, dispatch_uid="pgq.results.reaper_stop"
    )
