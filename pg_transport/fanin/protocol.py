"""Names shared by the dispatching side and the worker side of the barrier.

The barrier id and a part's index travel in message *headers*, never in a task's
kwargs, so part tasks keep their own signatures. Celery copies custom headers onto
``task.request`` (and into a retry's message), which is where the worker hooks
read them back.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ARMED",
    "COMPLETED",
    "EXPIRED",
    "FAILED",
    "FIRED",
    "HEADER_BARRIER",
    "HEADER_PART",
    "HEADER_ROLE",
    "ROLE_CALLBACK",
    "ROLE_ERRBACK",
    "STATUSES",
    "TRANSPORT_MARKER",
    "header",
]

#: Contract: the callback's kwargs carry ``TRANSPORT_MARKER=True``.
TRANSPORT_MARKER = "_pg_transport"

HEADER_BARRIER = "pgq_barrier"
HEADER_PART = "pgq_barrier_part"
HEADER_ROLE = "pgq_barrier_role"
ROLE_CALLBACK = "callback"
ROLE_ERRBACK = "errback"

ARMED = "armed"
FIRED = "fired"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
STATUSES = (ARMED, FIRED, COMPLETED, FAILED, EXPIRED)


def header(request: Any, name: str) -> Any:
    """A custom message header of a Celery task request, or None.

    Celery keeps custom headers in ``request.headers`` and also sets them as
    request attributes; either may be missing depending on how the task ran.
    """
    if request is None:
        return None
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and name in headers:
        return headers[name]
    return getattr(request, name, None)
