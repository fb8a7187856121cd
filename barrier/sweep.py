"""Sweeping stranded barriers: past their expiry, or without progress for their
stuck timeout. Safe in every worker at once: the sweep statement skips rows
another sweeper (or a counting part) holds, and flips only ARMED rows, so each
barrier is expired, and its errback inserted, exactly once. A row skipped because
a part was counting it is left to the next sweep (that part may have fired it)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

from barrier.signals import barrier_stranded
from pg_transport.errors import PgqError
from pg_transport.fanin import state
from pg_transport.fanin.backend import backend_for

__all__ = ["Sweeper", "sweep"]

logger = logging.getLogger("barrier.sweep")

BATCH = 100


def sweep(app: Any, *, batch: int = BATCH) -> list[str]:
    """Expire every due barrier of ``app``; returns their ids. ``barrier_stranded``
    is sent for each, after its transaction committed."""
    db = backend_for(app)
    expired: list[str] = []
    while True:

        def work(conn: psycopg.Connection[Any]) -> list[state.Stranded]:
            return state.sweep_due(db, conn, batch)

        # Not retried: a lost commit is found again (and skipped) by the next sweep.
        stranded = db.connector.run(work, idempotent=False)
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
                sweep(self.app)
            except (psycopg.Error, PgqError) as exc:
                # The next round tries again; a sweep changes nothing until it commits.
                logger.warning("barrier sweep failed: %s", exc)
            if self._stop_event.wait(self.interval):
                return
