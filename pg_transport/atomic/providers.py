"""Where an atomic task's transaction comes from, and how it begins and ends.

The Celery setting ``pgq_atomic_connection`` (per task: the class attribute
``atomic_connection``; env ``PGQ_ATOMIC_CONNECTION``, an import path) says:

* ``None`` (the default): a connection of pgq's own per thread (per greenlet under
  gevent, per child under prefork) on ``pgq_atomic_url`` (default: the broker URL),
  opened lazily and kept across runs;
* ``"django"`` or ``"django:<alias>"``: Django's connection of that alias, in
  ``transaction.atomic(using=alias)``;
* a callable, or ``"module:attr"`` naming one: called once a run, it returns a psycopg 3
  ``Connection``, a SQLAlchemy ``Session``, ``Connection`` or ``sessionmaker``
  (``postgresql+psycopg``).

Each becomes a :class:`Handle`: the psycopg connection under it, and the begin,
savepoint, commit and rollback of the framework that owns it (an ORM's session must
see its own transaction end, or it flushes rolled-back objects at the next commit).
Whatever is handed over must be idle (no transaction open): pgq begins the one it
commits.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import psycopg

from pg_transport.config import Options
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.errors import ConfigurationError, TransactionRefused
from pg_transport.publish.callers import ACCEPTED

__all__ = ["Handle", "handle_for", "provider_of"]

#: The setting, the task attribute and the environment variable naming the provider.
SETTING = "pgq_atomic_connection"
URL_SETTING = "pgq_atomic_url"
ENV = "PGQ_ATOMIC_CONNECTION"
#: The body's start, on a psycopg connection (rolled back to by a failure or a retry).
SAVEPOINT = "SAVEPOINT pgq_body"


class Handle(Protocol):
    """One run's transaction on an application's connection."""

    #: Names the connection in errors.
    describe: str
    #: What ``pg_transport.transaction()`` is given to publish in the run.
    target: Any

    def begin(self) -> psycopg.Connection[Any]:
        """Begin the run's transaction; the psycopg connection it is on."""

    def savepoint(self) -> None:
        """Mark the body's start."""

    def rollback_body(self) -> None:
        """Undo what the body did since :meth:`savepoint`; the transaction goes on."""

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def close(self) -> None:
        """Give back what the run borrowed (after commit or rollback; never raises)."""


def _idle(conn: psycopg.Connection[Any], describe: str) -> psycopg.Connection[Any]:
    if conn.closed or conn.info.transaction_status == psycopg.pq.TransactionStatus.UNKNOWN:
        raise TransactionRefused(f"pgq cannot run an atomic task on {describe}: it is closed")
    if conn.autocommit:
        raise TransactionRefused(
            f"pgq cannot run an atomic task on {describe}: it is in autocommit mode, so "
            "the task's writes would commit one by one, apart from the end of its "
            "delivery; hand over a connection with autocommit off"
        )
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise TransactionRefused(
            f"pgq cannot run an atomic task on {describe}: a transaction is already open "
            "on it; pgq begins the one it commits (hand over an idle connection)"
        )
    return conn


class PsycopgHandle:
    """A psycopg 3 connection with autocommit off: its transaction begins with the first
    statement, and pgq commits or rolls it back."""

    def __init__(self, conn: psycopg.Connection[Any], describe: str) -> None:
        self.conn, self.describe, self.target = conn, describe, conn

    def begin(self) -> psycopg.Connection[Any]:
        return _idle(self.conn, self.describe)

    def savepoint(self) -> None:
        self.conn.execute(SAVEPOINT, prepare=False)

    def rollback_body(self) -> None:
        self.conn.execute("ROLLBACK TO SAVEPOINT pgq_body", prepare=False)

    def commit(self) -> None:
        self.conn.commit()

    def rollback(self) -> None:
        if not self.conn.closed:
            self.conn.rollback()

    def close(self) -> None:
        pass


