"""Publishing many messages as one transaction: one commit, one WAL flush for all.

A durable publish returns once its commit is on disk, so one producer publishing one
message at a time waits for one WAL flush per message, however fast the rest is. Inside
``with pg_transport.batch():`` the publishes made through pgq by this thread (or
asyncio task: the open batch is a context variable) go into one transaction per broker
database instead, sent without waiting for their answers (psycopg's pipeline mode), and
the block's end commits them: every message is on disk when the block is left, none of
them before. A block left by an exception publishes nothing.

What a batch promises, and what it does not:

- Atomic per database: all of the block's messages or none. Messages for brokers in
  different databases (or schemas) are committed one database after another.
- Consumers see nothing of the batch before its commit; a task published in the block
  cannot be waited for inside it.
- A connection lost during the block, or while it commits, is replaced and the whole
  batch is sent again once (tenacity), from the copy the batch keeps of every statement:
  the publish keys (a message's delivery tag) make a resend after a commit that did land
  insert nothing twice, as for a single publish. (The dead letter kept for a message no
  queue was bound to receive has no key: such a resend may keep it twice.)
- A statement that fails (not a lost connection) fails the batch: the error is raised
  from the publish that meets it, or from the block's end (a pipelined publish's error
  arrives late), and nothing of the batch is committed.
- A batch opened inside another joins it: everything commits with the outermost block.
- The commit wakes the consumers: one NOTIFY per queue that got a message, sent with
  the commit.

The messages themselves are not sent one statement each: a batch keeps the rows it is
given (:meth:`Batch.add`) and writes them with one statement, a multi-row insert, when
the block ends, when :data:`ROWS_PER_STATEMENT` of them wait, or before any other
statement of the batch runs (so everything reaches the database in the order it was
published). A row Postgres refuses therefore fails the batch when they are written,
mostly at the block's end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.db.retry import ONCE, Policy, is_dead_connection
from pg_transport.db.retry import attempt as retry_attempt
from pg_transport.errors import NotPermitted

__all__ = ["ROWS_PER_STATEMENT", "Batch", "BatchFailed", "Op", "Rows", "batch", "current"]

logger = logging.getLogger("pg_transport.batching")

#: One statement of a batch: run on the batch's connection, inside its transaction.
Op = Callable[[psycopg.Connection[Any]], Any]

#: Writes rows of a batch (in the order given) with one statement on the connection.
Rows = Callable[[psycopg.Connection[Any], list[dict[str, Any]]], Any]

#: Most rows one statement of a batch writes (its arrays stay a few MB for Celery
#: messages of a few kB).
ROWS_PER_STATEMENT = 1000

_open: ContextVar[Batch | None] = ContextVar("pgq_batch", default=None)


class BatchFailed(psycopg.Error):
    """A statement of the batch failed earlier: nothing of it can be committed."""


def current() -> Batch | None:
    """The batch open in this context, if any."""
    return _open.get()


def batch() -> Batch:
    """A batch to use as a context manager: ``with pg_transport.batch(): ...``."""
    return Batch()


class Batch:
    """Publishes made while it is open, one transaction per database (:class:`_Part`)."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str, bool], _Part] = {}
        self._token: Token[Batch | None] | None = None
        self._joined: Batch | None = None
        self._entered = False

    @property
    def statements(self) -> int:
        """What the batch holds so far: a message per publish (sent or waiting to be
        written with others), a statement per routed publish or other work."""
        return sum(part.size for part in self._parts.values())

    def __enter__(self) -> Batch:
        if self._entered:
            raise RuntimeError("a pgq batch can be used for one with-block only")
        self._entered = True
        outer = _open.get()
        if outer is not None:
            self._joined = outer
            return outer
        self._token = _open.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._joined is not None:
            return  # the outermost block commits, or abandons, everything
        assert self._token is not None
        _open.reset(self._token)
        if exc_type is not None:
            self.abandon()
            return
        self.commit()

    @contextlib.contextmanager
    def open(self) -> Iterator[Batch]:
        """This batch as the one open in this context while the block runs (kombu's
        ``Producer.batch()`` publishes through it one message at a time); an outer
        batch already open stays the one publishes join."""
        if _open.get() is not None:
            yield self
            return
        token = _open.set(self)
        try:
            yield self
        finally:
            _open.reset(token)

    def commit(self) -> None:
        """Commit everything published so far (one transaction per database); the
        batch can then take more, for a commit of their own."""
        parts, self._parts = list(self._parts.values()), {}
        try:
            for part in parts:
                part.commit()
        except BaseException:
            for part in parts:
                part.abandon()  # (those not committed yet; a committed one is left alone)
            raise

    def abandon(self) -> None:
        """Roll back everything published and not committed yet."""
        parts, self._parts = list(self._parts.values()), {}
        for part in parts:
            part.abandon()

    def run(self, key: tuple[str, str, bool], connector: Connector, op: Op) -> Any:
        """Run ``op`` in the transaction of the database ``key`` names (conninfo, schema,
        whether commits wait for their flush), opened on ``connector`` at its first
        statement; ``op``'s result."""
        return self._part(key, connector).run(op)

    def add(
        self, key: tuple[str, str, bool], connector: Connector, write: Rows, row: dict[str, Any]
    ) -> None:
        """Keep ``row`` for the transaction of the database ``key`` names, to be written
        by ``write`` together with the rows given after it (the same ``write``) in one
        statement: at the block's end, once :data:`ROWS_PER_STATEMENT` wait, or before
        the next other statement of that transaction."""
        self._part(key, connector).add(write, row)

    def _part(self, key: tuple[str, str, bool], connector: Connector) -> _Part:
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = _Part(connector)
        return part


