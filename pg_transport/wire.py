"""Named queries sent through libpq directly, for the statements that run per message.

psycopg's cursor costs tens of microseconds per statement in Python (its query and
prepared-statement bookkeeping, result objects), as much as a round trip on a local
socket. The statements pgq runs once per message (publish, claim) skip it: each is
prepared once per session under a name of ours, its parameters are dumped by psycopg's
own adapters, and its rows come back as libpq's text values for the caller to decode.

Behind a transaction pooler nothing is prepared: the statement is sent whole each time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import abc, pq
from psycopg.adapt import PyFormat, Transformer

from pg_transport.sql import to_positional

__all__ = ["Row", "Statement"]

Row = tuple["bytes | None", ...]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


class Statement:
    """One named query of ``queries.sql``, ready to run through libpq."""

    def __init__(self, name: str, query: str) -> None:
        self.name = name
        text, self.params = to_positional(query)
        self.text = text.encode()
        self.key = f"pgq_{name}".encode()

    def values(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> Any:
        """Parameters as libpq text values (None is NULL, which libpq's types omit)."""
        formats = [PyFormat.TEXT] * len(self.params)
        return _transformer(conn).dump_sequence([params[n] for n in self.params], formats)

    def execute(
        self, conn: psycopg.Connection[Any], params: Mapping[str, Any], *, prepare: bool
    ) -> list[Row]:
        """Run it on ``conn`` and wait; the rows (as text), or the server's error."""
        pgconn = conn.pgconn
        values = self.values(conn, params)
        if prepare and self.ready(conn):
            result = pgconn.exec_prepared(self.key, values)
        else:
            result = pgconn.exec_params(self.text, values)
        return rows(result, conn)

    def send(
        self, conn: psycopg.Connection[Any], params: Mapping[str, Any], *, prepare: bool
    ) -> None:
        """Put it on the wire without waiting (``conn`` in non-blocking mode)."""
        pgconn = conn.pgconn
        values = self.values(conn, params)
        if prepare and self.ready(conn):
            pgconn.send_query_prepared(self.key, values)
        else:
            pgconn.send_query_params(self.text, values)

    def ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Prepare it on this session once (a blocking round trip, the first time)."""
        prepared: set[bytes] | None = getattr(conn, "_pgq_prepared", None)
        if prepared is None:
            prepared = set()
            conn._pgq_prepared = prepared  # type: ignore[attr-defined]
        if self.key not in prepared:
            check(conn.pgconn.prepare(self.key, self.text), conn)
            prepared.add(self.key)
        return True


def rows(result: pq.abc.PGresult, conn: psycopg.Connection[Any]) -> list[Row]:
    check(result, conn)
    fields = range(result.nfields)
    return [tuple(result.get_value(r, c) for c in fields) for r in range(result.ntuples)]


def check(result: pq.abc.PGresult, conn: psycopg.Connection[Any]) -> None:
    """Raise the server's error as psycopg would (a dead session as OperationalError)."""
    if result.status in _OK:
        return
    if conn.pgconn.status == pq.ConnStatus.BAD:
        raise psycopg.OperationalError(
            conn.pgconn.get_error_message().strip() or "the connection to the server was lost"
        )
    raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)


def _transformer(conn: psycopg.Connection[Any]) -> abc.Transformer:
    tx: abc.Transformer | None = getattr(conn, "_pgq_tx", None)
    if tx is None:
        tx = Transformer(conn)
        conn._pgq_tx = tx  # type: ignore[attr-defined]
    return tx
