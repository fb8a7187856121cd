"""When a Celery ETA/countdown message is due: its ``visible_at`` under native delay."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

__all__ = ["eta_delay"]


def eta_delay(headers: Mapping[str, Any], now: datetime | None = None) -> float:
    """Seconds until the Celery ``eta`` header is due; 0 for now, a past or a bad ETA.

    A naive ETA is UTC, Celery's default (``enable_utc``). A bad one is delivered at
    once: Celery itself reports it when it runs the task.
    """
    eta = headers.get("eta")
    if not eta or not isinstance(eta, str):
        return 0.0
    try:
        due = datetime.fromisoformat(eta)
    except ValueError:
        return 0.0
    if due.tzinfo is None:
        due = due.replace(tzinfo=timezone.utc)
    return max((due - (now or datetime.now(timezone.utc))).total_seconds(), 0.0)
