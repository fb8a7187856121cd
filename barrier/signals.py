"""Signals the barrier sends."""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["barrier_stranded"]

#: Sent once per barrier a sweep expired (past its ttl, or no part finished for
#: its stuck timeout), after the EXPIRED status and its errback message committed.
#: ``sender`` is the callback's task name; ``reason`` is "ttl" or "stuck".
barrier_stranded = Signal(
    name="barrier_stranded",
    providing_args={"barrier_id", "reason", "total", "remaining", "metadata", "errback_id"},
)
