"""The consumer's own Postgres session, driven by Celery's event loop without blocking.

One connection per consuming transport carries the LISTEN wake-ups and the claims
(with the acks riding on them), one statement at a time: :meth:`Session.send` puts a
statement on the wire and returns; when the socket is readable, :meth:`Session.read`
collects notifications and, once the server has answered, the statement's rows. The
event loop never waits for a round trip, so it goes on feeding the pool and reading
results while a claim is out.

Rows come back as libpq's text values; the caller decodes the few columns it asked for.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import psycopg
from psycopg import pq

from pg_transport.connection import Connector
from pg_transport.sql import load_queries
from pg_transport.wire import Row, Statement, rows

__all__ = ["Reply", "Row", "Session"]

logger = logging.getLogger("pg_transport.session")


@dataclass
class Reply:
    """What one readable event brought: notified queues and, when the statement in
    flight has finished, its rows."""

    notified: set[str] = field(default_factory=set)
    rows: list[Row] | None = None


class Session:
    """A dedicated session of the consumer: LISTEN plus one statement in flight."""

    def __init__(
        self, connector: Connector, schema: str, *, listen: bool, prepare: bool
    ) -> None:
        self.connector = connector
        self.schema = schema
        self.listen = listen
        # Behind a transaction pooler the server session is not ours between
        # statements: nothing may be prepared on it.
        self.prepare = prepare
        self._queries = load_queries(schema)
        self._statements: dict[str, Statement] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self.busy = False

    # -- lifecycle --------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def open(self) -> None:
        """Connect (and LISTEN); idempotent."""
        if self.is_open:
            return
        conn = self.connector.connect()
        if self.listen:
            conn.execute(self._queries["listen"])
        conn.pgconn.nonblocking = 1
        self._conn = conn
        self.busy = False

    def fileno(self) -> int:
        assert self._conn is not None, "session not open"
        return self._conn.pgconn.socket

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self.busy = False
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except psycopg.Error:
                logger.debug("closing the consumer session failed", exc_info=True)

    # -- statements ---------------------------------------------------------------
    def send(self, name: str, params: Mapping[str, Any]) -> None:
        """Put the named query on the wire; its rows come with a later :meth:`read`."""
        assert not self.busy, "one statement at a time"
        conn = self._conn
        assert conn is not None, "session not open"
        statement = self._statements.get(name)
        if statement is None:
            statement = self._statements[name] = Statement(name, self._queries[name])
        statement.send(conn, params, prepare=self.prepare)
        self.busy = True
        self._flush(conn.pgconn)

    def read(self) -> Reply:
        """Take what the socket has: notifications, and the finished statement's rows.

        Raises the statement's error (the session stays usable) or a connection
        error (it does not).
        """
        conn = self._conn
        assert conn is not None, "session not open"
        pgconn = conn.pgconn
        reply = Reply()
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            self.close()
            raise
        while (note := pgconn.notifies()) is not None:
            reply.notified.add(note.extra.decode("utf-8", "replace"))
        if self.busy and not pgconn.is_busy():
            self.busy = False
            found: list[Row] = []
            error: BaseException | None = None
            while (result := pgconn.get_result()) is not None:
                try:
                    found.extend(rows(result, conn))
                except psycopg.Error as exc:
                    error = error or exc
            if error is not None:
                raise error
            reply.rows = found
        return reply

    def finish(self, timeout: float) -> Reply | None:
        """Wait (blocking, up to ``timeout``) for the statement in flight; its reply,
        or None when it did not come or the session is gone."""
        deadline = monotonic() + timeout
        while self.busy and self.is_open:
            left = deadline - monotonic()
            if left <= 0:
                return None
            select.select([self.fileno()], [], [], left)
            try:
                reply = self.read()
            except psycopg.Error:
                return None
            if reply.rows is not None:
                return reply
        return None

    def _flush(self, pgconn: pq.abc.PGconn) -> None:
        # A claim is a few hundred bytes: the socket buffer takes it at once. Should
        # it not, wait until it is writable rather than leave half a message queued.
        while pgconn.flush():
            select.select([], [pgconn.socket], [], 1.0)
