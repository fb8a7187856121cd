"""The barrier as a pgq plugin (entry point ``pgq.plugins``, see pyproject): its CLI group
(``pgq barrier show ID``), its status counts (``pgq status``, metrics, the console) and one
barrier's details for the console."""

from __future__ import annotations

from barrier.cli import barrier
from barrier.inspect import show, status_counts
from pg_transport.ops.plugins import Plugin

__all__ = ["plugin"]

plugin = Plugin(name="barrier", cli=barrier, status_counts=status_counts, show=show)
