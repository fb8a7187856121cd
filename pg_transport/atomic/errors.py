"""What an atomic task's run raises."""

from __future__ import annotations

from celery.exceptions import Ignore

from pg_transport.errors import PgqError

__all__ = ["LeaseLost"]


class LeaseLost(PgqError, Ignore):  # type: ignore[misc]  # Celery is untyped
    """A stale delivery: its lease lapsed and its message went to another worker (or
    was released), so its run may not complete it. Found at the run's commit (the fence
    travels with the COMMIT): the commit is refused and the whole run rolled back, its
    writes, result, chord count and follow-up tasks with it, so only one delivery's
    effects ever commit. Logged by the worker; kept on the run (``Run.refused``)."""
