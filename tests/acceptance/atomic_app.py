"""A Celery app of atomic tasks (``pg_transport.AtomicTask``), for tests/acceptance/test_atomic.py.

Configured by environment: PGQ_BROKER_URL (broker and result backend), PGQ_SCHEMA,
TEST_PG_URL. A task's writes go to ``{schema}.counter`` and ``{schema}.audit`` in its
run's transaction; what the test must see while a run is open (it reached a point) is
written on a connection of its own. TEST_ATOMIC_PROVIDER picks the run's connection
(``own``: pgq's; ``psycopg``, ``sqlalchemy``, ``django``: the application's).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

import pg_transport
from pg_transport.atomic import run as atomic_run

URL = os.environ.get("PGQ_BROKER_URL", "pgq://")
SCHEMA = os.environ.get("PGQ_SCHEMA", "pgq")
PROVIDER = os.environ.get("TEST_ATOMIC_PROVIDER", "own")

app = Celery("atomic", broker=URL, backend=os.environ.get("TEST_RESULT_BACKEND") or URL)
app.conf.update(
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_extended=True,
)

# The role pgq's own run connection logs in as (a refusal test: a publisher-only role).
if os.environ.get("TEST_ATOMIC_URL"):
    app.conf.pgq_atomic_url = os.environ["TEST_ATOMIC_URL"]

_side: psycopg.Connection | None = None


def side() -> psycopg.Connection:
    """A connection of the test's own (autocommit): seen at once, whatever the run does."""
    global _side
    if _side is None or _side.closed or os.getpid() != _side_pid[0]:
        _side = psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True)
        _side_pid[0] = os.getpid()
    return _side


_side_pid = [0]


def q(text: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(SCHEMA))


def reached(task_id: str, point: str) -> None:
    side().execute(
        q("INSERT INTO {schema}.points (task_id, point, pid) VALUES (%s, %s, %s)"),
        [task_id, point, os.getpid()],
    )


def wait_gate(label: str) -> None:
    while (
        side().execute(q("SELECT 1 FROM {schema}.gates WHERE label = %s"), [label]).fetchone()
        is None
    ):
        time.sleep(0.02)  # a wait for the test's word, not for an ordering


# -- the run's connection -----------------------------------------------------------
def _sqlalchemy() -> Any:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    url = os.environ["TEST_PG_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
    return sessionmaker(
        create_engine(url, pool_size=2, connect_args={"application_name": app_name()})
    )


def app_name() -> str:
    """The application's run sessions (test_atomic terminates them by this name)."""
    return f"test-atomic:{os.getpid()}"


def _psycopg() -> psycopg.Connection:
    return psycopg.connect(os.environ["TEST_PG_URL"], application_name=app_name())


if PROVIDER == "sqlalchemy":
    _maker = None

    def sqlalchemy_session() -> Any:
        global _maker
        if _maker is None:
            _maker = _sqlalchemy()
        return _maker

    app.conf.pgq_atomic_connection = sqlalchemy_session
elif PROVIDER == "psycopg":
    _local: dict[int, psycopg.Connection] = {}

    def psycopg_connection() -> psycopg.Connection:
        import threading

        key = threading.get_ident()
        conn = _local.get(key)
        if conn is None or conn.closed or conn.broken:
            conn = _local[key] = _psycopg()
        return conn

    app.conf.pgq_atomic_connection = psycopg_connection
elif PROVIDER == "django":
    import django
    from django.conf import settings

    if not settings.configured:
        dsn = psycopg.conninfo.conninfo_to_dict(os.environ["TEST_PG_URL"])
        settings.configure(
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": dsn.get("dbname"),
                    "USER": dsn.get("user", "postgres"),
                    "HOST": dsn.get("host", "127.0.0.1"),
                    "PORT": dsn.get("port", "5432"),
                    "PASSWORD": dsn.get("password", ""),
                    "OPTIONS": {"application_name": "test-atomic:django"},
                }
            },
            INSTALLED_APPS=[],
            USE_TZ=True,
        )
        django.setup()
    app.conf.pgq_atomic_connection = "django"
elif PROVIDER == "autocommit":

    def autocommit_connection() -> psycopg.Connection:
        return psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True)

    app.conf.pgq_atomic_connection = autocommit_connection
elif PROVIDER == "other-database":

    def other_database() -> psycopg.Connection:
        return psycopg.connect(os.environ["TEST_OTHER_URL"])

    app.conf.pgq_atomic_connection = other_database
elif PROVIDER == "serializable":

    def serializable() -> psycopg.Connection:
        conn = _psycopg()
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        return conn

    app.conf.pgq_atomic_connection = serializable


def execute(task: Any, text: str, params: list[Any]) -> None:
    """Run ``text`` in the task's transaction, through whatever the provider gave."""
    if PROVIDER == "sqlalchemy":
        from sqlalchemy import text as sa_text

        names = {f"p{i}": v for i, v in enumerate(params)}
        stmt = str(q(text).as_string(None))
        for i in range(len(params)):
            stmt = stmt.replace("%s", f":p{i}", 1)
        task.transaction.session.execute(sa_text(stmt), names)
    elif PROVIDER == "django":
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute(q(text).as_string(None), params)
    else:
        task.transaction.connection.execute(q(text), params)


# -- tasks --------------------------------------------------------------------------
@app.task(bind=True, base=pg_transport.AtomicTask, max_retries=3)
def bump(
    self: Any,
    label: str,
    gate: str | None = None,
    fail: bool = False,
    retry: bool = False,
    follow: bool = False,
) -> str:
    tid = self.request.id
    execute(self, "UPDATE {schema}.counter SET n = n + 1 WHERE id = 1", [])
    execute(self, "INSERT INTO {schema}.audit (task_id, label) VALUES (%s, %s)", [tid, label])
    if follow:
        note.delay(label)
    reached(tid, "written")
    if gate and not self.request.delivery_info.get("redelivered"):
        wait_gate(gate)
    if fail:
        raise ValueError(f"{label} failed on purpose")
    if retry and self.request.retries == 0:
        raise self.retry(countdown=0)
    return label


@app.task(bind=True)
def note(self: Any, label: str) -> str:
    reached(self.request.id, f"note:{label}")
    return label


@app.task(bind=True, base=pg_transport.AtomicTask)
def part(self: Any, i: int, gate: str | None = None) -> int:
    execute(
        self,
        "INSERT INTO {schema}.audit (task_id, label) VALUES (%s, %s)",
        [
            self.request.id,
            f"part{i}",
        ],
    )
    reached(self.request.id, f"part{i}")
    if gate and not self.request.delivery_info.get("redelivered"):
        wait_gate(gate)
    return i


@app.task(bind=True)
def collect(self: Any, results: list[int], label: str) -> int:
    reached(self.request.id, f"{label}:{sum(results)}")
    return sum(results)


if os.environ.get("TEST_ACKS_EARLY"):

    @app.task(bind=True, base=pg_transport.AtomicTask, acks_late=False)
    def early(self: Any) -> None:
        pass


# A crash right after a commit (test_atomic's "after commit"): the run blocks there.
if os.environ.get("TEST_BLOCK_AFTER_COMMIT"):

    def _block(run: Any) -> None:
        reached(str(run.task_id), "committed")
        wait_gate(os.environ["TEST_BLOCK_AFTER_COMMIT"])

    atomic_run._after_commit_hook = _block
