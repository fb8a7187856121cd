"""Flow limits for operators (``pgq limit``): list, set, reset, and a limiter's keys.

The claim reads the definitions at every claim (docs/flow-control.md), so what is set
here holds from the next claim of every worker on, without a restart. A change also
makes every message a gate parked until a time visible now (``limit_release``): a
raised limit serves what waits at once, a lowered one parks it again at its next claim.
Every statement is in ``limits.sql`` beside this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pg_transport.errors import LimitError, NotPermitted
from pg_transport.message.limits import Rate, limit_name
from pg_transport.sql import channel_prefix, load_named
from pg_transport.store import Store

__all__ = ["KeyState", "LimitState", "Limits"]


@dataclass(frozen=True)
class LimitState:
    """One limit as ``pgq limit list`` shows it."""

    name: str
    rate: Rate | None
    burst: int
    concurrency: int | None
    origin: str
    updated_at: datetime
    tokens: int | None
    in_flight: int
    waiting: int
    keys: int

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rate": str(self.rate) if self.rate else None,
            "burst": self.burst,
            "concurrency": self.concurrency,
            "origin": self.origin,
            "updated_at": self.updated_at.isoformat(),
            "tokens": self.tokens,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "keys": self.keys,
        }


@dataclass(frozen=True)
class KeyState:
    """One key of a limiter (``pgq limit show --keys``)."""

    key: str
    tokens: int | None
    in_flight: int
    waiting: int
    used_at: datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "tokens": self.tokens,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "used_at": self.used_at.isoformat(),
        }


def _state(row: Any) -> LimitState:
    rate = Rate(int(row[1]), float(row[2])) if row[1] is not None else None
    return LimitState(
        row[0], rate, int(row[3]), row[4], row[5], row[6],
        None if row[7] is None else int(row[7]), int(row[8]), int(row[9]), int(row[10]),
    )  # fmt: skip


class Limits:
    """The flow limits of one schema, through a :class:`Store`'s connections."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.q = load_named("limits.sql", store.schema, "pg_transport.ops")

    def states(self, name: str | None = None) -> list[LimitState]:
        """Every limit (or the one named), with its tokens, in flight and waiting now."""

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            try:
                return conn.execute(self.q["limit_list"], {"name": name}).fetchall()
            except psycopg.errors.InsufficientPrivilege as exc:
                raise NotPermitted(
                    f"this role may not read the flow limits of pgq schema "
                    f"{self.store.schema!r} ({exc.diag.message_primary}): grant it EXECUTE "
                    "on flow_limit_states(text) as docs/least-privilege.md's blocks 4 "
                    "(workers) and 5 (monitor) do"
                ) from None

        return [_state(r) for r in self.store.connector.run(work, idempotent=True)]

    def set(
        self,
        name: str,
        *,
        rate: Rate | None = None,
        burst: int | None = None,
        concurrency: int | None = None,
        clear_rate: bool = False,
        clear_concurrency: bool = False,
    ) -> LimitState:
        """Define or change ``name`` (origin command); what is not given is kept. Parked
        messages are made visible now, to be judged under the new limit."""
        limit_name("name", name)
        params = {
            "name": name,
            "rate_count": rate.count if rate else None,
            "rate_period": rate.period if rate else None,
            "burst": burst,
            "concurrency": concurrency,
            "clear_rate": clear_rate,
            "clear_concurrency": clear_concurrency,
            "channel_prefix": channel_prefix(self.store.schema),
        }

        def work(conn: psycopg.Connection[Any]) -> None:
            with conn.transaction():
                try:
                    conn.execute(self.q["limit_set"], params)
                except psycopg.errors.CheckViolation as exc:
                    raise LimitError(
                        f"limit {name!r}: a limit needs a rate or a concurrency "
                        f"({exc.diag.constraint_name})"
                    ) from None
                conn.execute(self.q["limit_release"], params)

        self.store.connector.run(work, idempotent=True)
        return self.states(name)[0]

    def reset(self, name: str, *, every_origin: bool = False) -> str | None:
        """Remove ``name`` if a command set it (any origin with ``every_origin``): the
        origin removed, or None."""

        def work(conn: psycopg.Connection[Any]) -> str | None:
            row = conn.execute(
                self.q["limit_reset"], {"name": name, "every_origin": every_origin}
            ).fetchone()
            return None if row is None else str(row[0])

        return self.store.connector.run(work, idempotent=True)

    def keys(self, name: str, n: int) -> list[KeyState] | None:
        """The ``n`` keys of ``name`` with most waiting; None when this role may not
        read keys (the monitor: they are the application's values)."""

        def work(conn: psycopg.Connection[Any]) -> list[Any] | None:
            [(allowed,)] = conn.execute(
                self.q["limit_keys_allowed"], {"schema": self.store.schema}
            ).fetchall()
            if not allowed:
                return None
            return conn.execute(self.q["limit_keys"], {"name": name, "n": n}).fetchall()

        rows = self.store.connector.run(work, idempotent=True)
        if rows is None:
            return None
        return [
            KeyState(r[0], None if r[1] is None else int(r[1]), int(r[2]), int(r[3]), r[4])
            for r in rows
        ]
