"""What ``pgq status`` reports: queue depths, dead letters, connected clients, barriers.

Every statement is in ``status.sql`` beside this module. The per-queue numbers come from one
GROUP BY over ``message``: cheap enough for an operator's command, not meant to be
polled every second on a very deep queue. The ordering keys blocked (messages parked
behind an earlier one of their key) are read through the claim index, from the parked
rows only, in the same snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg

from pg_transport.message.limits import Rate
from pg_transport.ops.plugins import plugin
from pg_transport.sql import load_named
from pg_transport.store import Store

__all__ = [
    "BarrierCount",
    "ClientProcess",
    "Clients",
    "LimitLine",
    "QueueStatus",
    "Status",
    "UniqueLine",
    "barrier_counts",
    "celery_own",
    "collect",
    "limit_line",
    "limit_lines",
    "queries",
    "unique_lines",
]


def celery_own(queue: str) -> str | None:
    """Which of Celery's own queues ``queue`` is, or None for a queue of tasks.

    ``control``: a worker's remote-control mailbox (``<node>.<namespace>.pidbox``);
    ``reply``: the replies to one ``celery inspect``/``control`` call
    (``<id>.reply.<namespace>.pidbox``); ``events``: one event receiver's queue
    (``celeryev.<id>``, Celery's default ``event_queue_prefix``). None of them holds
    tasks; reply and event queues come and go with each client."""
    if queue.endswith(".pidbox"):
        return "reply" if ".reply." in queue else "control"
    if queue.startswith("celeryev."):
        return "events"
    return None


@dataclass(frozen=True)
class QueueStatus:
    queue: str
    #: Visible now: the next claim may take them.
    ready: int
    #: Claimed by a consumer whose lease has not run out.
    in_flight: int
    #: Waiting for their ETA, never delivered yet.
    delayed: int
    #: Rows of this queue in dead_letter.
    dead: int
    #: Seconds the longest-waiting ready message has been deliverable; None when none is.
    oldest_ready_age_s: float | None
    #: Seconds until the first delayed message falls due; None when none is delayed.
    next_due_in_s: float | None = None
    #: Ordering keys with messages parked behind an earlier message of the key.
    blocked_keys: int = 0
    #: Messages parked in those keys: a claim met each before an earlier one of its key
    #: had left the table. Not ready, in flight nor delayed.
    blocked: int = 0
    #: Seconds since the oldest parked message was published; None when none is parked.
    oldest_blocked_age_s: float | None = None
    #: Followers parked until the task they follow finishes or their wait runs out.
    following: int = 0
    #: Claimed in fair shares over its messages' fair keys (docs/unique-tasks.md).
    fair: bool = False
    #: Messages holding a unique key (docs/unique-tasks.md) while queued (not leased),
    #: and while running (leased: unique_while="queued_or_running"). None: this role may
    #: not count them (EXECUTE on unique_counts(), docs/least-privilege.md).
    unique_queued: int | None = None
    unique_running: int | None = None


@dataclass(frozen=True)
class ClientProcess:
    """One pgq client process and its sessions."""

    #: Its application_name: ``pgq:<pid>`` (a worker's: ``pgq:<pid>:worker:<node>``).
    name: str
    #: Where it connects from (an address, a host name, or ``local`` for a unix socket).
    address: str
    sessions: int
    #: Sessions running a statement right now.
    active: int


@dataclass(frozen=True)
class Clients:
    """pgq client processes (workers and publishers) connected to this database."""

    processes: int
    sessions: int
    #: Each process, most sessions first.
    by_process: list[ClientProcess] = field(default_factory=list)


@dataclass(frozen=True)
class BarrierCount:
    status: str
    count: int


@dataclass(frozen=True)
class LimitLine:
    """A flow limit (docs/flow-control.md): its rate (``10/s``) and burst, its
    concurrency per key, the messages holding its slots and those waiting for one."""

    name: str
    rate: str | None
    burst: int
    concurrency: int | None
    in_flight: int
    waiting: int
    #: Starts per second its rate allows; None without a rate.
    per_second: float | None = None


@dataclass(frozen=True)
class Status:
    schema: str
    queues: list[QueueStatus]
    clients: Clients
    barriers: list[BarrierCount] = field(default_factory=list)
    limits: list[LimitLine] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def barrier_counts(store: Store) -> list[BarrierCount]:
    """Barriers by status (only statuses that have any), as the barrier's plugin counts
    them (none without it)."""
    found = plugin("barrier")
    if found is None or found.status_counts is None:
        return []
    counts = found.status_counts(store.connector, store.schema)
    return [BarrierCount(status, n) for status, n in sorted(counts.items()) if n]


def queue_status(
    row: Sequence[Any],
    blocked: Sequence[Any] | None,
    unique: dict[str, tuple[int, int]] | None = None,
) -> QueueStatus:
    """A queue's figures from its ``status_queues`` row, its ``status_blocked`` row
    (None: nothing parked in its keys) and the unique keys held per queue (None: this
    role may not count them)."""
    held = None if unique is None else unique.get(str(row[0]), (0, 0))
    return QueueStatus(
        row[0],
        int(row[1]),
        int(row[2]),
        int(row[3]),
        int(row[4]),
        None if row[5] is None else float(row[5]),
        None if row[6] is None else float(row[6]),
        blocked_keys=0 if blocked is None else int(blocked[1]),
        blocked=0 if blocked is None else int(blocked[2]),
        oldest_blocked_age_s=None if blocked is None else float(blocked[3]),
        following=int(row[7]),
        fair=bool(row[8]),
        unique_queued=None if held is None else held[0],
        unique_running=None if held is None else held[1],
    )


def queries(schema: str) -> dict[str, str]:
    """The named statements of ``status.sql`` (the console samples ``status_queues``)."""
    return load_named("status.sql", schema, "pg_transport.ops")


def collect(store: Store) -> Status:
    q = queries(store.schema)

    def work(
        conn: psycopg.Connection[Any],
    ) -> tuple[list[Any], list[Any], Any, list[Any], list[Any], list[Any] | None]:
        # One snapshot for both counts of messages: a message promoted from its key's
        # parked rows between them would otherwise be counted twice or not at all.
        with conn.transaction():
            conn.execute(q["status_snapshot"])
            conn.execute(q["status_no_jit"])
            queues = conn.execute(q["status_queues"]).fetchall()
            blocked = conn.execute(q["status_blocked"]).fetchall()
            limits = conn.execute(q["status_limits"]).fetchall()
            unique = _unique_rows(conn, q, store.schema)
        clients = conn.execute(q["status_clients"]).fetchone()
        processes = conn.execute(q["status_client_processes"]).fetchall()
        return queues, blocked, clients, processes, limits, unique

    queues, blocked, clients, processes, limits, unique = store.connector.run(work, idempotent=True)
    keys = {str(row[0]): row for row in blocked}
    held = None if unique is None else {str(r[0]): (int(r[1]), int(r[2])) for r in unique}
    by_process = [
        ClientProcess(str(name), str(address), int(sessions), int(active))
        for name, address, sessions, active in processes
    ]
    return Status(
        schema=store.schema,
        queues=[queue_status(row, keys.get(str(row[0])), held) for row in queues],
        clients=(
            Clients(int(clients[0]), int(clients[1]), by_process) if clients else Clients(0, 0)
        ),
        barriers=barrier_counts(store),
        limits=[limit_line(r) for r in limits],
    )


def _unique_rows(conn: psycopg.Connection[Any], q: dict[str, str], schema: str) -> list[Any] | None:
    """``status_unique``'s rows, or None when this role may not run unique_counts()
    (a role granted before migration 0018, or none of the page's)."""
    row = conn.execute(q["status_unique_allowed"], {"schema": schema}).fetchone()
    if row is None or not row[0]:
        return None
    return conn.execute(q["status_unique"]).fetchall()


@dataclass(frozen=True)
class UniqueLine:
    """The unique keys held in a queue: by messages queued and by messages running."""

    queue: str
    queued: int
    running: int


def unique_lines(store: Store) -> list[UniqueLine] | None:
    """The unique keys held per queue with any (the console's limits page); None when
    this role may not count them."""
    q = queries(store.schema)

    def work(conn: psycopg.Connection[Any]) -> list[Any] | None:
        return _unique_rows(conn, q, store.schema)

    rows = store.connector.run(work, idempotent=True)
    return None if rows is None else [UniqueLine(str(r[0]), int(r[1]), int(r[2])) for r in rows]


def limit_line(row: Sequence[Any]) -> LimitLine:
    """A limit's line from its ``status_limits`` row."""
    return LimitLine(
        str(row[0]),
        None if row[1] is None else str(Rate(int(row[1]), float(row[2]))),
        int(row[3]),
        row[4],
        int(row[5]),
        int(row[6]),
        None if row[1] is None else int(row[1]) / float(row[2]),
    )


def limit_lines(store: Store) -> list[LimitLine]:
    """The flow limits alone (the console's limits page): ``status_limits``, read
    without the per-queue scan of :func:`collect`."""
    query = queries(store.schema)["status_limits"]

    def work(conn: psycopg.Connection[Any]) -> list[Any]:
        return conn.execute(query).fetchall()

    return [limit_line(r) for r in store.connector.run(work, idempotent=True)]
