"""Real ``celery worker`` subprocesses for acceptance tests, and what their tasks wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

from tests.pg import to_broker_url

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.app"
#: An idle worker notices a warm shutdown (SIGTERM) only when its wait for messages
#: ends: at its next poll, up to polling_interval (1 s by default) after the signal, or
#: at a wake-up (Worker.stop and stop_all send one). Modules that time nothing against
#: the poll give their workers this too (Env.extra): their own SIGTERMs stop quickly.
#: How a worker process is started: "launch" (tests/acceptance/launch.py: Celery's worker
#: command without the ``celery`` umbrella's plugins) or "celery" (``python -m celery``).
LAUNCH = "launch"
#: The name of every worker process this run started, in order (the run reports how many).
STARTED: list[str] = []
QUICK_STOP = {"PGQ_POLLING_INTERVAL": "0.2"}


#: Where the processes tests start keep the modules they compile, when the environment
#: says to write no bytecode beside the sources (PYTHONDONTWRITEBYTECODE).
PYCACHE = Path(tempfile.gettempdir()) / "pgq-test-pycache"


def compiled_modules_kept(env: dict[str, str]) -> dict[str, str]:
    """What to add to ``env`` so that a process started with it reads the modules it
    imports compiled instead of compiling them again. With PYTHONDONTWRITEBYTECODE set,
    each process compiles every module that has no .pyc (some 100: pgq's and the
    tests' own) and keeps nothing: 0.60 s of CPU for a worker's start and stop against
    0.51 s with them kept (alternating, load 12). Bytecode then goes to :data:`PYCACHE`
    (PYTHONPYCACHEPREFIX, unless one is set), not beside the sources, which stay as
    they were; the first process to use it compiles what it imports once."""
    if not env.get("PYTHONDONTWRITEBYTECODE") or env.get("PYTHONPYCACHEPREFIX"):
        return {}
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(PYCACHE)}


@dataclass
class Env:
    pg_url: str
    schema: str
    extra: dict[str, str] = field(default_factory=dict)
    #: The apps :meth:`client` made: closed with the Env (:meth:`close`), or a connection
    #: one consumed on (remote control's replies) keeps its housekeeping running past the
    #: test, into the dropping of the run's database.
    clients: list[Celery] = field(default_factory=list)

    @property
    def broker_url(self) -> str:
        return to_broker_url(self.pg_url)

    def environ(self, **overrides: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
        env.update(compiled_modules_kept(env))
        env.update(
            PGQ_BROKER_URL=self.broker_url,
            PGQ_SCHEMA=self.schema,
            TEST_PG_URL=self.pg_url,
            PYTHONPATH=str(ROOT),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra)
        env.update(overrides)
        return env

    def client(self, **conf: Any) -> Celery:
        """A publishing app that names tasks by string, as a separate service would."""
        app = Celery("client", broker=self.broker_url)
        app.conf.update(broker_transport_options={"schema": self.schema}, **conf)
        self.clients.append(app)
        return app

    def close(self) -> None:
        """Close the connections of the apps :meth:`client` made."""
        while self.clients:
            self.clients.pop().close()

    def runs(self) -> list[tuple[str, str, int]]:
        with psycopg.connect(self.pg_url) as conn:
            return conn.execute(
                sql.SQL("SELECT task_id, label, pid FROM {}.task_runs ORDER BY seq").format(
                    sql.Identifier(self.schema)
                )
            ).fetchall()

    def scalar(self, query: str, *params: Any) -> Any:
        with psycopg.connect(self.pg_url) as conn:
            text = sql.SQL(query).format(schema=sql.Identifier(self.schema))
            row = conn.execute(text, params).fetchone()
            return row[0] if row else None

    def row(self, query: str, *params: Any) -> tuple[Any, ...]:
        """The one row ``query`` returns (``{schema}`` is this schema); fails on none."""
        with psycopg.connect(self.pg_url) as conn:
            text = sql.SQL(query).format(schema=sql.Identifier(self.schema))
            found = conn.execute(text, params).fetchone()
        assert found is not None, f"no row from {query}"
        return tuple(found)


def prepare(pg_url: str, schema: str) -> Env:
    """Migrate the schema and add the table the test tasks record runs in."""
    from pg_transport.db.migrate import ensure_schema
    from pg_transport.db.pool import Connector

    connector = Connector(pg_url)
    ensure_schema(connector, schema, auto_migrate=True)
    connector.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.task_runs (seq bigserial PRIMARY KEY, task_id text NOT NULL,"
                " label text, pid integer, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(schema))
        )
    return Env(pg_url, schema)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: Path
    name: str
    #: Where it consumes (start_worker sets it): :meth:`stop` wakes it there.
    env: Env | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30, *, woken: bool = False) -> int:
        """Warm-shut it down (SIGTERM, and a wake-up unless ``woken``: one was sent)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            if not woken:
                wake([self])
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return int(self.proc.returncode)


def wake(started: list[Worker]) -> None:
    """Wake the idle consumers of ``started``'s schemas, on every queue there.

    An idle worker sees a warm shutdown (SIGTERM) only when its wait for messages ends:
    at its next poll (polling_interval, 1 s by default), or at a wake-up like this one,
    which costs it no more than that poll would (a claim of what it may take anyway).
    Best effort: a schema or database already gone has no one to wake."""
    from pg_transport.sql.loader import channel_prefix

    for env in {(w.env.pg_url, w.env.schema): w.env for w in started if w.env}.values():
        try:
            with psycopg.connect(env.pg_url, autocommit=True, connect_timeout=10) as conn:
                conn.execute(
                    sql.SQL(
                        "SELECT pg_notify({} || md5(convert_to(name, 'UTF8')), '') FROM {}.queue"
                    ).format(sql.Literal(channel_prefix(env.schema)), sql.Identifier(env.schema))
                )
        except psycopg.Error:
            continue


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    """Poll a condition until it holds (a wait for an outcome, never for an ordering)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def start_worker(
    env: Env,
    name: str,
    *,
    pool: str = "threads",
    concurrency: int = 4,
    queues: str | None = None,
    args: tuple[str, ...] = (),
    environ: dict[str, str] | None = None,
    ready_timeout: float = 60,
    app: str = APP,
    may_exit: bool = False,
    wait: bool = True,
) -> Worker:
    """Start a worker and wait until it is ready (``wait`` false: do not wait).

    ``may_exit``: the worker is expected to die on its first task (which can happen
    before it logs that it is ready); its exit then ends the wait instead of failing.
    """
    log = Path(tempfile.mkstemp(prefix=f"pgq-worker-{name}-", suffix=".log")[1])
    STARTED.append(name)
    launcher = (
        ["-m", "celery", "-A", app, "worker"]
        if LAUNCH == "celery"
        else ["-m", "tests.acceptance.launch", app]
    )
    cmd = [
        sys.executable,
        *launcher,
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "-l",
        "info",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        *args,
    ]
    if queues:
        cmd += ["-Q", queues]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env.environ(**(environ or {})),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = Worker(proc, log, name, env)
    if wait:
        wait_ready([worker], ready_timeout, may_exit=may_exit)
    return worker


def wait_ready(started: list[Worker], timeout: float = 60, *, may_exit: bool = False) -> None:
    """Wait until every one of ``started`` is ready (``may_exit``: or has exited)."""

    def ready() -> bool:
        for worker in started:
            if worker.proc.poll() is not None and not may_exit:
                raise AssertionError(f"worker {worker.name} exited early:\n{worker.output()}")
        return all(w.proc.poll() is not None or " ready." in w.output() for w in started)

    names = ", ".join(w.name for w in started)
    wait_for(ready, timeout, f"worker {names} to be ready")


def stop_all(started: list[Worker], timeout: float = 30) -> None:
    """Warm-shut every worker down at once (each shutdown takes a moment of its own)."""
    for worker in started:
        if worker.proc.poll() is None:
            os.killpg(worker.proc.pid, signal.SIGTERM)
    wake(started)
    for worker in started:
        worker.stop(timeout, woken=True)


@contextmanager
def workers(env: Env, *names: str, **kwargs: Any) -> Iterator[list[Worker]]:
    """Workers started side by side (their start-ups overlap), ready when yielded."""
    may_exit = bool(kwargs.get("may_exit", False))
    timeout = float(kwargs.pop("ready_timeout", 60))
    started: list[Worker] = []
    try:
        for name in names:
            started.append(start_worker(env, name, **kwargs, wait=False))
        wait_ready(started, timeout, may_exit=may_exit)
        yield started
    finally:
        stop_all(started)


def terminate_backends_of(env: Env, worker: Worker) -> int:
    """pg_terminate_backend on every session of the worker process; how many."""
    with psycopg.connect(env.pg_url, autocommit=True) as admin:
        row = admin.execute(
            # Filter first (AND does not fix evaluation order), then terminate.
            "WITH victims AS MATERIALIZED (SELECT pid FROM pg_stat_activity"
            " WHERE application_name = %s OR application_name LIKE %s)"
            " SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM victims",
            [f"pgq:{worker.proc.pid}", f"pgq:{worker.proc.pid}:%"],
        ).fetchone()
    return int(row[0]) if row else 0


@dataclass
class Fleet:
    """Workers started once for a module's tests, on a schema of the module's own.

    For tests that need a running worker of one configuration and nothing of its life
    (no kill, no stop, no start-up timed): each test gets the fleet through
    :meth:`serve`, which checks the workers are still running and, after the test, waits
    until every message is gone from the queue (acked or dead-lettered: nothing the test
    started still runs) and empties what tests count (task_runs, dead_letter), so that
    the next test starts as on a fresh schema.
    """

    env: Env
    workers: list[Worker]
    #: How long after a test its messages may take to be acked (a test waits for its
    #: own outcomes first; this bounds the acks that follow them).
    settle_timeout: float = 60
    #: What the module's tests count, emptied after each (beside pgq's own queue).
    tables: tuple[str, ...] = ("task_runs", "dead_letter")

    @contextmanager
    def serve(self) -> Iterator[Env]:
        for worker in self.workers:
            if worker.proc.poll() is not None:
                raise AssertionError(f"fleet worker {worker.name} exited:\n{worker.output()}")
        try:
            yield self.env
        finally:
            try:
                wait_for(
                    lambda: self.env.scalar("SELECT count(*) FROM {schema}.message") == 0,
                    self.settle_timeout,
                    "the last test's messages to be acked before the next test",
                )
            finally:
                # (After a failed test, what it left is dropped too: the failure is its
                # own, not the next test's.)
                self._empty(("message", *self.tables))

    def _empty(self, tables: tuple[str, ...]) -> None:
        with psycopg.connect(self.env.pg_url, autocommit=True) as conn:
            for table in tables:
                conn.execute(
                    sql.SQL("DELETE FROM {}.{}").format(
                        sql.Identifier(self.env.schema), sql.Identifier(table)
                    )
                )


@contextmanager
def fleet(
    env: Env, *names: str, tables: tuple[str, ...] = Fleet.tables, **kwargs: Any
) -> Iterator[Fleet]:
    """:class:`Fleet` of :func:`workers` ``names`` (started side by side, stopped at the end)."""
    with workers(env, *names, **kwargs) as started:
        yield Fleet(env, started, tables=tables)
