"""Finding a Postgres for the tests: PGQ_TEST_URL, the local server, or an embedded one.

The suite works in a database of its own (``session_database``), created when the session
starts and dropped when it ends (by the same code as the user-facing plugin's,
``pg_transport.testing.RunDatabase``), so that it needs nothing but a role that may create
databases (any superuser) and leaves nothing behind, not even after a run that was killed
(the next run drops what it left); ``ConnectionMeter`` counts the sessions connected to
that database while the tests run.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict

from pg_transport import testing
from pg_transport.testing import (
    RunDatabase,
    abandoned_databases,
    create_database,
    drop_abandoned_databases,
    drop_database,
    embedded_server,
    libpq_url,
    with_database,
)

__all__ = [
    "DEFAULT_DB_PREFIX",
    "ConnectionMeter",
    "RunMeter",
    "abandoned_databases",
    "create_database",
    "created_session_database",
    "database_prefix",
    "drop_abandoned_databases",
    "drop_database",
    "drop_schema",
    "drop_session_database",
    "find_postgres",
    "metered_database",
    "new_database_name",
    "new_schema_name",
    "pgq_url",
    "session_database",
    "to_broker_url",
    "with_database",
]

LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"


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
        return libpq_url(url)
    if _answers(LOCAL):
        return LOCAL
    return embedded_server("pgq-embedded-")


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


#: The suite's session database is a :class:`pg_transport.testing.RunDatabase` (the
#: plugin's own), named ``<prefix><keeper pid>_<id>`` with this default prefix.
DEFAULT_DB_PREFIX = "pgq_t_session_"
_run = RunDatabase()
_session_url: list[str] = []


def database_prefix() -> str:
    """The name prefix of this run's session database: PGQ_TEST_DB_PREFIX, or the default."""
    return testing.database_prefix(DEFAULT_DB_PREFIX)


def session_database() -> str:
    """A libpq URL of this test run's own database on the server :func:`find_postgres`
    finds, created on first use (settings modules read it at import), dropped by
    :func:`drop_session_database` when the run ends. Session databases an earlier run
    left behind are dropped first (:func:`drop_abandoned_databases`). A role that may not
    create databases gets the database it was given, as it is."""
    if not _session_url:
        _session_url.append(_run.open(find_postgres(), database_prefix()))
    return _session_url[0]


def created_session_database() -> bool:
    """Whether :func:`session_database` made a database of its own."""
    return _run.created


def drop_session_database() -> None:
    _run.close()
    _session_url.clear()


def new_database_name(prefix: str | None = None, keeper_pid: int | None = None) -> str:
    """A session database's name: ``prefix`` (:func:`database_prefix` by default), the
    server pid of the connection that keeps it (0: none), an id of its own."""
    return testing.new_database_name(database_prefix() if prefix is None else prefix, keeper_pid)


#: Databases a test made for itself on the server (:func:`metered_database`): the meters
#: count their sessions with the run's, since they share the server's connections.
_extra_databases: set[str] = set()
#: (set by tests/conftest.py in each process of a parallel run) where the run's meter
#: learns each process's databases.
RUN_DIR_ENV = "PGQ_TEST_RUN_DIR"


def metered_database(name: str) -> None:
    """Count the sessions of database ``name`` (which a test made for itself, beside the
    run's) against the run's session budget: this process's meter, or the controller's
    in a parallel run (a ``db-<process>+<name>`` file in the run's directory)."""
    _extra_databases.add(name)
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw")
        path = os.path.join(run_dir, f"db-{worker}+{name}")
        with open(path, "w") as f:
            f.write(name)


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
            " WHERE (datname = pg_catalog.current_database() OR datname = ANY(%s))"
            " AND pid <> pg_catalog.pg_backend_pid() GROUP BY 1 ORDER BY 2 DESC, 1"
        )
        with psycopg.connect(self.pg_url, autocommit=True, application_name="pgq-test-meter") as c:
            while not self._stop.wait(self.interval):
                rows = c.execute(query, [sorted(_extra_databases)]).fetchall()
                seen = sum(int(n) for _, n in rows)
                if seen > self.peak:
                    self.peak, self.peak_during = seen, self.label()
                    self.peak_by = {str(name): int(n) for name, n in rows}


class RunMeter:
    """Samples, from the controlling process of a parallel run (pytest-xdist), how many
    sessions are connected to the run's databases together (one per worker process).

    Each worker names its database in ``<run dir>/db-<worker>`` (and each its tests made
    for themselves in ``db-<worker>+<name>``: :func:`metered_database`) and what it runs in
    ``<run dir>/running-<worker>`` (``<sessions declared>\\t<test id>``). ``peak`` is the
    most sessions seen at once, ``peak_during`` the tests running then, ``peak_by`` the
    sessions at the peak by application_name; ``by_test`` the most each test's database
    held while it ran, with the number the test declared.
    """

    def __init__(self, server_url: str, run_dir: Any, interval: float = 0.05) -> None:
        self.server_url = server_url
        self.run_dir = run_dir
        self.interval = interval
        self.peak = 0
        self.peak_during = ""
        self.peak_by: dict[str, int] = {}
        self.by_test: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgq-test-run-meter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _read(self, kind: str) -> dict[str, str]:
        found = {}
        for path in self.run_dir.glob(f"{kind}-*"):
            try:
                found[path.name.split("-", 1)[1]] = path.read_text()
            except OSError:
                continue
        return found

    def _run(self) -> None:
        query = (
            "SELECT datname, application_name, pg_catalog.count(*)"
            " FROM pg_catalog.pg_stat_activity WHERE datname = ANY(%s)"
            " AND pid <> pg_catalog.pg_backend_pid() GROUP BY 1, 2"
        )
        with psycopg.connect(
            self.server_url, autocommit=True, application_name="pgq-test-meter"
        ) as c:
            while not self._stop.wait(self.interval):
                databases = self._read("db")  # worker -> its database
                if not databases:
                    continue
                running = self._read("running")  # read before the count: the tests then
                rows = c.execute(query, [list(databases.values())]).fetchall()
                on: dict[str, int] = {}
                by_name: dict[str, int] = {}
                for datname, name, n in rows:
                    on[str(datname)] = on.get(str(datname), 0) + int(n)
                    by_name[str(name)] = by_name.get(str(name), 0) + int(n)
                # A process's sessions: on its database and on those its tests made.
                held_by: dict[str, int] = {}
                for key, database in databases.items():
                    worker = key.partition("+")[0]
                    held_by[worker] = held_by.get(worker, 0) + on.get(database, 0)
                for worker, held in held_by.items():
                    declared, _, test = running.get(worker, "").partition("\t")
                    if not test:
                        continue
                    before = self.by_test.get(test, (0, 0))[0]
                    self.by_test[test] = (max(before, held), int(declared or 0))
                seen = sum(on.values())
                if seen > self.peak:
                    self.peak = seen
                    self.peak_during = ", ".join(
                        sorted(t.partition("\t")[2] for t in running.values() if t)
                    )
                    self.peak_by = dict(sorted(by_name.items(), key=lambda kv: -kv[1]))