class SqlAlchemyHandle:
    """A SQLAlchemy ``Session`` or ``Connection`` (``postgresql+psycopg``): its own
    transaction and nested transaction, so the ORM forgets what a rollback undid."""

    def __init__(self, target: Any, *, owned: bool) -> None:
        from sqlalchemy.orm import Session

        self.target, self._owned = target, owned
        self._session = isinstance(target, Session)
        bind = target.get_bind() if self._session else target
        dialect = bind.dialect
        kind = "Session" if self._session else "Connection"
        self.describe = f"the SQLAlchemy {kind} ({dialect.name}+{dialect.driver})"
        if (dialect.name, dialect.driver) != ("postgresql", "psycopg"):
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {self.describe}: it runs on {ACCEPTED}"
            )
        self._txn: Any = None
        self._nested: Any = None

    def begin(self) -> psycopg.Connection[Any]:
        if self.target.in_transaction():
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {self.describe}: a transaction is "
                "already open on it; pgq begins the one it commits"
            )
        self._txn = self.target.begin()
        connection = self.target.connection() if self._session else self.target
        raw = connection.connection.driver_connection
        if not isinstance(raw, psycopg.Connection):
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {self.describe}: its driver connection "
                f"is a {type(raw).__qualname__}; it runs on {ACCEPTED}"
            )
        return raw

    def savepoint(self) -> None:
        self._nested = self.target.begin_nested()

    def rollback_body(self) -> None:
        if self._nested is not None and self._nested.is_active:
            self._nested.rollback()
        self._nested = None

    def commit(self) -> None:
        self._txn.commit()

    def rollback(self) -> None:
        if self._txn is not None and self._txn.is_active:
            self._txn.rollback()

    def close(self) -> None:
        if self._owned:
            with contextlib.suppress(Exception):  # changes nothing committed
                self.target.close()


class DjangoHandle:
    """Django's connection of an alias, the run in ``transaction.atomic(using=alias)``."""

    def __init__(self, alias: str) -> None:
        from django.db import connections

        self.alias = alias
        self.target = connections[alias]
        self.describe = f"Django's connection {alias!r}"
        driver = getattr(getattr(self.target, "Database", None), "__name__", "?")
        if self.target.vendor != "postgresql" or driver != "psycopg":
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {self.describe} (backend "
                f"{self.target.vendor!r}, driver {driver!r}): it runs on {ACCEPTED}"
            )
        self._atomic: Any = None
        self._sid: Any = None

    def begin(self) -> psycopg.Connection[Any]:
        from django.db import transaction

        if self.target.in_atomic_block:
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {self.describe}: it is already inside "
                "transaction.atomic(); pgq begins the transaction it commits"
            )
        self.target.close_if_unusable_or_obsolete()
        self._atomic = transaction.atomic(using=self.alias)
        self._atomic.__enter__()
        self.target.ensure_connection()
        raw = self.target.connection
        if not isinstance(raw, psycopg.Connection):
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {self.describe}: its driver connection "
                f"is a {type(raw).__qualname__}; it runs on {ACCEPTED}"
            )
        return raw

    def savepoint(self) -> None:
        from django.db import transaction

        self._sid = transaction.savepoint(using=self.alias)

    def rollback_body(self) -> None:
        from django.db import transaction

        if self._sid is not None:
            transaction.savepoint_rollback(self._sid, using=self.alias)
            transaction.set_rollback(False, using=self.alias)
        self._sid = None

    def _end(self, exc: BaseException | None) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.__exit__(type(exc) if exc else None, exc, None)

    def commit(self) -> None:
        self._end(None)

    def rollback(self) -> None:
        self._end(_RolledBack("the run rolled back"))

    def close(self) -> None:
        pass


class _RolledBack(Exception):
    """Given to ``atomic.__exit__`` to make it roll back."""


class OwnConnection:
    """pgq's own connection of this thread (greenlet, child) for atomic runs.

    ``prepare``: whether the statements run on it are prepared after a few runs
    (psycopg's ``prepare_threshold``, 5, as on any psycopg connection by default): the
    task's SQL, like a plain task's on its own connection, is then parsed and planned
    once per session instead of on every run. Only where pgq has sessions of its own on
    that server (the broker's URL with ``use_notify`` on: no transaction pooler in
    between, the rule of the result backend's sessions); behind a pooler nothing is
    prepared."""

    def __init__(self, url: str, *, prepare: bool = False) -> None:
        self.connector = Connector(
            url_to_conninfo(url),
            application_name="pgq-atomic",
            # The task's own SQL runs here: its role's search_path, not pgq's pinned one
            # (pgq's statements name every object by schema).
            pin_search_path=False,
            prepare_threshold=5 if prepare else None,
        )
        self._local = threading.local()

    def handle(self) -> PsycopgHandle:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        pid: int | None = getattr(self._local, "pid", None)
        if conn is None or pid != os.getpid() or conn.closed or conn.broken:
            conn = self.connector.connect(autocommit=False)
            self._local.conn, self._local.pid = conn, os.getpid()
        elif conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()  # a run cut short (an internal error) left it open
        return PsycopgHandle(conn, f"pgq's atomic connection to {self.connector.display_url}")


