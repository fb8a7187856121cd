"""Keeping the message table small while messages stream through it.

Every message leaves dead row versions behind (its claim, its ack). Until a VACUUM
removes them their index entries stay at the head of the claim index, and every claim
steps over them: at 100,000 dead rows a claim costs about twice what it costs on a
clean table. Autovacuum wakes up once a minute at best (``autovacuum_naptime``) and may
be off altogether, so each consuming process also looks every few seconds and vacuums
the table itself once ``vacuum_threshold`` dead rows have piled up. Only a table's owner may
vacuum it; other roles leave it to autovacuum (said once in the log).
``VACUUM (SKIP_LOCKED)`` lets one process vacuum while the others skip.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.errors import BrokerUnavailable
from pg_transport.sql import load_queries

__all__ = ["CHECK_INTERVAL", "Vacuumer"]

logger = logging.getLogger("pg_transport.vacuum")

# Seconds between two looks at the table's dead rows.
CHECK_INTERVAL = 2.0


class Vacuumer(threading.Thread):
    def __init__(self, connector: Connector, schema: str, threshold: int) -> None:
        super().__init__(name="pgq-vacuum", daemon=True)
        self.connector = connector
        self.schema = schema
        self.threshold = threshold
        self._queries = load_queries(schema)
        self._stop_event = threading.Event()
        #: How many VACUUMs this process ran (for tests and the curious).
        self.vacuums = 0

    def stop(self, wait: float = 0.0) -> None:
        """Stop; with ``wait``, wait that long at most for a look under way to end."""
        self._stop_event.set()
        if wait > 0 and self.is_alive() and self is not threading.current_thread():
            self.join(wait)

    def run(self) -> None:
        allowed = True
        while not self._stop_event.wait(CHECK_INTERVAL):
            if not allowed:
                continue  # not ours to vacuum: autovacuum's job (alive, so not restarted)
            try:
                allowed = self.check()
            except (psycopg.Error, BrokerUnavailable) as exc:
                logger.warning("vacuuming failed: %s", exc)

    def check(self) -> bool:
        """Vacuum what has enough dead rows; False when this role may not."""

        def work(conn: psycopg.Connection[Any]) -> bool:
            found = conn.execute(self._queries["dead_rows"], {"schema": self.schema}).fetchall()
            for table, dead, owner in found:  # no rows: statistics not there yet
                if not owner:
                    logger.info(
                        "role %s does not own %s.%s and cannot vacuum it; autovacuum "
                        "keeps it small (see docs/performance.md)",
                        conn.info.user,
                        self.schema,
                        table,
                    )
                    return False
                if int(dead) >= self.threshold:
                    conn.execute(self._queries["vacuum"], prepare=False)
                    self.vacuums += 1
                    logger.debug("vacuumed %s.%s (%d dead rows)", self.schema, table, dead)
            return True

        return self.connector.run(work, idempotent=True)
