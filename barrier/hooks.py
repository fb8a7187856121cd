"""Worker-side hooks, connected when ``barrier`` is imported.

A worker imports its app module, and an app that uses barriers imports
``barrier`` (for ``@barrier_callback`` or ``Barrier``), so the hooks are in place
before the first task runs; no call is needed. They act only on apps whose broker
is pgq and only on tasks whose message carries barrier headers:

* ``task_success`` of a part: record it, count it, fire the callback (one
  transaction, see :mod:`pg_transport.fanin.state`);
* ``task_failure`` of a part (sent once the task failed for good: a pending
  retry or a requeue sends ``task_retry`` or nothing instead): fail the barrier;
* ``message_poisoned`` of a part (dead-lettered after too many deliveries: it
  never reaches ``task_failure``): fail the barrier, rather than leave it to the
  stuck sweep. It raises when it cannot, so ``pgq dead rehook`` can run it again;
* ``worker_ready`` / ``worker_shutdown``: start / stop the sweeper thread
  (``pgq_barrier_sweep_interval``, 0 disables it).

Signal receivers cannot veto the ack, so a part whose completion cannot be
recorded (Postgres unreachable beyond the retry window) is logged and left to the
stuck sweep, which expires its barrier and fires the errback.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from celery import current_app, signals

from barrier.queries import queries
from barrier.sweep import Sweeper
from pg_transport.errors import PgqError
from pg_transport.fanin import state
from pg_transport.fanin.backend import backend_for, uses_pgq
from pg_transport.fanin.codec import dumps as json_dumps
from pg_transport.fanin.protocol import HEADER_BARRIER, HEADER_PART, header
from pg_transport.fanin.settings import BarrierSettings
from pg_transport.signals import message_poisoned

__all__ = ["connect", "on_message_poisoned", "on_task_failure", "on_task_success"]

logger = logging.getLogger("barrier.hooks")

_sweepers: dict[int, Sweeper] = {}
_sweepers_lock = threading.Lock()


def part_of(task: Any) -> tuple[str, int] | None:
    """(barrier id, part index) of the task being run, from its message headers."""
    request = getattr(task, "request", None)
    barrier_id = header(request, HEADER_BARRIER)
    index = header(request, HEADER_PART)
    if not barrier_id or index is None or isinstance(index, bool):
        return None
    try:
        return str(barrier_id), int(index)
    except (TypeError, ValueError):
        return None


def on_task_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    part = part_of(sender)
    if part is None or not uses_pgq(sender.app):
        return
    barrier_id, index = part
    task_id = sender.request.id
    try:
        result_json = json_dumps(result)
    except (TypeError, ValueError) as exc:
        # A result the callback could never receive fails the barrier, loudly.
        _fail(sender, barrier_id, index, f"result is not JSON-serializable: {exc}", task_id)
        return
    try:
        db = backend_for(sender.app)
        outcome = db.run(
            lambda conn: state.part_succeeded(db, conn, barrier_id, index, result_json, task_id)
        )
    except (psycopg.Error, PgqError) as exc:
        logger.error(
            "could not record part %d of barrier %s (task %s): %s; the stuck sweep will "
            "expire the barrier",
            index,
            barrier_id,
            task_id,
            exc,
        )
        return
    logger.debug("barrier %s part %d: %s", barrier_id, index, outcome)


def on_task_failure(sender: Any = None, exception: Any = None, **_: Any) -> None:
    part = part_of(sender)
    if part is None or not uses_pgq(sender.app):
        return
    barrier_id, index = part
    _fail(sender, barrier_id, index, repr(exception), sender.request.id)


def _fail(sender: Any, barrier_id: str, index: int, error: str, task_id: str | None) -> None:
    try:
        db = backend_for(sender.app)
        outcome = db.run(
            lambda conn: state.part_failed(db, conn, barrier_id, index, error, task_id)
        )
    except (psycopg.Error, PgqError) as exc:
        logger.error(
            "could not record the failure of part %d of barrier %s: %s; the stuck sweep "
            "will expire the barrier",
            index,
            barrier_id,
            exc,
        )
        return
    logger.info("barrier %s part %d failed (%s): %s", barrier_id, index, error, outcome)


def on_message_poisoned(
    sender: Any = None, dead_letter_id: Any = None, attempts: Any = None, **_: Any
) -> None:
    # Sent by the transport, which knows no app: the worker's app is the current one.
    app = current_app._get_current_object()
    if dead_letter_id is None or not uses_pgq(app):
        return
    db = backend_for(app)
    params = {"id": dead_letter_id, "barrier_header": HEADER_BARRIER, "part_header": HEADER_PART}

    def work(conn: psycopg.Connection[Any]) -> str | None:
        row = conn.execute(queries(db.schema)["barrier_dead_letter_part"], params).fetchone()
        if row is None or row[0] is None or row[1] is None:
            return None
        barrier_id, index, task_id = row
        error = f"dead-lettered after {attempts} deliveries (dead letter {dead_letter_id})"
        return state.part_failed(db, conn, barrier_id, int(index), error, task_id)

    # Idempotent (the part row dedups it), so retried; failures propagate to the
    # transport, which records this hook as failed for `pgq dead rehook`.
    outcome = db.run(work)
    if outcome is not None:
        logger.warning("dead letter %s was a barrier part: %s", dead_letter_id, outcome)


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not uses_pgq(app):
        return
    interval = BarrierSettings.from_app(app).sweep_interval
    if interval <= 0:
        return
    with _sweepers_lock:
        if id(app) in _sweepers:
            return
        sweeper = _sweepers[id(app)] = Sweeper(app, interval)
    sweeper.start()
    logger.info("barrier sweeper started: every %ss", interval)


def on_worker_shutdown(**_: Any) -> None:
    with _sweepers_lock:
        sweepers = list(_sweepers.values())
        _sweepers.clear()
    for sweeper in sweepers:
        sweeper.stop()


def connect() -> None:
    """Connect the hooks (idempotent: dispatch_uid dedups)."""
    signals.task_success.connect(on_task_success, weak=False, dispatch_uid="pgq.barrier.success")
    signals.task_failure.connect(on_task_failure, weak=False, dispatch_uid="pgq.barrier.failure")
    message_poisoned.connect(on_message_poisoned, weak=False, dispatch_uid="pgq.barrier.poisoned")
    signals.worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="pgq.barrier.ready")
    signals.worker_shutdown.connect(
        on_worker_shutdown, weak=False, dispatch_uid="pgq.barrier.shutdown"
    )
