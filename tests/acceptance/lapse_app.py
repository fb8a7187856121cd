"""The acceptance app with a task that holds its pool slot until the test opens a gate
(a row in ``{schema}.gates``): what a worker's prefetched tasks wait behind."""

from __future__ import annotations

import os
import time
from typing import Any

from psycopg import sql

from tests.acceptance.app import _db, app, record

__all__ = ["app", "gated"]


@app.task(bind=True)
def gated(self: Any, label: str) -> str:
    record(self.request.id, label)
    query = sql.SQL("SELECT 1 FROM {}.gates WHERE label = %s").format(
        sql.Identifier(os.environ["PGQ_SCHEMA"])
    )
    while _db().execute(query, [label]).fetchone() is None:
        time.sleep(0.02)  # a wait for the test's word, not for an ordering
    return label
