"""What the console's pages read. Each query is bounded (an index and a LIMIT, or the
sample tables' hour); none scans the message table per request: depths come from the
latest sample (:mod:`pg_transport.web.sampler`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.message import poison
from pg_transport.sql import load_named

__all__ = [
    "Capabilities",
    "DeadRow",
    "MessageRow",
    "ProcessRow",
    "Reads",
    "preview",
    "process_kind",
]

#: What the sessions named ``<program>:<pid>…`` are, by program.
PROGRAMS = {
    "pgq": "publisher",
    "pgq-results": "result listener",
    "pgq-beat": "beat",
    "pgq-web": "console",
    "pgq-metrics": "metrics exporter",
    "pgq-barrier": "barrier",
}


def process_kind(application_name: str) -> tuple[str, str | None, str | None]:
    """What a session's application_name says: its kind of process (``worker``,
    ``publisher``, ``beat``, ``console``, …), its pid and its worker node name (None where
    it does not say). Any text is accepted: a session may name itself anything."""
    program, _, rest = application_name.partition(":")
    pid, _, role = rest.partition(":")
    kind = PROGRAMS.get(program, program)
    node = None
    if role.startswith("worker:"):
        node = role.removeprefix("worker:") or None
        kind = "worker" if program == "pgq" else f"worker's {kind}"
    return kind, pid if pid.isdigit() else None, node


@dataclass(frozen=True)
class ProcessRow:
    application_name: str
    kind: str
    pid: str | None
    node: str | None
    role: str | None
    address: str | None
    host: str | None
    sessions: int
    active: int
    since: datetime


#: Barriers on one page of the barriers list.
BARRIERS_PAGE = 50

#: Characters of a payload preview (arguments as JSON).
PREVIEW_CHARS = 400


@dataclass(frozen=True)
class Capabilities:
    """What the console's role may read and do, from Postgres' privilege functions."""

    role: str
    payloads: bool
    dead_details: bool
    dead_actions: bool
    schedules: bool
    barrier_details: bool
    samples: bool


@dataclass(frozen=True)
class MessageRow:
    id: int
    priority: int
    visible_at: datetime
    read_ct: int
    enqueued_at: datetime
    #: task name, id and arguments, when the role may read payloads.
    task: dict[str, Any] | None = None


@dataclass(frozen=True)
class DeadRow:
    id: int
    queue: str
    read_ct: int
    enqueued_at: datetime
    dead_at: datetime
    #: None for a role that may not read them (a monitor).
    task_name: str | None = None
    task_id: str | None = None
    identity: dict[str, Any] | None = None
    reason: str | None = None
    hooks: list[dict[str, Any]] | None = None


def _clip(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def preview(payload: Any) -> dict[str, Any]:
    """Task name, id and arguments of a raw payload, arguments clipped to a preview."""
    decoded = poison.decode(payload if isinstance(payload, dict) else {})
    return {
        "name": decoded.task_name,
        "id": decoded.task_id,
        "args": _clip(json.dumps(decoded.args, default=str)),
        "kwargs": _clip(json.dumps(decoded.kwargs, default=str)),
        "problems": decoded.reasons,
    }


def _detailed(r: Any) -> DeadRow:
    return DeadRow(
        id=r[0],
        queue=r[1],
        task_name=r[2],
        task_id=r[3],
        identity=r[4],
        reason=r[5],
        read_ct=r[6],
        enqueued_at=r[7],
        dead_at=r[8],
        hooks=r[9],
    )


class Reads:
    """The console's reads of one schema."""

    def __init__(self, connector: Connector, schema: str) -> None:
        self.connector = connector
        self.schema = schema
        self.q = load_named("web.sql", schema, "pg_transport.web")

    def _all(self, name: str, params: dict[str, Any] | None = None) -> list[Any]:
        query = self.q[name]

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(query, params or {}).fetchall()

        return self.connector.run(work, idempotent=True)

    def now(self) -> datetime:
        value: datetime = self._all("web_now")[0][0]
        return value

    def capabilities(self) -> Capabilities:
        row = self._all("web_capabilities", {"schema": self.schema})[0]
        return Capabilities(str(row[0]), *(bool(v) for v in row[1:]))

    def messages(
        self, queue: str, *, delayed: bool, payloads: bool, limit: int = 20
    ) -> list[MessageRow]:
        rows = self._all(
            "web_next_delayed" if delayed else "web_next_ready", {"queue": queue, "limit": limit}
        )
        tasks: dict[int, dict[str, Any]] = {}
        if payloads and rows:
            found = self._all("web_payloads", {"ids": [r[0] for r in rows]})
            tasks = {int(i): preview(p) for i, p in found}
        return [MessageRow(r[0], r[1], r[2], r[3], r[4], task=tasks.get(int(r[0]))) for r in rows]

    def dead(
        self,
        *,
        details: bool,
        queue: str | None = None,
        reason: str | None = None,
        task: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
        cap: int = 10_000,
    ) -> tuple[list[DeadRow], int]:
        """Dead letters newest first, and how many match (counted up to ``cap``)."""
        params = {
            "queue": queue,
            "since": since,
            "until": until,
            "limit": limit,
            "cap": cap,
            "reason": reason,
            "task": task,
        }
        if not details:
            rows = self._all("web_dead_counts", params)
            total = int(rows[0][-1]) if rows else 0
            return [DeadRow(*r[:5]) for r in rows], total
        rows = self._all("web_dead_rows", params)
        total = int(rows[0][-1]) if rows else 0
        return [_detailed(r) for r in rows], total

    def dead_one(self, dead_letter_id: int, *, details: bool) -> DeadRow | None:
        if details:
            rows = self._all("web_dead_one", {"id": dead_letter_id})
            return _detailed(rows[0]) if rows else None
        rows = self._all("web_dead_one_counts", {"id": dead_letter_id})
        return DeadRow(*rows[0]) if rows else None

    def dead_payload(self, dead_letter_id: int) -> dict[str, Any] | None:
        rows = self._all("web_dead_payload", {"id": dead_letter_id})
        return preview(rows[0][0]) if rows else None

    def armed_barriers(self, limit: int = 50) -> list[Any]:
        return self._all("web_barriers_armed", {"limit": limit})

    def barriers_page(
        self,
        status: str | None,
        before: tuple[datetime, str] | None,
        limit: int = BARRIERS_PAGE,
    ) -> tuple[list[Any], tuple[datetime, str] | None]:
        """A page of barriers newest first (of ``status``, or all), after ``before`` (the
        previous page's last created_at and id); and the next page's ``before``, None
        at the last page."""
        rows = self._all(
            "web_barriers_page",
            {
                "status": status,
                "before_at": before[0] if before else None,
                "before_id": before[1] if before else None,
                "limit": limit,
            },
        )
        if len(rows) <= limit:
            return rows, None
        rows = rows[:limit]
        return rows, (rows[-1][4], str(rows[-1][0]))

    def processes(self) -> list[ProcessRow]:
        return [
            ProcessRow(str(r[0]), *process_kind(str(r[0])), *r[1:])
            for r in self._all("web_processes")
        ]
