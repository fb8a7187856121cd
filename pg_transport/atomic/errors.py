"""What an atomic task's run raises."""

from __future__ import annotations

from celery.exceptions import Ignore

from pg_transport.errors import PgqError

__all__ = ["LeaseLost"]


class LeaseLost(PgqError, Ignore):  # type: ignore[misc]  # Celery is untyped
    """A stale delivery: its lease lapsed and its message went to another worker (or
    was released), so its run may not complete it. An ``Ignore`` to Celery: no result
    is stored, no chord part counted, no callback sent, and the run's transaction is
    rolled back, so only one delivery's effects ever commit."""
