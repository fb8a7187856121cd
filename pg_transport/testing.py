"""A pytest plugin for testing a Celery app on pgq: ``pytest_plugins = ["pg_transport.testing"]``.

Fixtures (docs/testing.md):

- ``pgq_server_url`` (session): a Postgres server the tests may create a database on:
  ``PGQ_TEST_URL`` (a ``postgresql://`` or ``pgq://`` URL of a role that may create
  databases), else an embedded server (``pip install 'celery-pgq[embedded]'``).
- ``pgq_database_url`` (session): a ``pgq://`` URL of a database made for this test run,
  dropped at its end.
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
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

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


def _libpq(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1] if "://" in url else url


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(name, safe="")))


@pytest.fixture(scope="session")
def pgq_server_url() -> str:
    """A libpq URL of the server the tests use (``PGQ_TEST_URL`` or an embedded one)."""
    given = os.environ.get("PGQ_TEST_URL")
    if given:
        return _libpq(given)
    try:
        import pgserver
    except ImportError:
        raise pytest.UsageError(
            "pg_transport.testing needs a Postgres: set PGQ_TEST_URL to the URL of a role "
            "that may create databases, or install the embedded one: "
            "pip install 'celery-pgq[embedded]'"
        ) from None
    if not _embedded:
        data_dir = tempfile.mkdtemp(prefix="pgq-testing-")
        server = pgserver.get_server(data_dir, cleanup_mode="delete")  # type: ignore[attr-defined]
        _embedded.append(server)
    return str(_embedded[0].get_uri())


@pytest.fixture(scope="session")
def pgq_database_url(pgq_server_url: str) -> Iterator[str]:
    """A ``pgq://`` URL of a database made for this test run (dropped at its end)."""
    name = "pgq_test_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pgq_server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _with_database(pgq_server_url, name)
    try:
        yield "pgq://" + url.split("://", 1)[1]
    finally:
        with psycopg.connect(pgq_server_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def pgq_schema(pgq_database_url: str) -> Iterator[str]:
    """A schema name of this test's own (pgq creates it on first connect)."""
    from pg_transport.results.listener import stop_listeners

    name = "pgq_" + uuid.uuid4().hex[:12]
    yield name
    stop_listeners()  # result waiters' sessions on this schema end with the test
    with psycopg.connect(_libpq(pgq_database_url), autocommit=True) as conn:
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
