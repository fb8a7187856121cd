"""A pytest plugin for testing a Celery app on pgq: ``pytest_plugins = ["pg_transport.testing"]``.

Fixtures (docs/testing.md):

- ``pgq_server_url`` (session): a Postgres server the tests may create a database on:
  ``PGQ_TEST_URL`` (a ``postgresql://`` or ``pgq://`` URL of a role that may create
  databases), else an embedded server (``pip install 'celery-pgq[embedded]'``).
- ``pgq_database_url`` (session): a ``pgq://`` URL of a database made for this test run,
  dropped at its end (named ``pgq_test_<pid>_<id>``, the prefix ``PGQ_TEST_DB_PREFIX``).
- ``pgq_schema``: a schema name of its own for each test (created on first connect,
  dropped after the test), so tests never see each other's messages or results.
- ``pgq_celery_config``: Celery settings with pgq as broker and result backend on that
  schema; return it from your ``celery_config`` fixture to use Celery's own
  ``celery_app``/``celery_worker`` fixtures (``celery.contrib.pytest``) on pgq.
- ``pgq_app``: a Celery app on those settings, to define tasks on in a test.
- ``pgq_use``: ``pgq_use(app)`` points *your* app at the test's database and schema for
  the test (its settings are put back after).
- ``pgq_worker``: a worker for ``pgq_app`` running in a thread of the test process
  (Celery's ``start_worker``, threads pool), started before the test and stopped after.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from celery import Celery
from psycopg import sql

__all__ = [
    "pgq_app",
    "pgq_celery_config",
    "pgq_database_url",
    "pgq_schema",
    "pgq_server_url",
    "pgq_use",
    "pgq_worker",
]

_embedded: list[Any] = []


def libpq_url(url: str) -> str:
    """``url`` as libpq takes it (a ``pgq://`` URL made ``postgresql://``)."""
    return "postgresql://" + url.split("://", 1)[1] if "://" in url else url


def embedded_server(prefix: str = "pgq-testing-") -> str:
    """A libpq URL of a server started for this process (``celery-pgq[embedded]``), the
    same one on every call; it is deleted when the process ends."""
    if not _embedded:
        import pgserver  # the embedded fallback for machines without Postgres

        data_dir = tempfile.mkdtemp(prefix=prefix)
        server = pgserver.get_server(data_dir, cleanup_mode="delete")  # type: ignore[attr-defined]
        _embedded.append(server)
    return str(_embedded[0].get_uri())


# A run's database is named ``<prefix><pid>_<12 hex digits>``: the prefix
# (PGQ_TEST_DB_PREFIX, or the caller's default), then the server process id of the run's
# keeper connection, which created the database and stays open until the run drops it.
# A database so named whose keeper backend is gone belongs to a run that ended without
# dropping it (killed, interrupted twice): the next run's :func:`drop_abandoned_databases`
# drops it. Databases of live runs (keeper still connected) and databases named any other
# way are never touched.
DEFAULT_DB_PREFIX = "pgq_test_"
_POSTGRES_NAME_MAX = 63
_SUFFIX_MAX = len("_") + 12 + 10  # "_<hex>" and a pid of up to 10 digits


def database_prefix(default: str = DEFAULT_DB_PREFIX) -> str:
    """The name prefix of a run's database: PGQ_TEST_DB_PREFIX, else ``default``."""
    prefix = os.environ.get("PGQ_TEST_DB_PREFIX") or default
    if len(prefix.encode()) > _POSTGRES_NAME_MAX - _SUFFIX_MAX:
        raise ValueError(
            f"PGQ_TEST_DB_PREFIX {prefix!r} is too long: at most "
            f"{_POSTGRES_NAME_MAX - _SUFFIX_MAX} bytes, the session's pid and id follow it "
            f"within Postgres's {_POSTGRES_NAME_MAX}-byte names"
        )
    return prefix


def new_database_name(prefix: str, keeper_pid: int | None = None) -> str:
    """A run database's name: ``prefix``, the server pid of the connection that keeps it
    (0: none), an id of its own."""
    return f"{prefix}{keeper_pid or 0}_{uuid.uuid4().hex[:12]}"


def with_database(url: str, dbname: str) -> str:
    """``url`` (a libpq URL) naming database ``dbname`` instead."""
    parts = urlsplit(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "dbname"])
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe=""), query=query))


def abandoned_databases(server_url: str, prefix: str) -> list[str]:
    """Run databases named with ``prefix`` whose keeper backend is no longer connected.

    A keeper pid another backend has taken since counts as alive: such a database waits for
    a later run, and a live run's database is never taken for abandoned."""
    pattern = re.compile(re.escape(prefix) + r"([0-9]+)_[0-9a-f]{12}")
    with psycopg.connect(server_url, autocommit=True) as conn:
        names = [str(n) for (n,) in conn.execute("SELECT datname FROM pg_catalog.pg_database")]
        alive = {int(p) for (p,) in conn.execute("SELECT pid FROM pg_catalog.pg_stat_activity")}
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) not in alive:
            found.append(name)
    return sorted(found)


def drop_abandoned_databases(server_url: str, prefix: str) -> list[str]:
    """Drop :func:`abandoned_databases`; the ones dropped. Best effort: a database another
    session drops first, or one this role may not drop, is left to it."""
    dropped = []
    for name in abandoned_databases(server_url, prefix):
        try:
            drop_database(server_url, name)
        except psycopg.Error:
            continue
        dropped.append(name)
    return dropped


