"""A chord's header part that the transport refuses fails its chord.

Celery arms a chord (its result backend's ``apply_chord``) before it sends the header's
parts. A part the transport refuses (a unique key on it, a header it cannot honour)
raises to the caller, and its chord would wait for it for good, the parts sent before it
running for nothing. So ``before_task_publish`` notes, per thread, the chord header part
being published (:func:`note`); the channel's put, refusing that message, sends
:data:`pg_transport.signals.chord_part_refused` (:func:`refused`) before it raises, and
the result backend that armed the chord fails it. The transport knows no result backend:
the signal is all it says.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pg_transport.message import unique
from pg_transport.signals import chord_part_refused

__all__ = ["note", "refused"]

# (task id, group id) of the chord header part this thread is publishing, if it is one.
_publishing = threading.local()


def note(body: Any, headers: Mapping[str, Any], properties: Mapping[str, Any] | None) -> None:
    """From ``before_task_publish``: whether the task being published is a part of a
    chord's header (its id and its chord's group id), for :func:`refused`."""
    part: tuple[str, str] | None = None
    if unique.chord_of(body):
        task_id = headers.get("id") or (properties or {}).get("correlation_id")
        group_id = headers.get("group")
        if isinstance(body, Mapping):  # protocol 1: both in the body
            task_id = task_id or body.get("id")
            group_id = group_id or body.get("taskset")
        if isinstance(task_id, str) and isinstance(group_id, str):
            part = (task_id, group_id)
    _publishing.part = part


def refused(message: Mapping[str, Any], exc: BaseException) -> None:
    """The channel refused to publish ``message`` with ``exc``: if it is the chord
    header part this thread noted, :data:`chord_part_refused` is sent. A receiver that
    raises is logged by Celery's signal: the caller is to see ``exc``, not that."""
    part: tuple[str, str] | None = getattr(_publishing, "part", None)
    if part is None:
        return
    properties = message.get("properties")
    headers = message.get("headers")
    ids = {
        (properties or {}).get("correlation_id") if isinstance(properties, Mapping) else None,
        headers.get("id") if isinstance(headers, Mapping) else None,
    }
    task_id, group_id = part
    if task_id not in ids:
        return
    _publishing.part = None
    task = headers.get("task") if isinstance(headers, Mapping) else None
    # Celery's send logs a receiver that raises and goes on.
    chord_part_refused.send(
        sender=task if isinstance(task, str) else None,
        task_id=task_id,
        group_id=group_id,
        exc=exc,
        payload=message,
    )
