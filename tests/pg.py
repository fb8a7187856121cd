"""Finding a Postgres for the tests: PGQ_TEST_URL, the local server, or an embedded one.

The suite works in a database of its own (``session_database``), created when the session
starts and dropped when it ends, so that it needs nothing but a role that may create
databases (any superuser) and leaves nothing behind; ``ConnectionMeter`` counts the
sessions connected to that database while the tests run.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict

LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
_embedded: Any = None


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def find_postgres() -> str:
    """A libpq URL of a server the tests may create databases, schemas and roles in."""
    url = os.environ.get("PGQ_TEST_URL")
    if url:
        return url.replace("pgq://", "postgresql://", 1)
    if _answers(LOCAL):
        return LOCAL
    global _embedded
    if _embedded is None:
        import pgserver  # the embedded fallback for machines without Postgres

        data_dir = tempfile.mkdtemp(prefix="pgq-embedded-")
        _embedded = pgserver.get_server(data_dir, cleanup_mode="delete")
    return str(_embedded.get_uri())


def to_broker_url(pg_url: str) -> str:
    return "pgq://" + pg_url.split("://", 1)[1]


def pgq_url(pg_url: str, **overrides: Any) -> str:
    """A pgq:// URL for the test server, with libpq parameters replaced or removed (None)."""
    merged: dict[str, Any] = {**conninfo_to_dict(pg_url), **overrides}
    params = {k: str(v) for k, v in merged.items() if v is not None}
    dbname = params.pop("dbname", "")
    return f"pgq:///{quote(dbname, safe='')}?{urlencode(params)}"


def new_schema_name() -> str:
    return "pgq_t_" + uuid.uuid4().hex[:12]


def drop_schema(pg_url: str, schema: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                psycopg.sql.Identifier(schema)
            )
        )


_session: dict[str, str] = {}


def session_database() -> str:
    """A libpq URL of this test run's own database on the server :func:`find_postgres`
    finds, created on first use (settings modules read it at import), dropped by
    :func:`drop_session_database` when the run ends. A role that may not create
    databases gets the database it was given, as it is."""
    if "url" not in _session:
        server, name = find_postgres(), new_database_name()
        try:
            _session["url"] = create_database(server, name)
        except psycopg.errors.InsufficientPrivilege:
            _session["url"] = server
        else:
            _session.update(server=server, name=name)
    return _session["url"]


def created_session_database() -> bool:
    """Whether :func:`session_database` made a database of its own."""
    return "name" in _session


def drop_session_database() -> None:
    if "name" in _session:
        drop_database(_session["server"], _session["name"])
    _session.clear()


def with_database(pg_url: str, dbname: str) -> str:
    """``pg_url`` (a libpq URL) naming database ``dbname`` instead."""
    parts = urlsplit(pg_url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "dbname"])
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe=""), query=query))


def new_database_name() -> str:
    return "pgq_t_session_" + uuid.uuid4().hex[:12]


def create_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``server_url``; a libpq URL to it."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    return with_database(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    """Drop database ``name``, ending any session still connected to it."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )


class ConnectionMeter:
    """Samples how many sessions are connected to one database, from a thread of its own.

    ``peak`` is the most seen at once (this meter's own session not counted) and
    ``peak_during`` what ``label()`` (the running test's id) said then.
    """

    def __init__(self, pg_url: str, label: Callable[[], str], interval: float = 0.05) -> None:
        self.pg_url = pg_url
        self.interval = interval
        self.peak = 0
        self.peak_during = ""
        #: Sessions at the peak by application_name (pgq's name its process: pgq:<pid>).
        self.peak_by: dict[str, int] = {}
        self.label = label
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgq-test-meter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        query = (
            "SELECT application_name, pg_catalog.count(*) FROM pg_catalog.pg_stat_activity"
            " WHERE datname = pg_catalog.current_database()"
            " AND pid <> pg_catalog.pg_backend_pid() GROUP BY 1 ORDER BY 2 DESC, 1"
        )
        with psycopg.connect(self.pg_url, autocommit=True, application_name="pgq-test-meter") as c:
            while not self._stop.wait(self.interval):
                rows = c.execute(query).fetchall()
                seen = sum(int(n) for _, n in rows)
                if seen > self.peak:
                    self.peak, self.peak_during = seen, self.label()
                    self.peak_by = {str(name): int(n) for name, n in rows}
