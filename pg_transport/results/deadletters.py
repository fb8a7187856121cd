"""A dead-lettered task's result ends: FAILURE, in whichever result backend the app uses.

pgq moves a message to dead_letter when it is poisoned (past max_attempts), too large,
not a kombu message, undeliverable, rejected without requeue, or undecodable. The task
will not run (until ``pgq dead requeue``), so its result must not stay PENDING or
STARTED for ever: on ``message_dead_lettered`` the consuming worker marks it failed with
:class:`~pg_transport.results.errors.DeadLettered`, naming the reason and the dead-letter
id, through its app's own backend (Redis, pgq, a database…). ``mark_as_failure`` gets the
task's request as its message described it, so a chord part fails its chord (the errbacks
run once, as for a part that raised) and the task's ``link_error`` callbacks run.

A task whose worker rejected it without requeue (or whose body Celery could not decode)
had its failure handled by Celery already (a rejected task's errbacks and chord part run
there): for those only the stored result changes, to name the dead letter.

A body is decoded here only as JSON, YAML or msgpack, never unpickled: a pickled
message's result still fails, without its chord and callbacks (they are inside the
body).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Mapping
from typing import Any

from celery import current_app, signals, states
from celery.app.task import Context
from celery.backends.base import DisabledBackend
from kombu.serialization import loads
from kombu.utils.encoding import safe_repr

from pg_transport.results.errors import DeadLettered
from pg_transport.signals import message_dead_lettered

__all__ = ["connect", "dead_letter_error", "on_dead_lettered", "request_of"]

logger = logging.getLogger("pg_transport.results")

_SAFE = ("application/json", "application/x-yaml", "application/x-msgpack")

# Task events of this worker (Flower's source): whether it sends them (-E), its name, and
# a dispatcher of ours for the task-failed of a dead letter (the consumer's own buffers
# task events for its event loop, which is not this thread).
_events: dict[str, Any] = {}
_events_lock = threading.Lock()


def dead_letter_error(task_id: str, reason: str, dead_letter_id: int) -> DeadLettered:
    return DeadLettered(
        f"task {task_id} was dead-lettered by pgq ({reason}): dead letter {dead_letter_id}; "
        f"`pgq dead requeue {dead_letter_id}` delivers it again"
    )


def _body(payload: Mapping[str, Any]) -> Any:
    headers = payload.get("headers") or {}
    content_type = payload.get("content-type")
    if content_type not in _SAFE or not isinstance(headers, Mapping) or headers.get("compression"):
        return None
    body = payload.get("body")
    properties = payload.get("properties")
    encoding = properties.get("body_encoding") if isinstance(properties, Mapping) else None
    try:
        if encoding == "base64" and isinstance(body, str):
            body = base64.b64decode(body)
        return loads(
            body,
            content_type=content_type,
            content_encoding=payload.get("content-encoding") or "utf-8",
            accept=list(_SAFE),
        )
    except Exception:  # not base64, or undecodable: the request is what the headers say
        return None


def request_of(payload: Mapping[str, Any], task_id: str) -> Context:
    """The task's request as its message describes it (headers, and the body's embed
    of callbacks, errbacks, chain and chord when the body decodes safely)."""
    headers = payload.get("headers")
    fields: dict[str, Any] = dict(headers) if isinstance(headers, Mapping) else {}
    properties = payload.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    fields["id"] = task_id
    fields["delivery_info"] = properties.get("delivery_info") or {}
    fields["reply_to"] = properties.get("reply_to")
    fields["correlation_id"] = properties.get("correlation_id")
    body = _body(payload)
    if isinstance(body, (list, tuple)) and len(body) == 3 and isinstance(body[2], Mapping):
        args, kwargs, embed = body
        fields["args"], fields["kwargs"] = args, kwargs
        for key in ("callbacks", "errbacks", "chain", "chord"):
            fields[key] = embed.get(key)
    else:
        # Unknown: nothing to fail over to (better than a chord failed by a guess).
        for key in ("callbacks", "errbacks", "chain", "chord"):
            fields[key] = None
    return Context(fields)


def on_dead_lettered(
    sender: Any = None,
    task_id: str | None = None,
    reason: str = "",
    dead_letter_id: int | None = None,
    payload: Mapping[str, Any] | None = None,
    settled: bool = False,
    **_: Any,
) -> None:
    if not isinstance(task_id, str) or not task_id or dead_letter_id is None:
        return
    app = current_app._get_current_object()
    backend = app.backend
    if isinstance(backend, DisabledBackend):
        return
    request = request_of(payload or {}, task_id)
    if request.ignore_result:
        return
    error = dead_letter_error(task_id, reason, dead_letter_id)
    try:
        if settled:
            # Celery ran the task's failure handling already (errbacks, chord part, its
            # task-failed event): only the stored result changes, to name the dead letter.
            request.chord = None
            backend.store_result(task_id, error, states.FAILURE, request=request)
        else:
            backend.mark_as_failure(task_id, error, request=request)
            _task_failed_event(app, task_id, error)
    except Exception:
        # The request is what the message said (callbacks, chord, fields): one Celery
        # cannot follow still ends the task's result, without them, or get() would wait.
        logger.warning(
            "task %s dead-lettered (%s): its request could not be followed; storing its "
            "failure without it",
            task_id,
            reason,
            exc_info=True,
        )
        backend.store_result(task_id, error, states.FAILURE)
    logger.info("task %s dead-lettered (%s): result marked FAILURE", task_id, reason)


def _task_failed_event(app: Any, task_id: str, error: BaseException) -> None:
    """The ``task-failed`` event Celery sends for a task that raised, when this worker
    sends task events: monitors (Flower) show the dead-lettered task failed."""
    if not _events.get("enabled"):
        return
    try:
        with _events_lock:
            dispatcher = _events.get("dispatcher")
            if dispatcher is None:
                dispatcher = _events["dispatcher"] = app.events.Dispatcher(
                    app.connection_for_write(), hostname=_events["hostname"], enabled=True
                )
        dispatcher.send("task-failed", uuid=task_id, exception=safe_repr(error), traceback=None)
    except Exception:  # an event is a courtesy: the result is stored already
        logger.warning("could not send task-failed for %s", task_id, exc_info=True)


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    dispatcher = getattr(sender, "event_dispatcher", None)
    _events["enabled"] = bool(dispatcher is not None and dispatcher.enabled)
    _events["hostname"] = getattr(sender, "hostname", None)


def connect() -> None:
    """Connect the receivers (idempotent)."""
    message_dead_lettered.connect(
        on_dead_lettered, weak=False, dispatch_uid="pgq.results.dead_lettered"
    )
    signals.worker_ready.connect(
        _on_worker_ready, weak=False, dispatch_uid="pgq.results.worker_ready"
    )