def create_database(server_url: str, name: str, conn: psycopg.Connection[Any] | None = None) -> str:
    """Create database ``name`` on the server of ``server_url`` (through ``conn``, an
    autocommit connection to it, if given); a libpq URL to it."""
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if conn is not None:
        conn.execute(statement)
    else:
        with psycopg.connect(server_url, autocommit=True) as own:
            own.execute(statement)
    return with_database(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    """Drop database ``name``, ending any session still connected to it."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


class RunDatabase:
    """A database of a test run's own on a server: :meth:`open` drops the databases
    earlier runs with this prefix left behind, then creates it; :meth:`close` drops it."""

    def __init__(self) -> None:
        self.server = ""
        self.name = ""
        self._keeper: psycopg.Connection[Any] | None = None

    @property
    def created(self) -> bool:
        return bool(self.name)

    def open(self, server_url: str, prefix: str) -> str:
        """A libpq URL of the run's database (made now). A role that may not create
        databases gets ``server_url`` as it is."""
        keeper = psycopg.connect(server_url, autocommit=True, application_name="pgq-test-keeper")
        try:
            drop_abandoned_databases(server_url, prefix)
            name = new_database_name(prefix, keeper.info.backend_pid)
            url = create_database(server_url, name, keeper)
        except psycopg.errors.InsufficientPrivilege:
            keeper.close()
            return server_url
        except BaseException:
            keeper.close()
            raise
        self._keeper, self.server, self.name = keeper, server_url, name
        return url

    def close(self) -> None:
        if self.name:
            drop_database(self.server, self.name)
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        self.server = self.name = ""


@pytest.fixture(scope="session")
def pgq_server_url() -> str:
    """A libpq URL of the server the tests use (``PGQ_TEST_URL`` or an embedded one)."""
    given = os.environ.get("PGQ_TEST_URL")
    if given:
        return libpq_url(given)
    try:
        import pgserver  # noqa: F401
    except ImportError:
        raise pytest.UsageError(
            "pg_transport.testing needs a Postgres: set PGQ_TEST_URL to the URL of a role "
            "that may create databases, or install the embedded one: "
            "pip install 'celery-pgq[embedded]'"
        ) from None
    return embedded_server()


@pytest.fixture(scope="session")
def pgq_database_url(pgq_server_url: str) -> Iterator[str]:
    """A ``pgq://`` URL of a database made for this test run (dropped at its end; one a
    killed run left behind is dropped by the next run with the same prefix)."""
    run = RunDatabase()
    url = run.open(pgq_server_url, database_prefix())
    try:
        yield "pgq://" + url.split("://", 1)[1]
    finally:
        run.close()


@pytest.fixture
def pgq_schema(pgq_database_url: str) -> Iterator[str]:
    """A schema name of this test's own (pgq creates it on first connect)."""
    from pg_transport.results.listener import stop_listeners

    name = "pgq_" + uuid.uuid4().hex[:12]
    yield name
    stop_listeners()  # result waiters' sessions on this schema end with the test
    with psycopg.connect(libpq_url(pgq_database_url), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def pgq_celery_config(pgq_database_url: str, pgq_schema: str) -> dict[str, Any]:
    """Celery settings: pgq broker and result backend on the test's schema."""
    options = {"schema": pgq_schema, "polling_interval": 0.2}
    return {
        "broker_url": pgq_database_url,
        "result_backend": pgq_database_url,
        "broker_transport_options": options,
        "result_backend_transport_options": {"schema": pgq_schema},
        "worker_hijack_root_logger": False,
    }


def _forget_connections(app: Celery) -> None:
    """Drop what ``app`` made from its broker and backend settings (made again on use)."""
    pool = app._pool  # Celery keeps its connection pool there
    if pool is not None:
        pool.force_close_all()
    app._pool = None
    app._backend_cache = None  # a thread-safe backend is kept there
    app._local.__dict__.pop("backend", None)  # else per thread, there
    app.__dict__.pop("amqp", None)  # its producer pool came from the old broker


@pytest.fixture
def pgq_use(pgq_celery_config: dict[str, Any]) -> Iterator[Callable[[Celery], Celery]]:
    """``pgq_use(app)``: ``app`` on the test's database and schema for this test."""
    changed: list[tuple[Celery, dict[str, Any]]] = []

    def use(app: Celery) -> Celery:
        changed.append((app, {key: app.conf.get(key) for key in pgq_celery_config}))
        _forget_connections(app)
        app.conf.update(pgq_celery_config)
        return app

    yield use
    for app, before in reversed(changed):
        _forget_connections(app)
        app.conf.update(before)


@pytest.fixture
def pgq_app(pgq_celery_config: dict[str, Any]) -> Iterator[Celery]:
    """A Celery app on pgq (broker and results) for tasks defined in the test."""
    app = Celery("pgq_testing", set_as_current=True)
    app.conf.update(pgq_celery_config)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def pgq_worker(pgq_app: Celery) -> Iterator[Any]:
    """A worker for ``pgq_app`` in a thread of this process (threads pool)."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(pgq_app, pool="threads", concurrency=2, perform_ping_check=False) as w:
        yield w