class _Part:
    """The batch's transaction on one database: a pooled connection in pipeline mode
    with a transaction open, and every statement sent on it, to send again."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector
        self.ops: list[Op] = []
        #: Messages and statements given so far, written or waiting.
        self.size = 0
        #: Rows given and not written yet, and what writes them.
        self._rows: list[dict[str, Any]] = []
        self._write: Rows | None = None
        self._stack: contextlib.ExitStack | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._failed: BaseException | None = None
        self._done = False

    def add(self, write: Rows, row: dict[str, Any]) -> None:
        if self._failed is not None:
            raise BatchFailed(f"an earlier statement of this batch failed: {self._failed}")
        if self._write is not None and self._write != write:
            self._write_rows()
        self._write = write
        self._rows.append(row)
        self.size += 1
        if len(self._rows) >= ROWS_PER_STATEMENT:
            self._write_rows()

    def _write_rows(self) -> None:
        """The rows waiting, written by one statement of the batch."""
        rows, write = self._rows, self._write
        self._rows, self._write = [], None
        if rows and write is not None:
            self._send(lambda conn: write(conn, rows))

    def run(self, op: Op) -> Any:
        self._write_rows()
        self.size += 1
        return self._send(op)

    def _send(self, op: Op) -> Any:
        if self._failed is not None:
            raise BatchFailed(f"an earlier statement of this batch failed: {self._failed}")
        self.ops.append(op)
        if self._conn is not None:
            try:
                return op(self._conn)
            except BaseException as exc:
                if not is_dead_connection(exc, self._conn):
                    self._fail(exc)
                    raise
                self._drop(exc)
        try:
            return self._resend()
        except BaseException:
            # Not in the batch: the caller was told it failed (kombu may publish it
            # again, as a message of its own).
            self.ops.pop()
            raise

    def commit(self) -> None:
        self._write_rows()
        if self._failed is not None:
            raise BatchFailed(f"an earlier statement of this batch failed: {self._failed}")
        if self._conn is None:  # the first statement's connection failed twice
            self._resend()
        try:
            self._close()
        except BaseException as exc:
            if not is_dead_connection(exc):
                self._fail(exc)
                if isinstance(exc, psycopg.errors.InsufficientPrivilege):
                    # A pipelined publish's refusal arrives here, not at the publish.
                    raise NotPermitted(
                        "a publish of this batch was refused: "
                        f"{exc.diag.message_primary or exc} (see docs/least-privilege.md); "
                        "nothing of the batch was published"
                    ) from exc
                raise
            # Lost while committing: whether the commit landed is unknown. The publish
            # keys make sending everything again safe either way.
            logger.warning("pgq: connection lost committing a batch, sending it again")
            self._resend(commit=True)
        self._done = True

    def abandon(self) -> None:
        self._rows, self._write = [], None
        if self._done or self._stack is None:
            return
        self._drop(_Abandoned())
        self._done = True

    def _resend(self, *, commit: bool = False) -> Any:
        """Every statement so far on a fresh connection, in a new transaction (and its
        commit): once more after a lost connection (tenacity)."""

        def attempt() -> Any:
            self._begin()
            assert self._conn is not None
            try:
                result = None
                for op in self.ops:
                    result = op(self._conn)
                if commit:
                    self._close()
                return result
            except BaseException as exc:
                if not is_dead_connection(exc, self._conn):
                    self._fail(exc)
                    raise
                self._drop(exc)
                raise

        # Resent once, as ONCE does, unless a statement of the batch itself failed.
        resend = Policy(
            "batch", lambda exc: self._failed is None and is_dead_connection(exc), ONCE.make
        )
        return retry_attempt(resend, attempt)

    def _begin(self) -> None:
        stack = contextlib.ExitStack()
        try:
            conn = stack.enter_context(self.connector.connection())
            stack.enter_context(conn.pipeline())
            stack.enter_context(conn.transaction())
        except BaseException as exc:
            # (the connector sees why: a dead connection's idle siblings are dropped too)
            with contextlib.suppress(psycopg.Error):
                stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._stack, self._conn = stack, conn

    def _close(self) -> None:
        """Commit the transaction and give the connection back (the commit's, or a
        pipelined statement's, error raised)."""
        stack, self._stack, self._conn = self._stack, None, None
        if stack is not None:
            stack.close()

    def _drop(self, exc: BaseException) -> None:
        """Roll back what is open (if the connection still answers) and let it go."""
        stack, self._stack, self._conn = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(psycopg.Error):
                stack.__exit__(type(exc), exc, exc.__traceback__)

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self._drop(exc)


class _Abandoned(Exception):
    """Passed to the batch's transaction to roll it back."""
