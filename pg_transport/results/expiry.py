"""Deleting results past ``result_expires``: by every consuming pgq worker's housekeeping
(at most every :data:`REAP_INTERVAL` seconds) and by Celery's ``backend_cleanup``.

Kept apart from the backend class so that the transport's housekeeping can reap without
importing Celery.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.sql import load_named

__all__ = ["REAP_INTERVAL", "REAP_LIMIT", "reap_expired"]

#: Seconds between two reaps by one worker's housekeeping.
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
