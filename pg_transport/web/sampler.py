"""The console's history: a tick per interval, kept in Postgres so every console shows one.

Whichever console inserts a tick first computes that tick's per-queue figures with the
query of ``pgq status`` (one GROUP BY over ``message``) in the same transaction; the
others find the tick taken and do nothing. That one scan per interval, not one per page
view, is what the pages read, so a page costs the same with a million messages as with
ten. Ticks older than the history drawn are deleted by the taker.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.errors import PgqError
from pg_transport.ops.status import QueueStatus
from pg_transport.ops.status import queries as status_queries
from pg_transport.sql import load_named

__all__ = [
    "HISTORY_SECONDS",
    "Latest",
    "QueueRates",
    "Rates",
    "Sampler",
    "changes",
    "queue_rates",
    "rates",
    "take",
]

logger = logging.getLogger("pg_transport.web")

#: What the charts draw: the last hour.
HISTORY_SECONDS = 3600.0
#: What is kept: the hour, and a little for the first point's rate.
KEEP_SECONDS = HISTORY_SECONDS + 300.0


@dataclass(frozen=True)
class Latest:
    """The latest tick: when it was taken and every queue's figures then."""

    at: datetime | None
    queues: list[QueueStatus]


@dataclass(frozen=True)
class Rates:
    """Rows per second between two ticks: inserted (published, requeued) and deleted
    (acked, dead-lettered, purged, expired) from the message table."""

    at: datetime
    inserted: float | None
    deleted: float | None


@dataclass(frozen=True)
class QueueRates:
    """One queue's rates, per second, between the first tick of a window and the latest:
    how fast its waiting messages (ready, in flight, delayed) grew (+) or shrank (-), and
    its dead letters (dead-lettered, less those requeued or purged). A queue that appeared
    since counts from none. None where the window holds a single tick.

    What the samples say, and no more: a queue's publishes and acks are not counted
    apart (the message table's rates are the schema's), so a queue whose workers keep
    up shows a change near zero however busy it is."""

    span: float
    change: float | None
    dead: float | None

    def empties_in(self, waiting: int) -> float | None:
        """Seconds until ``waiting`` messages are gone at the window's rate, if it shrinks."""
        if self.change is None or self.change >= 0 or waiting <= 0:
            return None
        return waiting / -self.change


def take(connector: Connector, schema: str, interval: float) -> datetime | None:
    """Take this interval's tick if no console has; the tick's time, or None if taken."""
    web = load_named("web.sql", schema, "pg_transport.web")
    status_queues = status_queries(schema)["status_queues"]

    def work(conn: psycopg.Connection[Any]) -> datetime | None:
        with conn.transaction():
            row = conn.execute(
                web["web_tick_take"], {"interval": interval, "schema": schema}
            ).fetchone()
            if row is None:
                return None
            at: datetime = row[0]
            queues = conn.execute(status_queues).fetchall()
            with conn.cursor() as cur:
                cur.executemany(
                    web["web_sample_insert"],
                    [
                        {
                            "at": at,
                            "queue": q[0],
                            "ready": q[1],
                            "in_flight": q[2],
                            "delayed": q[3],
                            "dead": q[4],
                            "oldest": q[5],
                        }
                        for q in queues
                    ],
                )
            conn.execute(web["web_prune"], {"keep": KEEP_SECONDS})
            return at

    # Not retried: a retry after a lost commit would find the tick taken, which is fine,
    # and the next interval's tick comes anyway.
    return connector.run(work, idempotent=False)


def latest(connector: Connector, schema: str) -> Latest:
    query = load_named("web.sql", schema, "pg_transport.web")["web_latest"]

    def work(conn: psycopg.Connection[Any]) -> list[Any]:
        return conn.execute(query).fetchall()

    rows = connector.run(work, idempotent=True)
    if not rows:
        return Latest(None, [])
    return Latest(
        rows[0][1],
        [
            QueueStatus(
                r[2],
                int(r[3]),
                int(r[4]),
                int(r[5]),
                int(r[6]),
                None if r[7] is None else float(r[7]),
            )
            for r in rows
            if r[2] is not None
        ],
    )


