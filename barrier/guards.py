"""Terminal-status guards: small primitives distilled from real race fixes.

* :func:`transition` — atomic status change with ``legal_from``
  (``UPDATE … WHERE id = $1 AND status = ANY($legal_from) RETURNING``): of two
  racing writers the loser gets None, never a lost update. Works on any table.
* :class:`Guards` claims — a claim with a lease: a fresh lease excludes peers, a
  stale one can be reclaimed, a completed claim stays as a tombstone that refuses
  re-claims (redelivered finished work), release is idempotent.
* :class:`Guards` generations — every replace bumps a key's generation; a holder
  checks it is still current before writing (head check, :meth:`Guards.is_current`)
  and, inside the transaction that writes its result, that it was not superseded
  while running (tail check, :meth:`Guards.hold_generation`, which also keeps a
  concurrent replace waiting until that transaction ends).
* :func:`lock_id` / :func:`try_lock_id` — transaction-scoped advisory locks keyed
  on ids through :func:`pg_transport.db.locks.advisory_key` (deterministic across
  processes; Python's ``hash()`` is not). Any session that can connect can compute
  and hold such a key, so :func:`lock_id` waits a bounded time and then names who
  holds it; serialise on a row of your own table where nobody else may lock it.

Everything takes the caller's connection, so guards compose with the caller's own
statements in one transaction; only :meth:`Guards.release` takes a connector,
because it must be able to retry on a fresh connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from barrier.queries import queries
from pg_transport.db.locks import advisory_key
from pg_transport.db.pool import Connector
from pg_transport.fanin.errors import LockHeld
from pg_transport.sql.loader import parse_named

__all__ = [
    "LOCK_ID_WAIT",
    "Claim",
    "ClaimState",
    "Guards",
    "lock_id",
    "transition",
    "try_lock_id",
]


# How long lock_id tries before it names the holder and gives up (seconds).
LOCK_ID_WAIT = 30.0


@cache
def _templates() -> dict[str, str]:
    return parse_named(resources.files("barrier").joinpath("guards.sql").read_text("utf-8"))


def _table(table: str | Sequence[str]) -> sql.Identifier:
    return sql.Identifier(table) if isinstance(table, str) else sql.Identifier(*table)


def transition(
    conn: psycopg.Connection[Any],
    table: str | Sequence[str],
    ident: Any,
    to: str,
    legal_from: Sequence[str],
    *,
    id_column: str = "id",
    status_column: str = "status",
) -> tuple[Any, ...] | None:
    """Set ``status_column`` of row ``ident`` to ``to`` if it is one of ``legal_from``.

    ``table`` is a name or a (schema, name) pair. Returns ``(id, status)`` of the
    row moved, or None when the row was not in a legal status (someone else won).
    """
    query = sql.SQL(_templates()["transition"]).format(
        table=_table(table),
        id_column=sql.Identifier(id_column),
        status_column=sql.Identifier(status_column),
    )
    row = conn.execute(query, {"id": ident, "to": to, "legal_from": list(legal_from)}).fetchone()
    return tuple(row) if row is not None else None


def _lock_key(parts: Sequence[str]) -> int:
    if not parts:
        raise ValueError("a lock needs at least one key part")
    return advisory_key(*parts)


def lock_id(conn: psycopg.Connection[Any], *parts: str, wait: float = LOCK_ID_WAIT) -> None:
    """Take, and hold until the transaction ends, the lock of the id ``parts``; if
    another session holds it, try again for up to ``wait`` seconds, then raise
    :class:`~barrier.LockHeld` naming the holders.

    Never an unbounded wait: the lock is an advisory key, which any session that can
    connect can compute and hold (Postgres checks no privilege on advisory locks).
    Outside a transaction the lock would be released at once: use it in one.
    """
    _require_transaction(conn, "lock_id")
    key = _lock_key(parts)
    taken = Retrying(
        retry=retry_if_result(lambda got: not got),
        wait=wait_exponential(multiplier=0.01, max=0.25),
        stop=stop_after_delay(wait),
        retry_error_callback=lambda state: False,
    )(_try_key, conn, key)
    if not taken:
        holders = [
            f"pid {pid} (role {role!r}, application {app!r})"
            for pid, role, app in conn.execute(_templates()["lock_holders"], {"key": key})
        ]
        raise LockHeld(tuple(parts), wait, holders)


def try_lock_id(conn: psycopg.Connection[Any], *parts: str) -> bool:
    """Take the lock of the id ``parts`` until the transaction ends, if free."""
    _require_transaction(conn, "try_lock_id")
    return _try_key(conn, _lock_key(parts))


def _try_key(conn: psycopg.Connection[Any], key: int) -> bool:
    row = conn.execute(_templates()["try_lock_id"], {"key": key}).fetchone()
    return bool(row and row[0])


def _require_transaction(conn: psycopg.Connection[Any], what: str) -> None:
    # In autocommit outside a transaction block the statement would be its own
    # transaction: a lock would be gone, a tail check stale, before we return.
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    if conn.autocommit and idle:
        raise RuntimeError(f"{what} must run inside a transaction (conn.transaction())")


@dataclass(frozen=True)
class Claim:
    """A held claim. ``token`` counts (re)claims of the key: it fences a holder
    whose lease ran out and whose key was claimed again."""

    key: str
    holder: str
    token: int


@dataclass(frozen=True)
class ClaimState:
    holder: str
    token: int
    lease_until: datetime
    completed_at: datetime | None
    fresh: bool

    @property
    def tombstone(self) -> bool:
        return self.completed_at is not None


class Guards:
    """Claims and generations in one pgq schema (tables ``guard_claim``, ``guard_generation``)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.q = queries(schema)

    # -- claims with a lease --------------------------------------------------
    def claim(
        self, conn: psycopg.Connection[Any], key: str, holder: str, lease: float
    ) -> Claim | None:
        """Claim ``key`` for ``lease`` seconds; None while a peer's lease is fresh or
        when the key's work is complete (tombstone)."""
        params = {"key": key, "holder": holder, "lease": lease}
        row = conn.execute(self.q["guard_claim"], params).fetchone()
        return Claim(key, holder, int(row[0])) if row else None

    def renew(self, conn: psycopg.Connection[Any], claim: Claim, lease: float) -> bool:
        """Extend the lease; False if the claim is no longer this holder's."""
        return self._fenced(conn, "guard_renew", claim, lease=lease)

    def complete(self, conn: psycopg.Connection[Any], claim: Claim) -> bool:
        """Mark the claimed work done: the key becomes a tombstone. False if the claim
        was lost (a peer reclaimed it after the lease ran out)."""
        return self._fenced(conn, "guard_complete", claim)

    def release(self, connector: Connector, claim: Claim) -> None:
        """Give the claim up so a peer may take it now.

        Idempotent (a second release deletes nothing), so it runs through
        ``Connector.run(idempotent=True)``: :data:`pg_transport.db.retry.ONCE`
        retries it once on a fresh connection when the pooled one was reaped.
        """
        params = {"key": claim.key, "holder": claim.holder, "token": claim.token}

        def work(conn: psycopg.Connection[Any]) -> None:
            conn.execute(self.q["guard_release"], params)

        connector.run(work, idempotent=True)

    def state(self, conn: psycopg.Connection[Any], key: str) -> ClaimState | None:
        row = conn.execute(self.q["guard_claim_state"], {"key": key}).fetchone()
        if row is None:
            return None
        return ClaimState(str(row[0]), int(row[1]), row[2], row[3], bool(row[4]))

    def _fenced(self, conn: psycopg.Connection[Any], name: str, claim: Claim, **extra: Any) -> bool:
        params = {"key": claim.key, "holder": claim.holder, "token": claim.token, **extra}
        return conn.execute(self.q[name], params).fetchone() is not None

    # -- generations ----------------------------------------------------------
    def bump(self, conn: psycopg.Connection[Any], key: str) -> int:
        """Start a new generation of ``key`` (a replace); returns it. Waits for
        transactions holding the current one (:meth:`hold_generation`)."""
        row = conn.execute(self.q["guard_bump"], {"key": key}).fetchone()
        assert row is not None  # INSERT … ON CONFLICT DO UPDATE always returns the row
        return int(row[0])

    def current(self, conn: psycopg.Connection[Any], key: str) -> int:
        """The current generation of ``key``; 0 before the first bump."""
        row = conn.execute(self.q["guard_generation"], {"key": key}).fetchone()
        return int(row[0]) if row else 0

    def is_current(self, conn: psycopg.Connection[Any], key: str, generation: int) -> bool:
        """Head check: is ``generation`` still the current one (not superseded yet)?"""
        return self.current(conn, key) == generation

    def hold_generation(self, conn: psycopg.Connection[Any], key: str, generation: int) -> bool:
        """Tail check inside the caller's writing transaction: True if ``generation``
        is still current, and then no replace can commit before this transaction
        does. False means superseded: do not write."""
        _require_transaction(conn, "hold_generation")
        params = {"key": key, "generation": generation}
        return conn.execute(self.q["guard_hold_generation"], params).fetchone() is not None
