"""Plain-dict views of barrier state, for ``pgq status`` and ``pgq barrier show ID``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from barrier.queries import queries
from pg_transport.db.pool import Connector
from pg_transport.fanin.codec import loads as json_loads
from pg_transport.fanin.protocol import STATUSES

__all__ = ["show", "status_counts"]


def status_counts(connector: Connector, schema: str) -> dict[str, int]:
    """How many barriers are in each status; every status is present, zero or not."""
    query = queries(schema)["barrier_counts"]

    def work(conn: psycopg.Connection[Any]) -> list[Any]:
        return conn.execute(query).fetchall()

    counts = dict.fromkeys(STATUSES, 0)
    counts.update({str(status): int(n) for status, n in connector.run(work, idempotent=True)})
    return counts


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _task(signature_json: str | None) -> dict[str, Any] | None:
    if signature_json is None:
        return None
    sig = json_loads(signature_json)
    return {"task": sig.get("task"), "id": (sig.get("options") or {}).get("task_id")}


def show(connector: Connector, schema: str, barrier_id: str) -> dict[str, Any] | None:
    """One barrier: status, remaining, parts done, callback, timestamps; None if unknown.

    Every value is JSON-ready (timestamps as ISO 8601 strings).
    """
    q = queries(schema)

    def work(conn: psycopg.Connection[Any]) -> tuple[Any, list[Any]] | None:
        row = conn.execute(q["barrier_show"], {"id": barrier_id}).fetchone()
        if row is None:
            return None
        return row, conn.execute(q["barrier_show_parts"], {"id": barrier_id}).fetchall()

    found = connector.run(work, idempotent=True)
    if found is None:
        return None
    row, parts = found
    (
        ident,
        status,
        total,
        remaining,
        callback,
        errback,
        metadata,
        reason,
        created_at,
        progressed_at,
        expires_at,
        stuck_timeout,
        fired_at,
        finished_at,
        done,
        failed,
    ) = row
    return {
        "id": ident,
        "status": status,
        "total": total,
        "remaining": remaining,
        "parts_done": int(done),
        "parts_failed": int(failed),
        "callback": _task(callback),
        "errback": _task(errback),
        "metadata": metadata,
        "reason": reason,
        "stuck_timeout": stuck_timeout,
        "created_at": _iso(created_at),
        "progressed_at": _iso(progressed_at),
        "expires_at": _iso(expires_at),
        "fired_at": _iso(fired_at),
        "finished_at": _iso(finished_at),
        "parts": [
            {"index": idx, "task_id": task_id, "outcome": outcome, "finished_at": _iso(at)}
            for idx, task_id, outcome, at in parts
        ],
    }
