"""Deleting results past ``result_expires``: by every worker whose result backend is
pgq's (a :class:`Reaper` on its backend's database and schema, at most every
:data:`REAP_INTERVAL` seconds, started by :mod:`pg_transport.results.hooks` when the worker
is ready) and by Celery's ``backend_cleanup``.

Kept apart from the backend class so that reaping needs nothing of Celery's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.errors import BrokerUnavailable
from pg_transport.sql import load_named

__all__ = ["REAP_INTERVAL", "REAP_LIMIT", "Reaper", "reap_expired"]

logger = logging.getLogger("pg_transport.results")

#: Seconds between two reaps by one worker.
REAP_INTERVAL = 10.0
#: Expired results (and as many groups) deleted per statement.
REAP_LIMIT = 1000


def reap_expired(connector: Connector, schema: str, limit: int = REAP_LIMIT) -> int:
    """Delete up to ``limit`` expired results and as many groups; how many rows went.
    Safe from every worker at once (rows another reaper holds are skipped)."""
    query = load_named("results.sql", schema, "pg_transport.results")["result_reap"]

    def work(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(query, {"limit": limit}).fetchone()
        return int(row[0]) + int(row[1]) if row else 0

    return int(connector.run(work, idempotent=True))


class Reaper(threading.Thread):
    """One worker's reaping: once as it starts, then every :data:`REAP_INTERVAL` seconds
    until :meth:`stop`. A failed reap is logged and tried again next time."""

    def __init__(self, connector: Connector, schema: str) -> None:
        super().__init__(name="pgq-results-reaper", daemon=True)
        self.connector = connector
        self.schema = schema
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                reap_expired(self.connector, self.schema)
            except (psycopg.Error, BrokerUnavailable) as exc:
                logger.warning("reaping expired results failed: %s", exc)
            self._stop_event.wait(REAP_INTERVAL)
