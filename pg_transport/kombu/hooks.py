"""Every Celery signal pgq connects, in one place (:func:`connect`, as ``pg_transport``
is imported; each receiver once, whatever the number of calls).

- ``before_task_publish``: a task's ordering and unique defaults become headers
  (:func:`pg_transport.message.ordering.task_defaults`,
  :func:`pg_transport.message.unique.task_defaults`), and a chord's header part is
  noted, so that its refusal fails its chord (:mod:`pg_transport.kombu.chord_parts`).
- ``celeryd_init``: a worker with a bad pgq setting stops with one line
  (:mod:`pg_transport.preflight`), and its sessions carry its node name
  (``application_name pgq:<pid>:worker:<node>``, from Celery's ``celeryd_init``, not
  ``worker_init``: only a process started as a worker, not one embedded in a test
  process, which goes on publishing after).
- ``import_modules``: the same check for a worker or beat, before beat's banner.
- ``worker_init``: a worker whose broker is pgq gets the delivery guard
  (:mod:`pg_transport.kombu.guard`) and backs off when the broker refuses it.
- ``worker_shutting_down``: the blocking drains of a gevent or eventlet worker end at
  once instead of at their timeout (:func:`pg_transport.kombu.transport.interrupt_drains`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from celery import signals

from pg_transport import backoff, preflight
from pg_transport.config import Options
from pg_transport.db.pool import set_process_role
from pg_transport.kombu import chord_parts
from pg_transport.message import fair, limits, ordering, unique

__all__ = ["apply_task_defaults", "connect"]

logger = logging.getLogger("pg_transport")


def _task_named(name: str) -> Any:
    """The task ``name`` as its app knows it. Celery's ``before_task_publish`` does not
    say which app sends: the current one (per thread, so a thread that made no app has
    Celery's fallback, which holds only shared tasks), then every app's registry as it
    is (a task made before its app is finalized is there; the look finalizes nothing)."""
    from celery import current_app
    from celery._state import _get_active_apps

    task = current_app.tasks.get(name)
    if task is not None:
        return task
    for app in list(_get_active_apps()):
        task = app._tasks.get(name)
        if task is not None:
            return task
    return None


def apply_task_defaults(
    sender: str | None = None,
    body: Any = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """Celery's ``before_task_publish``: the sending task's ordering and unique defaults
    as headers (:func:`pg_transport.message.ordering.task_defaults`,
    :func:`pg_transport.message.unique.task_defaults`)."""
    if headers is None or sender is None:
        return
    task = _task_named(sender)
    if task is not None:
        ordering.task_defaults(task, body, headers)
        limits.task_defaults(task, body, headers)
        unique.task_defaults(task, body, headers, properties)
        fair.task_defaults(task, body, headers, properties)
    unique.refuse_in_chord(body, headers, properties)
    chord_parts.note(body, headers, properties)


def _check_worker(sender: Any = None, instance: Any = None, **_: Any) -> None:
    if instance is not None:
        preflight.check_or_stop(instance.app)


def _check_modules(sender: Any = None, **_: Any) -> None:
    if sender is not None and hasattr(sender, "conf"):
        preflight.check_or_stop(sender)


def _name_sessions(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, str) and sender:
        set_process_role("worker", sender)


def _define_limits(app: Any) -> None:
    """Write the flow limits the app's tasks and the transport option queue_rate_limits
    define (origin config), before the worker consumes. A bad one stops the worker with
    the error naming it; a task that also sets Celery's per-worker ``rate_limit`` gets a
    warning (both would apply)."""
    found: list[limits.Limit] = []
    for name, task in sorted(app.tasks.items()):
        defined = limits.task_limits(task)
        if any(d.rate for d in defined) and getattr(task, "rate_limit", None):
            logger.warning(
                "task %s sets both rate_limit (Celery's, per worker process) and "
                "pgq_rate_limit (pgq's, across the fleet): both apply",
                name,
            )
        found += defined
    # The queues' own rates (queue_rate_limits): validated here too, so a bad one stops
    # the worker at its start, naming the option.
    options = Options.from_sources(app.conf.broker_transport_options, os.environ)
    found += options.queue_limits()
    if found:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            conn.transport.store.define_limits(found)


def _guard_worker(sender: Any = None, **_: Any) -> None:
    """Add the guard to a worker whose broker is pgq (its consumer is built after)."""
    from pg_transport.kombu.guard import DeliveryGuard
    from pg_transport.kombu.transport import Transport

    try:
        ours = issubclass(sender.app.connection_for_read().get_transport_cls(), Transport)
    except Exception:  # a broker URL kombu cannot resolve: Celery will say so
        return
    if ours:
        _define_limits(sender.app)
        sender.app.steps["consumer"].add(DeliveryGuard)
        # A worker the broker refuses backs off (not the pool's children, nor clients).
        backoff.enable()


def _end_drains(**_: Any) -> None:
    """Sent from Celery's SIGTERM/SIGINT handler: no import here (the import lock may be
    held by the code the signal interrupted); no transport module, no transport."""
    transport = sys.modules.get("pg_transport.kombu.transport")
    if transport is not None:
        transport.interrupt_drains()


def connect() -> None:
    """Connect every receiver (idempotent: each has a dispatch uid)."""
    signals.before_task_publish.connect(
        apply_task_defaults, weak=False, dispatch_uid="pgq-ordering"
    )
    signals.celeryd_init.connect(_check_worker, weak=False, dispatch_uid="pgq-preflight-worker")
    signals.import_modules.connect(_check_modules, weak=False, dispatch_uid="pgq-preflight-modules")
    signals.celeryd_init.connect(_name_sessions, weak=False, dispatch_uid="pgq-process-node")
    signals.worker_init.connect(_guard_worker, weak=False, dispatch_uid="pgq-delivery-guard")
    signals.worker_shutting_down.connect(_end_drains, weak=False, dispatch_uid="pgq-end-drains")
