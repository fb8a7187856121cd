"""The application's handles on a Postgres transaction, each as a psycopg connection.

pgq publishes in an application's transaction through the psycopg 3 connection under
it. An application holds that transaction as one of three things: a psycopg
``Connection``, a SQLAlchemy ``Connection`` or ``Session`` (``postgresql+psycopg``), or a
Django connection (the ``postgresql`` backend on psycopg 3). :func:`caller_for` turns one
of them into a :class:`Caller`, which is asked for the connection at each publish (a
SQLAlchemy session may have moved to another pooled connection since the last one).

Anything else (another driver, an asyncio connection, another kind of object) is
refused at once with :class:`~pg_transport.errors.TransactionRefused`. SQLAlchemy and
Django are looked for only if the application imported them: pgq depends on neither.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from pg_transport.errors import TransactionRefused

__all__ = ["Caller", "caller_for", "ready"]

#: What pgq can publish through, as said in its refusals.
ACCEPTED = (
    "a psycopg 3 Connection, a SQLAlchemy Connection or Session on the psycopg driver "
    "(postgresql+psycopg), or a Django connection on the psycopg 3 backend"
)


@dataclass(frozen=True)
class Caller:
    """An application's transaction: ``describe`` names it in errors, ``connection()``
    returns the psycopg connection its transaction is on now, ready for a statement."""

    describe: str
    connection: Callable[[], psycopg.Connection[Any]]


def caller_for(target: Any) -> Caller:
    """The :class:`Caller` for ``target``; :class:`TransactionRefused` for anything pgq
    cannot publish through."""
    if isinstance(target, psycopg.Connection):
        return _psycopg(target)
    sqlalchemy = _sqlalchemy(target)
    if sqlalchemy is not None:
        return sqlalchemy
    django = _django(target)
    if django is not None:
        return django
    kind = f"{type(target).__module__}.{type(target).__qualname__}"
    raise TransactionRefused(
        f"pgq cannot publish in the transaction of a {kind}: it publishes through {ACCEPTED}"
    )


def ready(conn: psycopg.Connection[Any], describe: str) -> psycopg.Connection[Any]:
    """``conn`` if a statement sent on it now runs inside the application's transaction.

    Refused: a closed connection, a failed transaction, and an autocommit connection
    with no transaction open (the message would commit at once, apart from the work it
    is about). A connection that is not in autocommit mode begins its transaction with
    the statement, which the application then commits or rolls back as always."""
    if conn.closed:
        raise TransactionRefused(f"pgq cannot publish on {describe}: the connection is closed")
    status = conn.info.transaction_status
    if status == psycopg.pq.TransactionStatus.UNKNOWN:
        raise TransactionRefused(f"pgq cannot publish on {describe}: the connection is closed")
    if status == psycopg.pq.TransactionStatus.INERROR:
        raise TransactionRefused(
            f"pgq cannot publish on {describe}: its transaction has failed (an earlier "
            "statement raised); roll it back"
        )
    if status == psycopg.pq.TransactionStatus.IDLE and conn.autocommit:
        raise TransactionRefused(
            f"pgq cannot publish on {describe}: it is in autocommit mode with no "
            "transaction open, so the message would commit at once, apart from the work "
            "it is about; open a transaction first (psycopg: `with conn.transaction():`)"
        )
    return conn


def _psycopg(conn: psycopg.Connection[Any]) -> Caller:
    describe = f"the psycopg connection to {_where(conn)}"
    return Caller(describe, lambda: ready(conn, describe))


def _where(conn: psycopg.Connection[Any]) -> str:
    try:
        info = conn.info
        return f"database {info.dbname!r} at {info.host}:{info.port}"
    except psycopg.Error:  # closed: libpq no longer says
        return "a closed connection"


def _driver_connection(raw: Any, describe: str) -> psycopg.Connection[Any]:
    if isinstance(raw, psycopg.AsyncConnection):
        raise TransactionRefused(
            f"pgq cannot publish on {describe}: it is an asyncio connection, and pgq "
            "publishes (as Celery and kombu do) on a synchronous one"
        )
    if not isinstance(raw, psycopg.Connection):
        kind = f"{type(raw).__module__}.{type(raw).__qualname__}"
        raise TransactionRefused(
            f"pgq cannot publish on {describe}: its driver connection is a {kind}, and "
            f"pgq publishes through {ACCEPTED}"
        )
    return raw


# --- SQLAlchemy ---------------------------------------------------------------


def _sqlalchemy(target: Any) -> Caller | None:
    if "sqlalchemy" not in sys.modules:
        return None
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, scoped_session

    if isinstance(target, scoped_session):
        target = target()
    if isinstance(target, Session):
        session = target
        describe = f"the SQLAlchemy Session ({_dialect(session.get_bind().dialect)})"
        _check_dialect(session.get_bind().dialect, describe)
        # session.connection() begins the session's transaction if none is, and is the
        # connection of the one in progress: asked anew at each publish.
        return Caller(describe, lambda: _sqlalchemy_conn(session.connection(), describe))
    if isinstance(target, Connection):
        connection = target
        describe = f"the SQLAlchemy Connection ({_dialect(connection.dialect)})"
        _check_dialect(connection.dialect, describe)
        return Caller(describe, lambda: _sqlalchemy_conn(connection, describe))
    return None


def _dialect(dialect: Any) -> str:
    return f"{dialect.name}+{dialect.driver}"


def _check_dialect(dialect: Any, describe: str) -> None:
    if (dialect.name, dialect.driver) != ("postgresql", "psycopg"):
        raise TransactionRefused(
            f"pgq cannot publish in {describe}: it publishes through {ACCEPTED} "
            f"(create_engine('postgresql+psycopg://...'))"
        )


def _sqlalchemy_conn(connection: Any, describe: str) -> psycopg.Connection[Any]:
    if connection.closed:
        raise TransactionRefused(f"pgq cannot publish in {describe}: it is closed")
    if not connection.in_transaction():
        # What SQLAlchemy's own autobegin does at the Connection's next statement: the
        # application's commit() or rollback() then ends the message with its work.
        connection.begin()
    raw = _driver_connection(connection.connection.driver_connection, describe)
    return ready(raw, describe)


# --- Django -------------------------------------------------------------------


def _django(target: Any) -> Caller | None:
    if "django" not in sys.modules:
        return None
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if not isinstance(target, (BaseDatabaseWrapper, ConnectionProxy)):
        return None
    wrapper: Any = target  # a proxy stands for this thread's connection of its alias
    describe = f"Django's connection {wrapper.alias!r}"
    driver = getattr(getattr(wrapper, "Database", None), "__name__", "?")
    if wrapper.vendor != "postgresql" or driver != "psycopg":
        raise TransactionRefused(
            f"pgq cannot publish in {describe} (backend {wrapper.vendor!r}, driver "
            f"{driver!r}): it publishes through {ACCEPTED}"
        )
    return Caller(describe, lambda: django_connection(wrapper, describe))


def django_connection(wrapper: Any, describe: str) -> psycopg.Connection[Any]:
    """The psycopg connection of a Django connection inside ``transaction.atomic()``."""
    if wrapper.get_autocommit():
        raise TransactionRefused(
            f"pgq cannot publish in {describe} outside transaction.atomic(): the message "
            "would commit at once, apart from the work it is about"
        )
    wrapper.validate_no_broken_transaction()  # Django's own error, as for a query
    wrapper.ensure_connection()
    return ready(_driver_connection(wrapper.connection, describe), describe)
