"""The connection of an atomic task's run, while one is open in this context.

An :class:`~pg_transport.AtomicTask` runs its body, stores its result, counts its chord
part and publishes its follow-up tasks in one transaction, which also deletes its
message (docs/design/exactly-once.md). The result backend and the chord code ask here
for that transaction's connection: a result stored while a run is open goes there and
commits (or rolls back) with the run. A context variable: per thread, per greenlet
(gevent), per asyncio task.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

import psycopg

__all__ = ["connection", "enter", "leave"]

_open: ContextVar[psycopg.Connection[Any] | None] = ContextVar("pgq_completing", default=None)


def connection() -> psycopg.Connection[Any] | None:
    """The open run's connection, in its transaction; None outside an atomic run."""
    return _open.get()


def enter(conn: psycopg.Connection[Any]) -> Token[psycopg.Connection[Any] | None]:
    """Open a run on ``conn`` in this context; :func:`leave` with the token ends it."""
    return _open.set(conn)


def leave(token: Token[psycopg.Connection[Any] | None]) -> None:
    _open.reset(token)
