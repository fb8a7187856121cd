"""The consumer's own Postgres session, driven by Celery's event loop without blocking.

One connection per consuming transport carries the LISTEN wake-ups and the claims
(with the acks riding on them), one statement at a time: :meth:`Session.send` puts a
statement on the wire and returns; when the socket is readable, :meth:`Session.read`
collects notifications and, once the server has answered, the statement's rows. The
event loop never waits for a round trip, so it goes on feeding the pool and reading
results while a claim is out.

A notification is only ever a channel name. Postgres lets every role that can connect
LISTEN and NOTIFY on any channel, so all a consumer takes from one is its channel's name,
as a reason to claim the queue it names; what it then delivers comes from the rows it
claims. pgq's publishes send no payload: one with a payload was sent by someone else,
and is reported (at most once a minute) and dropped (:class:`Notifications`). The session
listens on the channels of the queues it consumes (:meth:`Session.send_listen`).

Rows come back as libpq's text values; the caller decodes the few columns it asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import psycopg
from psycopg import pq

from pg_transport.db import waits
from pg_transport.db.pool import Connector
from pg_transport.db.wire import Row, Statement, rows, send_buffered
from pg_transport.sql import compose_channel, load_queries

__all__ = ["Notifications", "Reply", "Row", "Session"]

logger = logging.getLogger("pg_transport.consume")

# Seconds between two warnings about notifications pgq did not send.
FOREIGN_WARN_INTERVAL = 60.0


class Notifications:
    """Takes the channel names out of a session's notifications, and reports the ones
    pgq cannot have sent (a payload)."""

    def __init__(self) -> None:
        self.foreign = 0
        self._reported = 0
        self._next_warning = 0.0

    def collect(self, pgconn: pq.abc.PGconn, into: set[str]) -> None:
        """Move what libpq has parsed so far into ``into`` (channel names)."""
        while (note := pgconn.notifies()) is not None:
            if note.extra:
                self.dropped(note.relname.decode("utf-8", "replace"))
                continue
            into.add(note.relname.decode("utf-8", "replace"))

    def dropped(self, channel: str) -> None:
        """A notification with a payload on ``channel``: not pgq's, counted and said."""
        self.foreign += 1
        now = monotonic()
        if now >= self._next_warning:
            self._next_warning = now + FOREIGN_WARN_INTERVAL
            logger.warning(
                "pgq: dropped %d notification(s) with a payload on channel %r: pgq sends "
                "none, so some other session is notifying its channels (any role that can "
                "connect may); they are ignored",
                self.foreign - self._reported,
                channel[:63],
            )
            self._reported = self.foreign


@dataclass
class Reply:
    """What one readable event brought: the channels notified and, when the statement
    in flight has finished, its rows."""

    notified: set[str] = field(default_factory=set)
    rows: list[Row] | None = None


class Session:
    """A dedicated session of the consumer: LISTEN plus one statement in flight."""

    def __init__(
        self,
        connector: Connector,
        schema: str,
        *,
        listen: bool,
        prepare: bool,
        relax: str | None = None,
    ) -> None:
        self.connector = connector
        self.schema = schema
        self.listen = listen
        # Behind a transaction pooler the server session is not ours between
        # statements: nothing may be prepared on it, and no setting lasts on it, so a
        # claim relaxes its own commit (``relax``, the claim's parameter, from
        # durable_acks) where the session would be relaxed on Postgres directly.
        self.prepare = prepare
        self.relax = relax
        self._queries = load_queries(schema)
        self._statements: dict[str, Statement] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self._notes = Notifications()
        self.busy = False
        #: Channels this session listens on (the LISTENs answered).
        self.listening: set[str] = set()
        self._listen_sent: set[str] = set()

    # -- lifecycle --------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def open(self) -> None:
        """Connect; idempotent."""
        if self.is_open:
            return
        conn = self.connector.connect()
        conn.pgconn.nonblocking = 1
        self._conn = conn
        self.busy = False
        self.listening = set()
        self._listen_sent = set()

    @property
    def backend_pid(self) -> int | None:
        """The server process of this session (for pg_terminate_backend), if open."""
        return self._conn.info.backend_pid if self.is_open and self._conn else None

    def fileno(self) -> int:
        assert self._conn is not None, "session not open"
        return self._conn.pgconn.socket

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self.busy = False
        self.listening = set()
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
        if self.relax is not None and "relax" in statement.params:
            params = {**params, "relax": self.relax}
        statement.send(conn, params, prepare=self.prepare)
        self._sent()

    def send_listen(self, channels: Iterable[str]) -> None:
        """LISTEN on ``channels``, as one statement; :attr:`listening` grows once it is
        answered. (Nothing is prepared: LISTEN takes no parameters.)"""
        assert not self.busy, "one statement at a time"
        conn = self._conn
        assert conn is not None, "session not open"
        wanted = sorted(set(channels))
        text = ";".join(
            compose_channel(self._queries["listen"], channel).as_string(conn) for channel in wanted
        )
        conn.pgconn.send_query(text.encode())
        self._listen_sent = set(wanted)
        self._sent()

    def _sent(self) -> None:
        self.busy = True
        # A claim is a few hundred bytes: the socket buffer takes it at once. Should
        # it not, wait until it is writable rather than leave half a message queued.
        assert self._conn is not None
        send_buffered(self._conn.pgconn)

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
        self._notes.collect(pgconn, reply.notified)
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
            self._notes.collect(pgconn, reply.notified)
            sent, self._listen_sent = self._listen_sent, set()
            if error is not None:
                raise error
            self.listening |= sent
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
            waits.readable((self.fileno(),), left)
            try:
                reply = self.read()
            except psycopg.Error:
                return None
            if reply.rows is not None:
                return reply
        return None
