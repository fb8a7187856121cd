"""A task Celery took but cannot run gives its pool slot and its message back.

Celery's worker hands a received task to its pool through one callable (the consumer's
``on_task_request``). Should that raise, Celery has no way back: with the prefork pool
the raise comes after a slot of the pool's semaphore was taken, and that slot is never
given back (after ``concurrency`` such tasks the worker runs nothing more); when the pool
was busy the request ran later, from the pool's own callback, and the raise there ends
the worker (``Unrecoverable error``). Either way the message stays delivered and unacked,
its lease renewed by a worker that will never run it.

:mod:`~pg_transport.message.protocol` refuses the malformed messages known to do this
before Celery sees them. This module is the guarantee for the rest: a consumer bootstep,
added to every worker whose broker is pgq, runs each hand-over under a guard. A raise
gives the pool slot back and dead-letters the message with the exception as the reason;
the worker goes on.

The same guard does not start a task whose lease lapsed while it waited for the pool
(a prefetched task of a worker cut off from Postgres: its renewals did not land, and
another worker may be running it): it is dropped here, unacked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.worker import state

from pg_transport.kombu.qos import QoS

__all__ = ["DeliveryGuard", "drop", "guard", "lapsed", "settles"]

logger = logging.getLogger("pg_transport.guard")


def guard(consumer: Any) -> None:
    """Wrap ``consumer.on_task_request`` (before the consumer builds its strategies,
    which keep the callable they find)."""
    worker = consumer.controller
    process: Callable[[Any], Any] = consumer.on_task_request
    semaphore = getattr(worker, "semaphore", None)
    run: Callable[[Any], Any] | None = getattr(worker, "_process_task", None)
    if (
        semaphore is not None
        and run is not None
        and process == getattr(worker, "_process_task_sem", None)
    ):
        # Celery's own hand-over takes a slot, then runs the request now or when a
        # slot frees up (then inside the pool's callback): the guard must be around
        # the run itself, and give that slot back.
        sem_run: Callable[[Any], Any] = run

        def guarded_run(request: Any) -> None:
            settles(request)
            if lapsed(request):
                try:
                    drop(request)
                finally:
                    semaphore.release()
                return
            try:
                sem_run(request)
            except Exception as exc:  # any raise: the task cannot run here
                try:
                    refuse(request, exc)
                finally:
                    semaphore.release()

        def on_task_request(request: Any) -> Any:
            return semaphore.acquire(guarded_run, request)

    else:

        def on_task_request(request: Any) -> Any:
            settles(request)
            if lapsed(request):
                drop(request)
                return None
            try:
                return process(request)
            except Exception as exc:  # any raise: the task cannot run here
                refuse(request, exc)
                return None

    consumer.on_task_request = on_task_request


def _qos_of(request: Any) -> QoS | None:
    qos = getattr(getattr(getattr(request, "message", None), "channel", None), "qos", None)
    return qos if isinstance(qos, QoS) else None


def settles(request: Any) -> None:
    """A task that completes its delivery in its own transaction (``AtomicTask``, which
    says so with the class attribute ``pgq_completes_delivery``): the worker's ack of it
    becomes a settle (:meth:`QoS.settle_on_ack`). Never raises."""
    try:
        task = getattr(request, "task", None)
        qos = _qos_of(request)
        if qos is not None and getattr(task, "pgq_completes_delivery", False) is True:
            qos.settle_on_ack(request.message.delivery_tag)
    except Exception:  # a bug here must not keep a task from running
        logger.exception("pgq: could not mark an atomic task's delivery")


def lapsed(request: Any) -> bool:
    """Whether ``request``'s lease lapsed while it waited to start (no renewal landed in
    time: the worker was cut off from Postgres, or one was refused). Never raises."""
    try:
        qos = _qos_of(request)
        return qos is not None and qos.lapsed(request.message.delivery_tag)
    except Exception:  # a bug here must not keep a task from running
        logger.exception("pgq: could not check the lease of a task")
        return False


def drop(request: Any) -> None:
    """Do not start ``request``: its message is no longer this worker's (another may be
    running it). No ack: its row is left to whoever holds the lease now."""
    logger.warning(
        "pgq: task %s[%s] not started: its lease on message %s of queue %r lapsed while it "
        "waited (no renewal landed: cut off from Postgres?); the message is delivered again",
        getattr(request, "name", "?"),
        getattr(request, "id", "?"),
        request.message.delivery_tag,
        request.message.delivery_info.get("pgq_queue"),
    )
    state.task_ready(request)
    qos = _qos_of(request)
    if qos is not None:
        qos.drop(request.message.delivery_tag)
    request.acknowledged = True  # (Celery's own mark: nothing more to ack)


def refuse(request: Any, exc: BaseException) -> None:
    """Dead-letter ``request``'s message with ``exc`` as the reason; Celery forgets it.
    Never raises: it runs inside Celery's event loop."""
    try:
        _refuse(request, exc)
    except Exception:  # a bug: the worker goes on; the message stays held by it
        logger.exception("pgq: could not dead-letter a task the worker cannot run")


def _refuse(request: Any, exc: BaseException) -> None:
    logger.error(
        "pgq: task %s[%s] cannot be run by this worker: dead-lettered",
        getattr(request, "name", "?"),
        getattr(request, "id", "?"),
        exc_info=exc,
    )
    state.task_ready(request)
    reason = f"the worker could not run it: {type(exc).__name__}: {exc}"[:1000]
    message = request.message
    qos = getattr(getattr(message, "channel", None), "qos", None)
    if isinstance(qos, QoS):
        qos.refuse(message.delivery_tag, reason)
        request.acknowledged = True  # (Celery's own mark: nothing more to ack)
    else:
        request.reject(requeue=False)


class DeliveryGuard(bootsteps.Step):  # type: ignore[misc]
    """Consumer bootstep: :func:`guard` the consumer as it is built."""

    label = "pgq delivery guard"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        guard(parent)
