"""Exactly-once effects: an atomic task's writes, the end of its delivery, its result and
its follow-up tasks in one commit (docs/exactly-once.md)."""

from __future__ import annotations

from pg_transport.atomic.errors import LeaseLost
from pg_transport.atomic.run import Completion
from pg_transport.atomic.task import AtomicTask

__all__ = ["AtomicTask", "Completion", "LeaseLost"]
