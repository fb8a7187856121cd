"""``@barrier_callback``: a barrier's callback runs its body once per barrier.

Under ``@app.task``::

    @app.task
    @barrier_callback
    def aggregate(results, **kwargs): ...

The callback message carries ``TRANSPORT_MARKER=True`` in its kwargs and the
barrier id in its ``pgq_barrier`` header. The wrapper pops the marker before the
body sees the kwargs. Only when the marker was there does it look at the barrier:
it skips the body if the barrier is already COMPLETED (a redelivered callback),
and otherwise runs the body inside one transaction that

* holds the lock of the barrier's row, so two deliveries of the same callback
  cannot run the body side by side (a lock only pgq's roles can take: no session
  that can merely connect can keep a callback waiting), and
* flips ``fired -> completed`` after the body returned, committing with it.

Only COMPLETED suppresses the body: FAILED/EXPIRED (or any status set elsewhere)
never stops the first legitimate run. A body whose worker dies before the commit
runs again on redelivery: side effects written through :func:`current_connection`
commit atomically with the COMPLETED flip, so those happen exactly once. A
callback called directly (no marker) always runs, touching nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast

import psycopg
from celery._state import get_current_task

from barrier.queries import queries
from pg_transport.fanin.backend import Backend, backend_for, is_transient
from pg_transport.fanin.protocol import COMPLETED, HEADER_BARRIER, TRANSPORT_MARKER, header

__all__ = ["barrier_callback", "current_connection", "run_once"]

logger = logging.getLogger("barrier.callback")

F = TypeVar("F", bound=Callable[..., Any])

_current: ContextVar[psycopg.Connection[Any] | None] = ContextVar(
    "pgq_barrier_connection", default=None
)


def current_connection() -> psycopg.Connection[Any] | None:
    """Inside a marked callback body: the connection whose transaction will flip the
    barrier to COMPLETED. Writes made on it commit together with that flip, or not
    at all. None outside a callback body."""
    return _current.get()


def skipped(barrier_id: str) -> dict[str, Any]:
    return {"status": "skipped_duplicate_callback", "barrier_id": barrier_id}


def run_once(db: Backend, barrier_id: str, body: Callable[[], Any]) -> Any:
    """Run ``body`` unless the barrier is COMPLETED, then mark it COMPLETED, in one
    transaction serialised on the barrier's row. (A barrier without a row has nothing
    to mark and nothing to lock: its deliveries each run the body.)"""
    with db.connector.connection() as conn, conn.transaction():
        row = conn.execute(
            queries(db.schema)["barrier_status_locked"], {"id": barrier_id}
        ).fetchone()
        if row is not None and row[0] == COMPLETED:
            logger.info("barrier %s already completed: callback body skipped", barrier_id)
            return skipped(barrier_id)
        token = _current.set(conn)
        try:
            result = body()
        finally:
            _current.reset(token)
        if (
            conn.execute(queries(db.schema)["barrier_complete"], {"id": barrier_id}).fetchone()
            is None
        ):
            # Not FIRED (unknown, or moved elsewhere): the body ran, the status stays.
            logger.warning(
                "barrier %s was not FIRED when its callback finished; status left as %s",
                barrier_id,
                row[0] if row else "unknown",
            )
        return result


def barrier_callback(fn: F) -> F:
    """Make ``fn`` a barrier callback (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        marked = bool(kwargs.pop(TRANSPORT_MARKER, False))
        if not marked:
            return fn(*args, **kwargs)
        task = get_current_task()
        barrier_id = header(getattr(task, "request", None), HEADER_BARRIER)
        if task is None or not barrier_id:
            logger.warning(
                "%s called with %s but no %s header: running it without dedup",
                getattr(fn, "__name__", fn),
                TRANSPORT_MARKER,
                HEADER_BARRIER,
            )
            return fn(*args, **kwargs)
        try:
            return run_once(backend_for(task.app), str(barrier_id), lambda: fn(*args, **kwargs))
        except Exception as exc:
            if not is_transient(exc):
                raise
            # Our connection died, taking the transaction (and any side effects
            # made through it) along: nothing happened, so run the callback again
            # later rather than fail it and leave the barrier FIRED for ever.
            raise task.retry(exc=exc, countdown=1) from exc

    return cast(F, wrapper)