def changes(connector: Connector, schema: str, latest: Latest) -> dict[str, float]:
    """Per queue: how fast its waiting messages (ready, in flight, delayed) grew (or, below
    zero, shrank) per second between the tick before the latest and the latest."""
    query = load_named("web.sql", schema, "pg_transport.web")["web_previous"]

    def work(conn: psycopg.Connection[Any]) -> list[Any]:
        return conn.execute(query).fetchall()

    if latest.at is None:
        return {}
    before = connector.run(work, idempotent=True)
    if not before:
        return {}
    span = (latest.at - before[0][0]).total_seconds()
    if span <= 0:
        return {}
    then = {str(queue): int(waiting) for _, queue, waiting in before}
    return {
        q.queue: (q.ready + q.in_flight + q.delayed - then.get(q.queue, 0)) / span
        for q in latest.queues
    }


def queue_rates(
    connector: Connector, schema: str, seconds: float = HISTORY_SECONDS
) -> dict[str, QueueRates]:
    """The rates of each queue of the latest tick over the last ``seconds``."""
    query = load_named("web.sql", schema, "pg_transport.web")["web_queue_rates"]

    def work(conn: psycopg.Connection[Any]) -> list[Any]:
        return conn.execute(query, {"seconds": seconds}).fetchall()

    out = {}
    for queue, span, waiting, dead in connector.run(work, idempotent=True):
        span = float(span or 0.0)
        if span <= 0:
            out[str(queue)] = QueueRates(span, None, None)
        else:
            out[str(queue)] = QueueRates(span, int(waiting) / span, int(dead) / span)
    return out


def rates(ticks: list[tuple[datetime, datetime, int | None, int | None]]) -> list[Rates]:
    """Per second between consecutive ticks; None where a counter went back (statistics
    reset) or is unknown."""
    out = []
    for (_, t0, ins0, del0), (at1, t1, ins1, del1) in itertools.pairwise(ticks):
        span = (t1 - t0).total_seconds()

        def per_second(a: int | None, b: int | None, span: float = span) -> float | None:
            if a is None or b is None or b < a or span <= 0:
                return None
            return (b - a) / span

        out.append(Rates(at1, per_second(ins0, ins1), per_second(del0, del1)))
    return out


def history(
    connector: Connector, schema: str, queue: str | None, seconds: float = HISTORY_SECONDS
) -> tuple[list[tuple[datetime, int, int]], list[Rates]]:
    """Depths (waiting, ready) per tick of one queue or all, and the rates, oldest first."""
    q = load_named("web.sql", schema, "pg_transport.web")

    def work(conn: psycopg.Connection[Any]) -> tuple[list[Any], list[Any]]:
        depths = conn.execute(q["web_depths"], {"seconds": seconds, "queue": queue}).fetchall()
        ticks = conn.execute(q["web_ticks"], {"seconds": seconds}).fetchall()
        return depths, ticks

    depths, ticks = connector.run(work, idempotent=True)
    return [(a, int(w), int(r)) for a, w, r in depths], rates(ticks)


class Sampler(threading.Thread):
    """Takes a tick every ``interval`` seconds until stopped."""

    def __init__(self, connector: Connector, schema: str, interval: float) -> None:
        super().__init__(name="pgq-web-sampler", daemon=True)
        self.connector = connector
        self.schema = schema
        self.interval = interval
        self.stopped = threading.Event()
        self.failing = False

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                take(self.connector, self.schema, self.interval)
                self.failing = False
            except psycopg.errors.InsufficientPrivilege as exc:
                logger.warning("no samples: the console's role may not write them (%s)", exc)
                return
            except (PgqError, psycopg.Error, OSError) as exc:
                if not self.failing:
                    logger.warning("sampling failed, retrying every interval: %s", exc)
                self.failing = True
            # To the start of the next interval (ticks are aligned to it), and a little.
            self.stopped.wait(self.interval - time.time() % self.interval + 0.05)

    def stop(self) -> None:
        self.stopped.set()
