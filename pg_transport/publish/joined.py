"""Publishing in the application's own transaction: a message exists if and only if the
work it is about committed.

Inside ``with pg_transport.transaction(conn):`` (a psycopg connection, a SQLAlchemy
Connection or Session, a Django connection: :mod:`~pg_transport.publish.callers`) every
publish pgq makes in this thread (or asyncio task: the open block is a context
variable) is written through that connection, in its transaction as it stands: it is
visible to consumers when the application commits, gone when it rolls back (a rolled
back savepoint takes the messages published inside it), and its consumers are woken by
the commit (a NOTIFY is transactional). Outside such a block publishing is as before.

A transaction can also be joined without a block: an integration (Django's
``transaction.atomic()``, :mod:`pg_transport.integrations.django`) registers a *joiner*,
asked at each publish made outside a block for the transaction open there.

Messages must be written where the broker reads them: a transaction on another database
or server than the broker's is refused (:class:`~pg_transport.errors.TransactionRefused`,
naming both), never published apart. "The same" is the same database of the same
running server: the cluster's system identifier, its start time and the database name
(:class:`Server`), which hold whatever path a session took there (a socket, TCP, a
pooler such as PgBouncer, another host name).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row

from pg_transport.db.pool import Connector
from pg_transport.db.retry import is_dead_connection
from pg_transport.errors import NotPermitted, TransactionRefused
from pg_transport.publish.callers import Caller, caller_for

__all__ = [
    "Joined",
    "Server",
    "current",
    "join",
    "leave",
    "note_published",
    "on_caller",
    "transaction",
    "uncommitted",
]

T = TypeVar("T")

#: Asked, in order, for the caller's transaction of a publish made outside a block.
Joiner = Callable[[], Caller | None]

_open: ContextVar[Joined | None] = ContextVar("pgq_joined", default=None)
_joiners: list[Joiner] = []


def transaction(target: Any) -> Joined:
    """Publish in ``target``'s transaction while the block is open:
    ``with pg_transport.transaction(conn): task.delay()``.

    ``target`` is a psycopg 3 ``Connection``, a SQLAlchemy ``Connection`` or ``Session``
    (``postgresql+psycopg``) or a Django connection (``django.db.connection``); anything
    else is refused here, at once. The block neither begins nor ends the transaction:
    the application commits or rolls back as it always does, and its messages with it.
    """
    return Joined(caller_for(target))


class Joined:
    """An open ``pg_transport.transaction()`` block (one with-block per object)."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self._token: Token[Joined | None] | None = None
        self._entered = False
        #: Task ids published in this block: none of them can run before its commit.
        self.task_ids: set[str] = set()
        self._outer: Joined | None = None

    def __enter__(self) -> Joined:
        if self._entered:
            raise RuntimeError("a pgq transaction block can be used for one with-block only")
        self._entered = True
        self._outer = _open.get()
        self._token = _open.set(self)  # a block inside another publishes in its own
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._token is not None
        _open.reset(self._token)
        # (What an inner block published is forgotten as it ends: its transaction may
        # commit without the outer block's, so only open blocks are asked.)


def note_published(payload: Any) -> None:
    """Remember the task id of a message just published in the open block, if any."""
    block = _open.get()
    if block is None or not isinstance(payload, dict):
        return
    headers = payload.get("headers")
    task_id = headers.get("id") if isinstance(headers, dict) else None
    if isinstance(task_id, str):
        block.task_ids.add(task_id)


def uncommitted(task_id: str) -> Caller | None:
    """The caller whose open block (in this thread or task) published ``task_id``."""
    block = _open.get()
    while block is not None:
        if task_id in block.task_ids:
            return block.caller
        block = block._outer
    return None


def current() -> Caller | None:
    """The application's transaction a publish made now joins: the innermost open
    block's, else the first a joiner finds; None: publish as pgq does by itself."""
    joined = _open.get()
    if joined is not None:
        return joined.caller
    for joiner in tuple(_joiners):
        found = joiner()
        if found is not None:
            return found
    return None


def join(joiner: Joiner) -> None:
    """Ask ``joiner`` at every publish made outside a block (once, however often)."""
    if joiner not in _joiners:
        _joiners.append(joiner)


