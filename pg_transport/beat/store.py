"""The scheduler's SQL: schedule entries, the lease of the working beat, sent slots.

Every statement is one of ``beat.sql`` (beside this module); times are the database's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pg_transport.beat.entries import Entry, Schedule, decode, schedule_from_json
from pg_transport.db.pool import Connector
from pg_transport.sql import load_named

__all__ = ["BeatStore", "Lease", "Stored", "SyncResult"]

logger = logging.getLogger("pg_transport.beat")


@dataclass(frozen=True)
class Stored:
    """An enabled entry as the database holds it, read at ``now`` (the database's time)."""

    name: str
    task: str
    schedule: Schedule
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    anchor: datetime
    last_due: datetime | None
    revision: int


@dataclass(frozen=True)
class SyncResult:
    written: list[str]
    dropped: list[str]


@dataclass(frozen=True)
class Lease:
    """Who works: the holder of the lease, its term (holder changes), when it was taken."""

    holder: str
    term: int
    acquired_at: datetime
    lease_until: datetime
    running: bool


class BeatStore:
    """The beat tables of one schema, through one connector."""

    def __init__(self, connector: Connector, schema: str) -> None:
        self.connector = connector
        self.schema = schema
        self.q = load_named("beat.sql", schema, "pg_transport.beat")

    def sync(self, entries: Sequence[Entry]) -> SyncResult:
        """Store ``beat_schedule``'s entries and drop the ones it no longer has, in one
        transaction (beats starting together sync one after the other)."""

        def work(conn: psycopg.Connection[Any]) -> SyncResult:
            written: list[str] = []
            with conn.transaction():
                conn.execute(self.q["beat_sync_lock"])
                for entry in entries:
                    if conn.execute(self.q["beat_upsert_config"], entry.params()).fetchone():
                        written.append(entry.name)
                names = [entry.name for entry in entries]
                dropped = [
                    str(row[0])
                    for row in conn.execute(self.q["beat_drop_config"], {"names": names})
                ]
            return SyncResult(written, dropped)

        return self.connector.run(work, idempotent=True)

    def entries(self) -> tuple[list[Stored], datetime]:
        """Every enabled entry, and the database's time."""

        def work(conn: psycopg.Connection[Any]) -> tuple[list[Stored], datetime]:
            rows = conn.execute(self.q["beat_entries"]).fetchall()
            if not rows:
                row = conn.execute(self.q["beat_now"]).fetchone()
                assert row is not None
                return [], row[0]
            stored = [entry for entry in map(_stored, rows) if entry is not None]
            return stored, rows[0][9]

        return self.connector.run(work, idempotent=True)

    def now(self) -> datetime:
        def work(conn: psycopg.Connection[Any]) -> datetime:
            row = conn.execute(self.q["beat_now"]).fetchone()
            assert row is not None
            return row[0]  # type: ignore[no-any-return]

        return self.connector.run(work, idempotent=True)

    def hold_lease(self, holder: str, seconds: float) -> int | None:
        """Take or renew the lease for ``seconds``: its term, or None (someone else holds it)."""

        def work(conn: psycopg.Connection[Any]) -> int | None:
            row = conn.execute(
                self.q["beat_lease"], {"holder": holder, "lease": seconds}
            ).fetchone()
            return int(row[0]) if row else None

        return self.connector.run(work, idempotent=True)

    def release_lease(self, holder: str) -> None:
        self.connector.run(
            lambda conn: conn.execute(self.q["beat_release"], {"holder": holder}),
            idempotent=True,
        )

    def leader(self) -> Lease | None:
        def work(conn: psycopg.Connection[Any]) -> Lease | None:
            row = conn.execute(self.q["schedule_leader"]).fetchone()
            return Lease(str(row[0]), int(row[1]), row[2], row[3], bool(row[4])) if row else None

        return self.connector.run(work, idempotent=True)

    def take_slot(
        self,
        conn: psycopg.Connection[Any],
        entry: Stored,
        due: datetime,
        task_id: str,
        holder: str,
    ) -> bool:
        """Take slot ``due`` of ``entry`` on ``conn``, inside the caller's transaction (the
        one that inserts its message): True when this transaction is the one to send it."""
        params = {
            "name": entry.name,
            "revision": entry.revision,
            "due": due,
            "task_id": task_id,
            "holder": holder,
        }
        return conn.execute(self.q["beat_send_slot"], params).fetchone() is not None

    # -- `pgq schedule` ---------------------------------------------------------
    def listing(self) -> list[dict[str, Any]]:
        """Every entry, enabled or not, as `pgq schedule list` shows it."""

        def work(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
            cursor = conn.execute(self.q["schedule_list"])
            rows = cursor.fetchall()
            names = [column.name for column in cursor.description or ()]
            listed = []
            for row in rows:
                item = dict(zip(names, row, strict=True))
                for key in ("args", "kwargs", "options"):
                    item[key] = decode(item[key])
                listed.append(item)
            return listed

        return self.connector.run(work, idempotent=True)

    def add(self, entry: Entry, *, enabled: bool = True) -> bool:
        """Store a new entry (origin ``command``); False when the name is taken."""
        params = {**entry.params(), "enabled": enabled}
        return self.connector.run(
            lambda conn: conn.execute(self.q["schedule_add"], params).fetchone() is not None,
            idempotent=False,
        )

    def set_enabled(self, name: str, enabled: bool) -> bool:
        """Enable or disable an entry; False when there is none of that name."""
        params = {"name": name, "enabled": enabled}
        return self.connector.run(
            lambda conn: conn.execute(self.q["schedule_enable"], params).fetchone() is not None,
            idempotent=True,
        )

    def remove(self, name: str) -> str | None:
        """Delete an entry; its origin, or None when there is none of that name."""

        def work(conn: psycopg.Connection[Any]) -> str | None:
            row = conn.execute(self.q["schedule_remove"], {"name": name}).fetchone()
            return str(row[0]) if row else None

        return self.connector.run(work, idempotent=True)

    def prune(self, keep_seconds: float) -> int:
        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q["beat_prune_slots"], {"keep": keep_seconds}).rowcount

        return self.connector.run(work, idempotent=True)


def _stored(row: Sequence[Any]) -> Stored | None:
    """An entry row, or None (logged) when it cannot be read: a row someone wrote by
    hand must not stop every other entry."""
    name, task, schedule, args, kwargs, options, anchor, last_due, revision, _ = row
    try:
        return Stored(
            name=str(name),
            task=str(task),
            schedule=schedule_from_json(schedule),
            args=list(decode(args)),
            kwargs=dict(decode(kwargs)),
            options=dict(decode(options)),
            anchor=anchor,
            last_due=last_due,
            revision=int(revision),
        )
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        logger.error("pgq beat: schedule entry %r cannot be read, skipped: %s", name, exc)
        return None
