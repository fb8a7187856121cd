"""A throwaway pgq schema for the store-level benchmarks (backlog, table health).

These measure what the queue's SQL costs at a given table state, so they fill the table
in bulk (INSERT … SELECT, not a publish per row) and consume the way a worker does:
claims of a prefetch window with the previous window's acks riding on them.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.sql import load_queries
from pg_transport.store import Claimed, Store

__all__ = ["CELERY_PAYLOAD", "Scratch", "scratch"]

# The shape and size (~0.9 kB) of a Celery task message as pgq stores it.
CELERY_PAYLOAD: dict[str, Any] = {
    "body": '[["drain", 1, 0.0], {}, {"callbacks": null, "errbacks": null, '
    '"chain": null, "chord": null}]',
    "content-encoding": "utf-8",
    "content-type": "application/json",
    "headers": {
        "lang": "py", "task": "benchmarks.noop", "id": str(uuid.UUID(int=1)),
        "shadow": None, "eta": None, "expires": None, "group": None, "group_index": None,
        "retries": 0, "timelimit": [None, None], "root_id": str(uuid.UUID(int=1)),
        "parent_id": None, "argsrepr": "('drain', 1, 0.0)", "kwargsrepr": "{}",
        "origin": "gen1@bench", "ignore_result": True, "replaced_task_nesting": 0,
        "stamped_headers": None, "stamps": {},
    },
    "properties": {
        "correlation_id": str(uuid.UUID(int=1)), "reply_to": str(uuid.UUID(int=2)),
        "delivery_mode": 2, "delivery_info": {"exchange": "", "routing_key": "bench"},
        "priority": 0, "body_encoding": None, "delivery_tag": str(uuid.UUID(int=3)),
    },
}  # fmt: skip


@dataclass
class Scratch:
    schema: str
    store: Store
    admin: psycopg.Connection[Any]

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Run ``query`` with ``{schema}`` composed in; its rows."""
        text = sql.SQL(query).format(schema=sql.Identifier(self.schema))
        cur = self.admin.execute(text, params)
        return cur.fetchall() if cur.description else []

    def fill(
        self,
        queue: str,
        count: int,
        *,
        priority: int = 0,
        invisible: str | None = None,
        read_ct: int = 0,
        keyed: bool = False,
    ) -> None:
        """Insert ``count`` messages; ``invisible`` is an interval they stay hidden for
        (a lease when ``read_ct`` > 0, an ETA otherwise). ``keyed``: each gets a publish
        key as the transport's publishes do (32 hex digits), else none."""
        self.sql(
            "INSERT INTO {schema}.message"
            " (queue, priority, visible_at, read_ct, publish_key, payload)"
            " SELECT %s, %s, now() + %s::interval, %s,"
            " CASE WHEN %s THEN md5(gen_random_uuid()::text) END, %s::json"
            " FROM generate_series(1, %s)",
            queue,
            priority,
            invisible or "0 s",
            read_ct,
            keyed,
            json.dumps(CELERY_PAYLOAD),
            count,
        )

    def wal_position(self) -> str:
        """Where the server is inserting WAL now (an LSN)."""
        return str(self.sql("SELECT pg_current_wal_insert_lsn()")[0][0])

    def wal_since(self, position: str) -> int:
        """Bytes of WAL the server has written since ``position``, by every session."""
        return int(
            self.sql("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", position)[0][0]
        )

    def consume(self, queue: str, count: int, window: int) -> int:
        """Claim and ack ``count`` messages as a worker with ``window`` prefetch slots
        would (each claim lands the acks of the previous one); how many it got."""
        done = 0
        acks: list[tuple[int, int]] = []
        while done < count:
            batch: list[Claimed] = self.store.claim(
                [queue], [30.0], min(window, count - done), [5], acks=acks
            )
            if not batch:
                break
            acks = [c.token for c in batch]
            done += len(batch)
        self.store.ack(acks)
        return done

    def sizes(self) -> dict[str, int]:
        """Bytes of the message table's heap and of each of its indexes."""
        rows = self.sql(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class AS c"
            " WHERE c.oid = %s::regclass OR c.oid IN"
            " (SELECT indexrelid FROM pg_index WHERE indrelid = %s::regclass)",
            f"{self.schema}.message",
            f"{self.schema}.message",
        )
        return {("heap" if name == "message" else name): int(size) for name, size in rows}

    def stats(self) -> dict[str, int]:
        """Dead rows and updates (HOT or not) the statistics have seen so far (sessions
        report them when idle, up to a second late)."""
        row = self.sql(
            "SELECT n_dead_tup, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables"
            " WHERE schemaname = %s AND relname = 'message'",
            self.schema,
        )
        dead, upd, hot, deleted = row[0] if row else (0, 0, 0, 0)
        return {"dead_rows": dead, "updates": upd, "hot_updates": hot, "deletes": deleted}


@contextlib.contextmanager
def scratch(pg_url: str) -> Iterator[Scratch]:
    """A fresh pgq schema with a store as a worker has it (asynchronous-commit,
    generic-plan sessions for claims and acks); dropped afterwards."""
    schema = "pgq_scratch_" + uuid.uuid4().hex[:10]
    queries = load_queries(schema)
    connector = Connector(pg_url, application_name="pgq-bench", setup=(queries["no_jit"],))
    relaxed = Connector(
        pg_url,
        application_name="pgq-bench",
        setup=(queries["relax_commit"], queries["generic_plans"], queries["no_jit"]),
    )
    admin = psycopg.connect(pg_url, autocommit=True)
    try:
        ensure_schema(connector, schema, auto_migrate=True)
        yield Scratch(schema, Store(connector, schema, relaxed=relaxed), admin)
    finally:
        connector.close()
        relaxed.close()
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin.close()
