"""A Celery worker's sessions carry its node name: ``pgq:<pid>:worker:<node>``.

Postgres knows a session by its application_name only; with the node name in it, the
console's processes page (and ``pg_stat_activity``) tells which worker a session is of.
Set as the worker starts (``celeryd_init``, before it connects), inherited by its pool's
forked children, whose pid differs."""

from __future__ import annotations

from typing import Any

from celery import signals

from pg_transport.db.pool import set_process_role

__all__ = ["connect"]


def _on_celeryd_init(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, str) and sender:
        set_process_role("worker", sender)


def connect() -> None:
    """Name the sessions of every worker this process starts (idempotent)."""
    # celeryd_init, not worker_init: only a worker process started as one (`celery
    # worker`), not a worker embedded in a test process, which goes on publishing after.
    signals.celeryd_init.connect(_on_celeryd_init, weak=False, dispatch_uid="pgq-process-node")