def leave(joiner: Joiner) -> None:
    """Stop asking ``joiner``."""
    if joiner in _joiners:
        _joiners.remove(joiner)


@dataclass(frozen=True)
class Server:
    """Which database of which running server a session is on (the
    ``server_identity`` query); ``host`` and ``port`` only name it in errors."""

    system_identifier: str
    started: str
    database: str
    host: str | None
    port: int | None

    def same_database(self, other: Server) -> bool:
        return (self.system_identifier, self.started, self.database) == (
            other.system_identifier,
            other.started,
            other.database,
        )

    def describe(self) -> str:
        where = f"{self.host}:{self.port}" if self.host else "a local socket"
        return (
            f"database {self.database!r} of the server at {where} (system identifier "
            f"{self.system_identifier}, started {self.started})"
        )


# A session's server cannot change under it; a broker's can (a restart, a failover),
# so a mismatch looks the broker's up again before refusing.
_callers: weakref.WeakKeyDictionary[psycopg.Connection[Any], Server] = weakref.WeakKeyDictionary()
_brokers: dict[str, Server] = {}
_lock = threading.Lock()


def _server_on(conn: psycopg.Connection[Any], query: str) -> Server:
    # A cursor of pgq's own: the application may have set its connection's row or
    # cursor factory. Not prepared: the session may be a transaction pooler's.
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        row = cur.execute(query, prepare=False).fetchone()
    assert row is not None
    return Server(str(row[0]), str(row[1]), str(row[2]), row[3], row[4])


def on_caller(
    caller: Caller,
    broker: Connector,
    schema: str,
    identify: str,
    work: Callable[[psycopg.Connection[Any]], T],
) -> T:
    """Run ``work`` on the caller's connection, in its transaction, once it is known to
    be on the database of ``broker`` (``identify``: the ``server_identity`` query).

    A caller's connection lost on the way fails the publish with
    :class:`TransactionRefused` (the transaction it was in is gone, and kombu must not
    take it for the broker's connection and publish again elsewhere)."""
    conn = caller.connection()
    with _lock:
        theirs = _callers.get(conn)
    if theirs is None:
        try:
            theirs = _on(caller, conn, lambda c: _server_on(c, identify))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise NotPermitted(
                f"pgq cannot tell which server {caller.describe} is on: its role may not "
                f"call pg_catalog.pg_control_system() ({exc}), which every role may by "
                "default; grant EXECUTE on it back"
            ) from exc
        with _lock:
            _callers[conn] = theirs
    ours = _brokers.get(broker.conninfo)
    if ours is None or not ours.same_database(theirs):
        ours = broker.run(lambda own: _server_on(own, identify), idempotent=True)
        _brokers[broker.conninfo] = ours
    if not ours.same_database(theirs):
        raise TransactionRefused(
            f"pgq cannot publish in {caller.describe}: it is on {theirs.describe()}, "
            f"and the broker {broker.display_url} (schema {schema!r}) is on "
            f"{ours.describe()}. A message is written where the broker reads it, in "
            "the same transaction as the work it is about: open the transaction on "
            "the broker's database, or publish outside it"
        )
    try:
        return _on(caller, conn, work)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise NotPermitted(
            f"pgq cannot publish in {caller.describe}: its role may not write to pgq's "
            f"schema {schema!r} ({exc}); give it a publisher's rights "
            "(docs/least-privilege.md: GRANT pgq_publisher TO the application's role)"
        ) from exc


def _on(
    caller: Caller, conn: psycopg.Connection[Any], work: Callable[[psycopg.Connection[Any]], T]
) -> T:
    try:
        return work(conn)
    except psycopg.Error as exc:
        if is_dead_connection(exc, conn):
            raise TransactionRefused(
                f"pgq could not publish in {caller.describe}: its connection was lost "
                f"({exc}); the transaction is gone, and nothing was published"
            ) from exc
        if isinstance(exc, psycopg.OperationalError):
            # (a lock or statement timeout, a cancel): kombu would take the error for
            # its own connection's, reconnect and publish again, into a failed transaction.
            raise TransactionRefused(
                f"pgq could not publish in {caller.describe}: {exc}; the transaction has "
                "failed with it: roll it back (and retry it whole)"
            ) from exc
        raise
