"""The barrier's state transitions, each one transaction on the caller's connection.

Every function opens ``conn.transaction()``: a real transaction on an autocommit
connection, a savepoint inside the caller's own transaction. The invariants:

* a part is recorded at most once (``barrier_part`` primary key), and only a
  recorded part is counted, so a redelivered part never decrements twice;
* the decrement locks the barrier row until commit, so concurrent parts count one
  after the other and exactly one of them sees ``remaining`` reach 0;
* that part flips ``armed -> fired`` (conditional UPDATE) and inserts the callback
  message in the same transaction: "fired but callback lost" and "fired twice"
  cannot happen. Failure and expiry flip ``armed -> failed|expired`` the same way
  and insert the errback message with it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from celery.canvas import Signature
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from pg_transport.db.pool import is_own
from pg_transport.fanin.backend import Backend
from pg_transport.fanin.codec import dumps as json_dumps
from pg_transport.fanin.codec import loads as json_loads
from pg_transport.fanin.errors import BarrierError, BarrierExists
from pg_transport.fanin.messages import Outgoing, publish_key, task_message
from pg_transport.fanin.protocol import (
    HEADER_BARRIER,
    HEADER_ROLE,
    ROLE_CALLBACK,
    ROLE_ERRBACK,
    TRANSPORT_MARKER,
)

__all__ = [
    "COUNTED",
    "DUPLICATE",
    "FAILED",
    "FIRED",
    "IGNORED",
    "Stranded",
    "arm",
    "part_failed",
    "part_succeeded",
    "publish_outgoing",
    "sweep_due",
]

logger = logging.getLogger("pg_transport.fanin")

# What recording a part did.
COUNTED = "counted"  # decremented, others still running
FIRED = "fired"  # decremented to 0: the callback message is in the queue
DUPLICATE = "duplicate"  # this part was recorded before (a redelivery)
IGNORED = "ignored"  # the barrier is not armed (failed, expired, fired) or unknown
FAILED = "failed"  # this part failed the barrier: the errback message is in the queue


@dataclass(frozen=True)
class Stranded:
    """A barrier a sweep expired."""

    barrier_id: str
    reason: str
    total: int
    remaining: int
    metadata: dict[str, Any]
    callback_task: str
    errback_id: str | None


def _run(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any]
) -> psycopg.Cursor[tuple[Any, ...]]:
    """``query`` through a cursor of pgq's own (the connection may be an application's,
    with a row factory of its own), prepared only on a session of pgq's own: nothing of
    pgq's outlives its statement on an application's session."""
    cur = psycopg.Cursor(conn, row_factory=tuple_row)
    return cur.execute(query, params, prepare=None if is_own(conn) else False)


def publish_outgoing(db: Backend, conn: psycopg.Connection[Any], out: Outgoing, *key: str) -> None:
    """Insert ``out`` on ``conn``, in its transaction, under the publish key ``key``."""
    # As the transport's _put: an ETA message waits in Postgres unless that is off.
    delay = out.delay if db.native_delayed_delivery else 0.0
    db.publisher.publish_on(
        conn,
        out.queue,
        out.payload,
        priority=out.priority,
        delay=delay,
        publish_key=publish_key(*key),
    )


def arm(
    db: Backend,
    conn: psycopg.Connection[Any],
    barrier_id: str,
    parts: Sequence[Outgoing],
    callback: Signature,
    errback: Signature | None,
    *,
    ttl: float,
    stuck_timeout: float,
    metadata: Mapping[str, Any],
) -> None:
    """Arm the barrier and insert its parts' messages; with no parts, fire at once."""
    params = {
        "id": barrier_id,
        "total": len(parts),
        "callback": json_dumps(dict(callback)),
        "errback": json_dumps(dict(errback)) if errback is not None else None,
        "metadata": Jsonb(dict(metadata)),
        "ttl": ttl,
        "stuck_timeout": stuck_timeout,
    }
    with conn.transaction():
        if _run(conn, db.q["barrier_arm"], params).fetchone() is None:
            raise BarrierExists(barrier_id, _status(db, conn, barrier_id))
        # One round trip for all the parts, not one per part.
        with conn.pipeline():
            for index, part in enumerate(parts):
                publish_outgoing(db, conn, part, "pgq-barrier", barrier_id, "part", str(index))
        if not parts:
            _fire(db, conn, barrier_id)


def _status(db: Backend, conn: psycopg.Connection[Any], barrier_id: str) -> str | None:
    row = _run(conn, db.q["barrier_status"], {"id": barrier_id}).fetchone()
    return str(row[0]) if row else None


def _record(
    db: Backend,
    conn: psycopg.Connection[Any],
    barrier_id: str,
    index: int,
    task_id: str | None,
    outcome: str,
    result_json: str,
) -> bool:
    params = {
        "id": barrier_id,
        "idx": index,
        "task_id": task_id,
        "outcome": outcome,
        "result": result_json,
    }
    return _run(conn, db.q["barrier_part_record"], params).fetchone() is not None


