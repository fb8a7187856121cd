"""What ``pgq delayed`` reports: ETA/countdown tasks waiting in Postgres.

With ``native_delayed_delivery`` on (the default) a task with an ETA or a countdown
waits in the message table until it is due, held by no worker, so Celery's
``inspect scheduled`` (which lists a worker's timer) does not see it. This lists those
messages, for every worker at once. The statement is in ``delayed.sql``,
beside this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg

from pg_transport.sql import load_named
from pg_transport.store import Store

__all__ = ["DEFAULT_LIMIT", "Delayed", "collect"]

#: How many messages are listed unless asked for more.
DEFAULT_LIMIT = 100


@dataclass(frozen=True)
class Delayed:
    """One message waiting for its ETA. Everything but ``queue``, ``due`` and
    ``priority`` is read from the message's headers, as its publisher wrote them."""

    queue: str
    #: When pgq makes it deliverable (its ETA, by the database's clock).
    due: datetime
    priority: int
    task_id: str | None
    task: str | None
    #: The ETA its publisher asked for (Celery's ``eta`` header).
    eta: str | None
    argsrepr: str | None
    kwargsrepr: str | None

    def as_json(self) -> dict[str, Any]:
        return asdict(self) | {"due": self.due.isoformat()}


def collect(store: Store, queues: Sequence[str] = (), limit: int = DEFAULT_LIMIT) -> list[Delayed]:
    """Messages of ``queues`` (every queue: none given) waiting for their ETA, soonest
    first, at most ``limit``."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    query = load_named("delayed.sql", store.schema, "pg_transport.ops")["delayed"]

    def work(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
        return conn.execute(query, {"queues": list(queues), "limit": limit}).fetchall()

    return [Delayed(*row) for row in store.connector.run(work, idempotent=True)]