_own: dict[str, OwnConnection] = {}
_own_lock = threading.Lock()


def _own_for(url: str, prepare: Callable[[], bool]) -> OwnConnection:
    with _own_lock:
        found = _own.get(url)
        if found is None:
            found = _own[url] = OwnConnection(url, prepare=prepare())
        return found


def _prepares(conf: Any) -> bool:
    """Whether pgq's own atomic connection may prepare (:class:`OwnConnection`): it is
    on the broker's URL (not a ``pgq_atomic_url`` of its own, whatever is behind that)
    and the broker has sessions of its own there (``use_notify``)."""
    if conf.get(URL_SETTING):
        return False
    return Options.from_sources(conf.broker_transport_options, os.environ).use_notify


#: Where an app's atomic runs find their transaction (its ``pgq_atomic_connection`` or
#: the environment's, and pgq's own connection on its URL), kept on the app object per
#: process: read at the app's first atomic run there, as the broker's own settings are
#: (run.py ``_broker_of``). Celery's settings cost microseconds a read, four a run; like
#: the rest of a worker's configuration, they are set before the worker starts.
_APP_ATTR = "_pgq_atomic_provider"


class _AppProvider:
    def __init__(self, app: Any) -> None:
        self.pid = os.getpid()
        self.conf = app.conf
        value = self.conf.get(SETTING)
        if value is None:
            value = os.environ.get(ENV) or None
        if isinstance(value, str) and not (value == "django" or value.startswith("django:")):
            value = _import(value)
        self.value: Any = value
        self._own: OwnConnection | None = None

    def own(self) -> OwnConnection:
        if self._own is None:
            conf = self.conf
            url = conf.get(URL_SETTING) or conf.broker_write_url or conf.broker_url
            if not isinstance(url, str):
                raise ConfigurationError(f"{URL_SETTING} or broker_url must be a pgq:// URL")
            self._own = _own_for(url.split(";")[0], lambda: _prepares(conf))
        return self._own


def _app_provider(app: Any) -> _AppProvider:
    kept: _AppProvider | None = getattr(app, _APP_ATTR, None)
    if kept is None or kept.pid != os.getpid():
        kept = _AppProvider(app)
        setattr(app, _APP_ATTR, kept)
    return kept


def provider_of(task: Any) -> Any:
    """What names ``task``'s transaction: its ``atomic_connection``, else the app's
    setting, else the environment (None: pgq's own connection)."""
    value = getattr(task, "atomic_connection", None)
    if value is None:
        value = _app_provider(task.app).value
    return value


def handle_for(task: Any) -> Handle:
    """The run's :class:`Handle` for ``task``. A bad provider is a ConfigurationError;
    a connection pgq cannot run on, TransactionRefused."""
    value = getattr(task, "atomic_connection", None)
    if value is None:
        provider = _app_provider(task.app)
        value = provider.value
        if value is None:
            return provider.own().handle()
    if isinstance(value, str) and (value == "django" or value.startswith("django:")):
        return DjangoHandle(value.partition(":")[2] or "default")
    if isinstance(value, str):
        value = _import(value)
    if not callable(value):
        raise ConfigurationError(
            f"{SETTING} must be None, 'django[:alias]', a callable or 'module:attr' naming "
            f"one, not {value!r}"
        )
    return _wrap(value())


def _import(path: str) -> Callable[[], Any]:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigurationError(f"{SETTING} {path!r} is not 'module:attr'")
    try:
        found: Any = importlib.import_module(module)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"{SETTING} {path!r} cannot be imported: {exc}") from exc
    return found  # type: ignore[no-any-return]


def _wrap(given: Any) -> Handle:
    if isinstance(given, psycopg.Connection):
        info = given.info
        where = f"database {info.dbname!r} at {info.host}:{info.port}"
        return PsycopgHandle(given, f"the psycopg connection to {where}")
    if "sqlalchemy" in sys.modules:
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session, sessionmaker

        if isinstance(given, sessionmaker):
            return SqlAlchemyHandle(given(), owned=True)
        if isinstance(given, (Session, Connection)):
            return SqlAlchemyHandle(given, owned=False)
    kind = f"{type(given).__module__}.{type(given).__qualname__}"
    raise TransactionRefused(f"pgq cannot run an atomic task on a {kind}: it runs on {ACCEPTED}")
