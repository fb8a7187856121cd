"""The consumer's own Postgres session, driven by Celery's event loop without blocking.

One connection per consuming transport carries the LISTEN wake-ups and the claims
(with the acks riding on them), one statement at a time: :meth:`Session.send` puts a
statement on the wire and returns; when the socket is readable, :meth:`Session.read`
collects notifications and, once the server has answered, the statement's rows. The
event loop never waits for a round trip, so it goes on feeding the pool and reading
results while a claim is out.

A session that listens also takes a consumer token: it holds the advisory lock (lock
space of the schema, token) for as long as it lives and listens on its own channel,
where publishes hand it messages while it waits (see the ``publish`` and ``claim``
queries). The lock is how a publisher tells a live consumer from one that died.

Rows come back as libpq's text values; the caller decodes the few columns it asked for.
"""

from __future__ import annotations

import logging
import random
import select
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import psycopg

from pg_transport.connection import Connector
from pg_transport.locks import lock_space
from pg_transport.sql import compose_handoff, handoff_channel, load_queries
from pg_transport.wire import Row, Statement, rows, send_buffered

__all__ = ["Reply", "Row", "Session"]

logger = logging.getLogger("pg_transport.session")


@dataclass
class Reply:
    """What one readable event brought: notified queues, messages handed over (as the
    NOTIFY payload's JSON text) and, when the statement in flight has finished, its
    rows."""

    notified: set[str] = field(default_factory=set)
    handed: list[str] = field(default_factory=list)
    rows: list[Row] | None = None

    def merge(self, other: Reply) -> None:
        self.notified |= other.notified
        self.handed.extend(other.handed)
        if other.rows is not None:
            self.rows = other.rows


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
        #: The consumer token this session holds (None: it does not take hand-offs).
        self.token: int | None = None
        self._handoff_channel = ""

    # -- lifecycle --------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def open(self) -> None:
        """Connect (and LISTEN); idempotent."""
        if self.is_open:
            return
        conn = self.connector.connect()
        token = None
        if self.listen:
            try:
                token = self._hold_token(conn)
                self._handoff_channel = handoff_channel(self.schema, token)
                conn.execute(self._queries["listen"])
                conn.execute(
                    compose_handoff(self._queries["listen_handoff"], self._handoff_channel)
                )
            except BaseException:
                conn.close()
                raise
        conn.pgconn.nonblocking = 1
        self._conn = conn
        self.token = token
        self.busy = False

    def _hold_token(self, conn: psycopg.Connection[Any]) -> int:
        """A random token whose lock this session now holds (another session holding
        the same one, rarely, makes it draw again)."""
        space = lock_space(self.schema)
        while True:
            token = random.randint(1, 2**31 - 1)
            row = conn.execute(
                self._queries["hold_token"], {"lock_space": space, "token": token}
            ).fetchone()
            if row is not None and row[0]:
                return token

    def fileno(self) -> int:
        assert self._conn is not None, "session not open"
        return self._conn.pgconn.socket

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self.busy = False
        self.token = None  # its lock goes with the session
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
        # A claim is a few hundred bytes: the socket buffer takes it at once. Should
        # it not, wait until it is writable rather than leave half a message queued.
        send_buffered(conn.pgconn)

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
        self._notifications(reply)
        if self.busy and not pgconn.is_busy():
            self.busy = False
            found: list[Row] = []
            error: BaseException | None = None
            while (result := pgconn.get_result()) is not None:
                try:
                    found.extend(rows(result, conn))
                except psycopg.Error as exc:
                    error = error or exc
            # Parsing the answer may have parsed notifications that followed it on the
            # socket: they are in libpq's list now, and the socket will not wake the
            # loop for them again.
            self._notifications(reply)
            if error is not None:
                raise error
            reply.rows = found
        return reply

    def _notifications(self, reply: Reply) -> None:
        """Move the notifications libpq has parsed so far into ``reply``."""
        assert self._conn is not None
        pgconn = self._conn.pgconn
        while (note := pgconn.notifies()) is not None:
            if self.token is not None and note.relname.decode() == self._handoff_channel:
                reply.handed.append(note.extra.decode("utf-8"))
            else:
                reply.notified.add(note.extra.decode("utf-8", "replace"))

    def finish(self, timeout: float, into: Reply | None = None) -> Reply | None:
        """Wait (blocking, up to ``timeout``) for the statement in flight; its reply,
        or None when it did not come or the session is gone. What was read on the way
        (notifications, hand-offs) is merged into ``into`` as well."""
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
            if into is not None:
                into.merge(reply)
            if reply.rows is not None:
                return reply
        return None

    def await_handed(self, timeout: float, into: Reply) -> None:
        """Read (blocking, up to ``timeout``) until a hand-off is in ``into``."""
        deadline = monotonic() + timeout
        while not into.handed and self.is_open:
            left = deadline - monotonic()
            if left <= 0:
                logger.warning("a hand-off known to be committed did not arrive in %.1fs; "
                               "it is delivered when it does", timeout)
                return
            select.select([self.fileno()], [], [], left)
            into.merge(self.read())