def part_succeeded(
    db: Backend,
    conn: psycopg.Connection[Any],
    barrier_id: str,
    index: int,
    result_json: str,
    task_id: str | None = None,
) -> str:
    """Record part ``index`` as done with its result (kombu JSON text); count it,
    and fire the callback if it was the last. Returns what happened."""
    with conn.transaction():
        if not _record(db, conn, barrier_id, index, task_id, "succeeded", result_json):
            return DUPLICATE if _status(db, conn, barrier_id) else IGNORED
        row = _run(conn, db.q["barrier_count_part"], {"id": barrier_id}).fetchone()
        if row is None:
            return IGNORED
        if int(row[0]) > 0:
            return COUNTED
        _fire(db, conn, barrier_id)
        return FIRED


def _fire(db: Backend, conn: psycopg.Connection[Any], barrier_id: str) -> None:
    row = _run(conn, db.q["barrier_fire"], {"id": barrier_id}).fetchone()
    if row is None:
        # Unreachable while we hold the row lock with remaining = 0, and armed.
        raise BarrierError(f"barrier {barrier_id!r} reached 0 but could not fire")
    callback = Signature.from_dict(json_loads(row[0]), app=db.app)
    # A statement of its own, so under READ COMMITTED it sees every part whose
    # decrement we waited for: those transactions committed before we got the lock.
    results = [json_loads(r[0]) for r in _run(conn, db.q["barrier_results"], {"id": barrier_id})]
    if len(results) != row[1]:
        # Never fire with a result missing: roll the whole completion back instead.
        raise BarrierError(
            f"barrier {barrier_id!r} reached 0 with {len(results)} of {row[1]} results"
        )
    out = task_message(
        db.app,
        callback,
        args_prefix=(results,),
        extra_kwargs={TRANSPORT_MARKER: True},
        headers={HEADER_BARRIER: barrier_id, HEADER_ROLE: ROLE_CALLBACK},
    )
    publish_outgoing(db, conn, out, "pgq-barrier", barrier_id, "callback")


def _errback_info(
    barrier_id: str, status: str, reason: str, total: int, remaining: int, metadata: Any
) -> dict[str, Any]:
    return {
        "barrier_id": barrier_id,
        "status": status,
        "reason": reason,
        "total": total,
        "remaining": remaining,
        "metadata": metadata or {},
    }


def _publish_errback(
    db: Backend,
    conn: psycopg.Connection[Any],
    barrier_id: str,
    errback_json: str | None,
    info: dict[str, Any],
) -> str | None:
    if errback_json is None:
        return None
    errback = Signature.from_dict(json_loads(errback_json), app=db.app)
    out = task_message(
        db.app,
        errback,
        args_prefix=(info,),
        headers={HEADER_BARRIER: barrier_id, HEADER_ROLE: ROLE_ERRBACK},
    )
    publish_outgoing(db, conn, out, "pgq-barrier", barrier_id, "errback")
    return out.task_id


def part_failed(
    db: Backend,
    conn: psycopg.Connection[Any],
    barrier_id: str,
    index: int,
    error: str,
    task_id: str | None = None,
) -> str:
    """Record part ``index`` as failed for good: the barrier fails, its errback is
    inserted once, later parts are ignored."""
    with conn.transaction():
        if not _record(db, conn, barrier_id, index, task_id, "failed", json_dumps(error)):
            return DUPLICATE if _status(db, conn, barrier_id) else IGNORED
        reason = f"part {index} failed: {error}"
        row = _run(conn, db.q["barrier_fail"], {"id": barrier_id, "reason": reason}).fetchone()
        if row is None:
            return IGNORED
        errback_json, metadata, total, remaining = row
        info = _errback_info(barrier_id, "failed", reason, total, remaining, metadata)
        info["part"] = index
        _publish_errback(db, conn, barrier_id, errback_json, info)
        return FAILED


def sweep_due(db: Backend, conn: psycopg.Connection[Any], limit: int) -> list[Stranded]:
    """Expire up to ``limit`` due barriers and insert their errbacks, in one
    transaction; the caller sends ``barrier_stranded`` once it committed."""
    stranded: list[Stranded] = []
    with conn.transaction():
        rows = _run(conn, db.q["barrier_sweep"], {"limit": limit}).fetchall()
        for barrier_id, reason, errback_json, metadata, total, remaining, task in rows:
            info = _errback_info(barrier_id, "expired", reason, total, remaining, metadata)
            errback_id = _publish_errback(db, conn, barrier_id, errback_json, info)
            stranded.append(
                Stranded(
                    barrier_id, reason, total, remaining, metadata or {}, task or "", errback_id
                )
            )
    return stranded
