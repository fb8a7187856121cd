"""Dead-letter rows for operators: list them, requeue them, purge them, re-run their hooks.

The dead-letter table is where pgq puts what it will not deliver again; nothing
leaves it silently. This module is what ``pgq dead`` runs: every statement is in
``dead.sql`` (beside this module), and a requeue moves rows back into ``message`` in one statement,
so a row is never in both tables nor in neither.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Json

from pg_transport import poisoned
from pg_transport.errors import ConfigurationError, PgqError
from pg_transport.message import identity as identity_registry
from pg_transport.message import poison
from pg_transport.signals import message_poisoned
from pg_transport.sql import load_named
from pg_transport.store import Store

__all__ = [
    "DeadLetter",
    "DeadLetters",
    "NotFound",
    "RehookResult",
    "import_app",
    "parse_duration",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


class NotFound(PgqError):
    """A dead-letter id that is not (or no longer) in the table."""


def parse_duration(text: str) -> float:
    """Seconds in ``7d``, ``12h``, ``30m``, ``90s`` (or ``1w``, ``1h30m``)."""
    compact = text.strip().lower()
    parts = _DURATION.findall(compact)
    # Every character must belong to a number+unit pair: "7", "7x" and "d7" are errors.
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ConfigurationError(
            f"bad duration {text!r}: expected a number and a unit (s, m, h, d, w), "
            "e.g. 90s, 30m, 12h, 7d or 1h30m"
        )
    return sum(float(n) * _UNITS[u] for n, u in parts)


@dataclass(frozen=True)
class DeadLetter:
    """One row of ``pgq dead list``."""

    id: int
    queue: str
    task_name: str | None
    task_id: str | None
    identity: dict[str, Any]
    reason: str
    read_ct: int
    dead_at: datetime
    hooks: list[dict[str, Any]]

    @property
    def hooks_ok(self) -> int:
        return sum(1 for h in self.hooks if h.get("ok"))

    @property
    def hooks_failed(self) -> int:
        return len(self.hooks) - self.hooks_ok

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "identity": self.identity,
            "reason": self.reason,
            "read_ct": self.read_ct,
            "dead_at": self.dead_at.isoformat(),
            "hooks_ok": self.hooks_ok,
            "hooks_failed": self.hooks_failed,
            "hooks": self.hooks,
        }


@dataclass(frozen=True)
class RehookResult:
    dead_letter_id: int
    queue: str
    task_name: str | None
    task_id: str | None
    identity: dict[str, Any]
    outcomes: list[dict[str, Any]]
    #: False when the row was requeued or purged while the hooks ran.
    recorded: bool

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [o for o in self.outcomes if not o["ok"]]


class DeadLetters:
    """The dead-letter table of one schema, through a :class:`Store`'s connections."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.q = load_named("dead.sql", store.schema, "pg_transport.ops")

    def rows(self, *, queue: str | None = None, limit: int = 100) -> tuple[list[DeadLetter], int]:
        """The newest ``limit`` rows (of ``queue``), and how many there are in all."""
        params = {"queue": queue, "limit": limit}

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self.q["dead_list"], params).fetchall()

        rows = self.store.connector.run(work, idempotent=True)
        total = int(rows[0][9]) if rows else 0
        return [DeadLetter(*row[:9]) for row in rows], total

    def requeue(
        self, ids: Sequence[int] = (), *, every: bool = False, queue: str | None = None
    ) -> dict[str, list[int]]:
        """Move rows ``ids`` (or ``every`` row) back into their queues.

        Returns {queue: dead-letter ids moved into it}; ``ids`` not in the table are
        not in the answer. Not retried: a retry after a lost answer would find the
        rows gone and report nothing moved.
        """
        params = {
            "ids": list(ids),
            "all": every,
            "queue": queue,
            "channel_prefix": self.store.channel_prefix,
        }

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self.q["dead_requeue"], params).fetchall()

        rows = self.store.connector.run(work, idempotent=False)
        return {row[0]: list(row[1]) for row in rows}

    def purge(self, *, older_than: float | None = None, queue: str | None = None) -> int:
        """Delete rows dead for longer than ``older_than`` seconds (all when None)."""
        params = {"older_than": older_than, "queue": queue}

        def work(conn: psycopg.Connection[Any]) -> int:
            row = conn.execute(self.q["dead_purge"], params).fetchone()
            return int(row[0]) if row else 0

        # Not retried, as purge of a queue: a retry after a lost answer would report 0.
        return self.store.connector.run(work, idempotent=False)

    def rehook(self, dead_letter_id: int) -> RehookResult:
        """Send ``message_poisoned`` again for a row and record each handler's outcome.

        The handlers are whatever is connected in this process: import the app first
        (:func:`import_app`). With none connected nothing is sent and the recorded
        outcomes are kept, since an empty list would erase the record of a failure.
        """
        row = self.store.get_dead_letter(dead_letter_id)
        if row is None:
            raise NotFound(f"no dead-letter row {dead_letter_id} in schema {self.store.schema!r}")
        decoded = poison.decode(row["payload"])
        # The sender run_hooks sends as: a handler connected for another sender is not one.
        if not message_poisoned.has_listeners(sender=decoded.task_name or row["queue"]):
            raise ConfigurationError(
                "no message_poisoned handler is connected: pass the module that connects "
                "them with -A/--app MODULE"
            )
        found, _ = identity_registry.recover(decoded.task_name, decoded.args, decoded.kwargs)
        outcomes = poisoned.run_hooks(
            dead_letter_id=dead_letter_id,
            queue=row["queue"],
            decoded=decoded,
            identity=found,
            attempts=int(row["read_ct"]),
        )
        params = {"id": dead_letter_id, "hooks": Json(outcomes)}

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q["dead_record_hooks"], params).rowcount

        recorded = self.store.connector.run(work, idempotent=True) == 1
        return RehookResult(
            dead_letter_id,
            row["queue"],
            decoded.task_name,
            decoded.task_id,
            found,
            outcomes,
            recorded,
        )


def import_app(spec: str) -> None:
    """Import the user's app module, as ``celery -A`` does, so its handlers connect.

    ``proj``, ``proj.tasks`` and ``proj.celery:app`` are accepted; only the module
    is imported. The working directory is importable, as it is for ``celery -A``.
    """
    module = spec.partition(":")[0].strip()
    if not module:
        raise ConfigurationError(f"bad --app {spec!r}: expected a module name")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        importlib.import_module(module)
    except Exception as exc:  # the user's module may raise anything while importing
        raise ConfigurationError(
            f"cannot import app module {module!r}: {type(exc).__name__}: {exc}"
        ) from exc
