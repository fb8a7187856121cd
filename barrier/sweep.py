"""Sweeping stranded barriers: past their expiry, or without progress for their
stuck timeout. Safe in every worker at once: the sweep statement skips rows
another sweeper (or a counting part) holds, and flips only ARMED rows, so each
barrier is expired, and its errback inserted, exactly once. A row skipped because
a part was counting it is left to the next sweep (that part may have fired it).

A worker's :class:`Sweeper` holds no session between two rounds that are further apart
than its pool keeps a session idle (by default, rounds every 30 s, idle sessions closed
after 30 s): each such round
opens one and closes it, a few milliseconds of the interval, rather than keep a session
of every worker's main process idle for the barrier (docs/configuration.md, Connections)."""

from __future__ import annotations

import logging
import threading
from contextlib import closing
from typing import Any

import psycopg

from barrier.signals import barrier_stranded
from pg_transport.errors import PgqError
from pg_transport.fanin import state
from pg_transport.fanin.backend import backend_for

__all__ = ["Sweeper", "sweep"]

logger = logging.getLogger("barrier.sweep")

BATCH = 100


def sweep(
    app: Any, *, batch: int = BATCH, session: psycopg.Connection[Any] | None = None
) -> list[str]:
    """Expire every due barrier of ``app``; returns their ids. ``barrier_stranded``
    is sent for each, after its transaction committed. ``session``: an autocommit
    connection to sweep on (else one of the app's barrier pool)."""
    db = backend_for(app)
    expired: list[str] = []
    while True:

        def work(conn: psycopg.Connection[Any]) -> list[state.Stranded]:
            return state.sweep_due(db, conn, batch)

        # Not retried: a lost commit is found again (and skipped) by the next sweep.
        stranded = db.connector.run(work, idempotent=False) if session is None else work(session)
        for s in stranded:
            logger.warning(
                "barrier %s expired (%s) with %d of %d parts remaining",
                s.barrier_id,
                s.reason,
                s.remaining,
                s.total,
            )
            barrier_stranded.send(
                sender=s.callback_task,
                barrier_id=s.barrier_id,
                reason=s.reason,
                total=s.total,
                remaining=s.remaining,
                metadata=s.metadata,
                errback_id=s.errback_id,
            )
        expired.extend(s.barrier_id for s in stranded)
        if len(stranded) < batch:
            return expired


class Sweeper(threading.Thread):
    """Runs :func:`sweep` every ``interval`` seconds until stopped (one per worker)."""

    def __init__(self, app: Any, interval: float) -> None:
        super().__init__(name="pgq-barrier-sweep", daemon=True)
        self.app = app
        self.interval = interval
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while True:
            try:
                self.round()
            except (psycopg.Error, PgqError) as exc:
                # The next round tries again; a sweep changes nothing until it commits.
                logger.warning("barrier sweep failed: %s", exc)
            if self._stop_event.wait(self.interval):
                return

    def round(self) -> list[str]:
        """One sweep: on a session of its own, closed after, when the pool would not keep
        one idle until the next round anyway (so often, a pooled one: no connect each time)."""
        db = backend_for(self.app)
        if self.interval < db.connector.idle_timeout:
            return sweep(self.app)
        with closing(db.connector.connect()) as conn:
            return sweep(self.app, session=conn)
