"""Finding a Postgres for the tests: PGQ_TEST_URL, the local server, or an embedded one.

The suite works in a database of its own (``session_database``), created when the session
starts and dropped when it ends, so that it needs nothing but a role that may create
databases (any superuser) and leaves nothing behind, not even after a run that was killed
(the next run drops what it left); ``ConnectionMeter`` counts the sessions connected to
that database while the tests run.
"""

from __future__ import annotations

import os
import re
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


#: Every database a test session creates is named ``<prefix><pid>_<12 hex digits>``: the
#: prefix PGQ_TEST_DB_PREFIX (default ``pgq_t_session_``), then the server process id of the
#: session's keeper connection, which created the database and stays open until the
#: session drops it. A database so named whose keeper backend is gone belongs to a run
#: that ended without dropping it (killed, interrupted twice): the next session's
#: :func:`drop_abandoned_databases` drops it. Databases of live sessions (keeper still
#: connected) and databases named any other way are never touched.
DEFAULT_DB_PREFIX = "pgq_t_session_"
_POSTGRES_NAME_MAX = 63
_SUFFIX_MAX = len("_") + 12 + 10  # "_<hex>" and a pid of up to 10 digits

_session: dict[str, str] = {}
_keeper: psycopg.Connection[Any] | None = None


def database_prefix() -> str:
    """The name prefix of this run's session database: PGQ_TEST_DB_PREFIX, or the default."""
    prefix = os.environ.get("PGQ_TEST_DB_PREFIX") or DEFAULT_DB_PREFIX
    if len(prefix.encode()) > _POSTGRES_NAME_MAX - _SUFFIX_MAX:
        raise ValueError(
            f"PGQ_TEST_DB_PREFIX {prefix!r} is too long: at most "
            f"{_POSTGRES_NAME_MAX - _SUFFIX_MAX} bytes, the session's pid and id follow it "
            f"within Postgres's {_POSTGRES_NAME_MAX}-byte names"
        )
    return prefix


def session_database() -> str:
    """A libpq URL of this test run's own database on the server :func:`find_postgres`
    finds, created on first use (settings modules read it at import), dropped by
    :func:`drop_session_database` when the run ends. Session databases an earlier run
    left behind are dropped first (:func:`drop_abandoned_databases`). A role that may not
    create databases gets the database it was given, as it is."""
    global _keeper
    if "url" not in _session:
        server, prefix = find_postgres(), database_prefix()
        keeper = psycopg.connect(server, autocommit=True, application_name="pgq-test-keeper")
        try:
            drop_abandoned_databases(server, prefix)
            name = new_database_name(prefix, keeper.info.backend_pid)
            _session["url"] = create_database(server, name, keeper)
        except psycopg.errors.InsufficientPrivilege:
            keeper.close()
            _session["url"] = server
        except BaseException:
            keeper.close()
            raise
        else:
            _keeper = keeper
            _session.update(server=server, name=name)
    return _session["url"]


def created_session_database() -> bool:
    """Whether :func:`session_database` made a database of its own."""
    return "name" in _session


def drop_session_database() -> None:
    global _keeper
    if "name" in _session:
        drop_database(_session["server"], _session["name"])
    if _keeper is not None:
        _keeper.close()
        _keeper = None
    _session.clear()


def with_database(pg_url: str, dbname: str) -> str:
    """``pg_url`` (a libpq URL) naming database ``dbname`` instead."""
    parts = urlsplit(pg_url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "dbname"])
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe=""), query=query))


def new_database_name(prefix: str | None = None, keeper_pid: int | None = None) -> str:
    """A session database's name: ``prefix`` (:func:`database_prefix` by default), the
    server pid of the connection that keeps it (0: none), an id of its own."""
    prefix = database_prefix() if prefix is None else prefix
    return f"{prefix}{keeper_pid or 0}_{uuid.uuid4().hex[:12]}"


def abandoned_databases(server_url: str, prefix: str) -> list[str]:
    """Session databases named with ``prefix`` whose keeper backend is no longer connected.

    A keeper pid another backend has taken since counts as alive: such a database waits for
    a later run, and a live session's database is never taken for abandoned."""
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
    statement = psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
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
