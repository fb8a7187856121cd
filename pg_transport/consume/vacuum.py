"""Keeping the message table small while messages stream through it.

Every message leaves dead row versions behind (its claim, its ack). Until a VACUUM
removes them their index entries stay at the head of the claim index, and every claim
steps over them: at 100,000 dead rows a claim costs about twice what it costs on a
clean table. Autovacuum wakes up once a minute at best (``autovacuum_naptime``) and may
be off altogether, so each consuming process also looks every few seconds and vacuums
the table itself once ``vacuum_threshold`` dead rows have piled up. Only a table's owner may
vacuum it; other roles leave it to autovacuum (said once in the log).
``VACUUM (SKIP_LOCKED)`` lets one process vacuum while the others skip.

The look (:meth:`Vacuumer.look`, one row of the statistics views) is the housekeeping
thread's, on the session its queue maintenance uses every few seconds anyway: no
session of its own. The VACUUM, which may take seconds, runs on this thread, woken by
a look that found it due, on a pooled session taken for it (closed once idle past
``pool_idle_timeout``): lease renewal never waits for it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.errors import BrokerUnavailable
from pg_transport.sql import load_queries

__all__ = ["Vacuumer"]

logger = logging.getLogger("pg_transport.vacuum")


class Vacuumer(threading.Thread):
    def __init__(self, connector: Connector, schema: str, threshold: int) -> None:
        super().__init__(name="pgq-vacuum", daemon=True)
        self.connector = connector
        self.schema = schema
        self.threshold = threshold
        self._queries = load_queries(schema)
        self._stop_event = threading.Event()
        self._due = threading.Event()
        self._allowed = True
        #: How many VACUUMs this process ran (for tests and the curious).
        self.vacuums = 0

    def stop(self, wait: float = 0.0) -> None:
        """Stop; with ``wait``, wait that long at most for a VACUUM under way to end."""
        self._stop_event.set()
        self._due.set()
        if wait > 0 and self.is_alive() and self is not threading.current_thread():
            self.join(wait)

    def run(self) -> None:
        while True:
            self._due.wait()
            if self._stop_event.is_set():
                return
            self._due.clear()
            try:
                self.vacuum()
            except (psycopg.Error, BrokerUnavailable) as exc:
                logger.warning("vacuuming failed: %s", exc)

    def look(self) -> bool:
        """Whether the table has enough dead rows to vacuum; when it has, wake this thread
        to vacuum it. False, and never again a look, when this role may not vacuum it
        (not ours: autovacuum's job)."""
        if not self._allowed:
            return False

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
                    self._allowed = False
                    return False
                if int(dead) >= self.threshold:
                    logger.debug("%s.%s has %d dead rows", self.schema, table, dead)
                    return True
            return False

        due = self.connector.run(work, idempotent=True)
        if due:
            self._due.set()
        return due

    def vacuum(self) -> None:
        def work(conn: psycopg.Connection[Any]) -> None:
            conn.execute(self._queries["vacuum"], prepare=False)

        self.connector.run(work, idempotent=True)
        self.vacuums += 1
        logger.debug("vacuumed %s.message", self.schema)

    def check(self) -> bool:
        """Look, and vacuum now (on the caller's thread) what is due; False when this
        role may not vacuum the table."""
        if self.look():
            self._due.clear()
            self.vacuum()
        return self._allowed
