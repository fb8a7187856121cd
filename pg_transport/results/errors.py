"""Errors of the result backend."""

from __future__ import annotations

from kombu.exceptions import EncodeError

from pg_transport.errors import PgqError

__all__ = ["DeadLettered", "ResultTooLarge"]


class ResultTooLarge(PgqError, EncodeError):
    """An encoded result is larger than ``max_result_bytes``: it was not stored. (An
    ``EncodeError``, so Celery stores the task as failed with this error instead.)"""


class DeadLettered(PgqError):
    """The task's message was dead-lettered by pgq: it will not run (until requeued)."""
