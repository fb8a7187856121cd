"""The result side's Celery signal wiring, connected once by ``import pg_transport``:

* a task a pgq worker dead-letters ends FAILURE in whichever result backend its app uses
  (:mod:`pg_transport.results.deadletters`; Redis, a database or pgq's);
* a duplicate unique task's publish stores its alias to the task holding its key
  (:func:`alias_duplicate`: its ``AsyncResult`` resolves to the holder's);
* a chord whose header part the transport refused as it was sent fails
  (:func:`fail_refused_chord`, on pgq's ``chord_part_refused``);
* a worker whose result backend is pgq's reaps expired results in that backend's
  database and schema while it runs (:class:`pg_transport.results.expiry.Reaper`).

The broker knows nothing of results: these hooks hang on Celery's and pgq's signals.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals

from pg_transport.errors import NotPermitted
from pg_transport.message import unique
from pg_transport.results import deadletters
from pg_transport.results.expiry import Reaper
from pg_transport.signals import chord_part_refused

__all__ = ["alias_duplicate", "connect", "fail_refused_chord"]

logger = logging.getLogger("pg_transport.results")

# The reaper of this process's worker (one worker per process).
_reaper: dict[str, Reaper] = {}
_lock = threading.Lock()


def alias_duplicate(
    headers: dict[str, Any] | None = None, properties: dict[str, Any] | None = None, **_: Any
) -> None:
    """Celery's ``after_task_publish``: a publish that was a duplicate of a unique task
    (its key held) stores, through the sending app's pgq result backend, a stand-in
    state naming the holder, so that ``AsyncResult(id)`` resolves to the holder's result
    in any process. A role that may not store results (a publisher-only role) stores
    nothing: the duplicate resolves in the process that sent it only."""
    task_id = unique.task_id_of({"headers": headers, "properties": properties})
    if task_id is None:
        return
    holder = unique.holder_of(task_id)
    if holder is None:
        return
    from pg_transport.results.backend import calling  # a sending app's: Celery is loaded

    backend = calling(task_id)
    if backend is None:
        return
    try:
        backend.store_alias(task_id, holder)
    except NotPermitted as exc:
        logger.debug(
            "pgq: duplicate %s resolves to %s in this process only: %s", task_id, holder, exc
        )
    except Exception:  # the publish is done: its caller is not to see this fail
        logger.warning(
            "pgq: duplicate %s resolves to %s in this process only: storing its alias failed",
            task_id,
            holder,
            exc_info=True,
        )


def fail_refused_chord(
    task_id: str | None = None,
    group_id: str | None = None,
    exc: BaseException | None = None,
    **_: Any,
) -> None:
    """pgq's ``chord_part_refused``: the transport refused a part of a chord's header as
    it was sent; the pgq result backend that armed the chord (the sending app's) fails
    it, as a failed part would, so that it neither waits for good nor leaves the parts
    sent before it counting toward nothing."""
    if not task_id or not group_id or exc is None:
        return
    from celery import current_app

    from pg_transport.results.backend import PgqBackend, calling  # a sending app's

    backend = calling(task_id)
    if backend is None:  # a part whose result is ignored: Celery did not say which app
        found = current_app.backend
        if not isinstance(found, PgqBackend):
            return
        backend = found
    if not backend.chords.usable():
        return  # Celery's own chord (chord_unlock): it fails on its own
    backend.chords.refused(group_id, task_id, exc)


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
    signals.after_task_publish.connect(
        alias_duplicate, weak=False, dispatch_uid="pgq.results.alias_duplicate"
    )
    chord_part_refused.connect(
        fail_refused_chord, weak=False, dispatch_uid="pgq.results.fail_refused_chord"
    )
    signals.worker_ready.connect(
        _on_worker_ready, weak=False, dispatch_uid="pgq.results.reaper_start"
    )
    signals.worker_shutdown.connect(
        _on_worker_shutdown, weak=False, dispatch_uid="pgq.results.reaper_stop"
    )
