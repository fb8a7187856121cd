"""Periodic tasks from Postgres: ``celery beat -S pgq``, any number of beats, each slot sent once.

See :mod:`pg_transport.beat.scheduler` for how, and docs/beat.md for how to use it.
"""

from __future__ import annotations

from pg_transport.beat.scheduler import HEADER_DUE, HEADER_ENTRY, CannotStart, Scheduler

__all__ = ["HEADER_DUE", "HEADER_ENTRY", "CannotStart", "Scheduler"]
