"""``pgq demo``: a real Celery worker running tasks through Postgres, end to end.

This module is the driver :func:`run` behind ``pgq demo``: find or start a Postgres,
migrate a throwaway schema, publish tasks, start the worker (the Celery app of
:mod:`pg_transport.ops.demo_app`), watch them run, stop everything and clean up.

Tasks report back through pgq itself (a second queue the driver claims from), so
the demo needs neither a result backend nor SQL of its own for its results.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click
import psycopg
from celery import Celery

from pg_transport.db.migrate import migrate
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.db.url import mask_url
from pg_transport.errors import PgqError
from pg_transport.ops.demo_app import ADD, QUEUE, RESULTS, app
from pg_transport.sql import compose_channel, load_queries
from pg_transport.store import Store

__all__ = ["QUEUE", "RESULTS", "DemoError", "app", "run"]

APP_MODULE = "pg_transport.ops.demo_app"

READY_TIMEOUT = 30.0
TASKS_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
LOG_TAIL_LINES = 25


class DemoError(PgqError):
    """The demo could not run to the end; the message says which step failed."""


# --- the driver -------------------------------------------------------------


@dataclass
class Sent:
    x: int
    y: int
    priority: int
    task_id: str
    at: float

    @property
    def call(self) -> str:
        return f"add({self.x}, {self.y})"


@dataclass
class Report:
    task_id: str
    result: int
    started: float
    priority: int | None
    pid: int

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Report:
        return cls(
            str(payload["task_id"]),
            int(payload["result"]),
            float(payload["started"]),
            payload.get("priority"),
            int(payload["pid"]),
        )


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int:
        """Warm shutdown (SIGTERM), then SIGKILL if it does not end in time."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT)
        return int(self.proc.returncode)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


@contextmanager
def _pgq_environ(schema: str) -> Iterator[None]:
    """Pin the demo's schema for the transport, which reads ``PGQ_*`` from os.environ.

    A user's own ``PGQ_SCHEMA`` (or any other override) would otherwise send the
    demo's tasks into their real schema, where the demo worker never looks.
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith("PGQ_")}
    for key in saved:
        del os.environ[key]
    os.environ["PGQ_SCHEMA"] = schema
    try:
        yield
    finally:
        os.environ.pop("PGQ_SCHEMA", None)
        os.environ.update(saved)


@contextmanager
def _embedded_postgres(workdir: Path) -> Iterator[str]:
    """Start a private Postgres with pgserver; stop it and delete its data after."""
    with warnings.catch_warnings():
        # pgserver's platformdirs warns, at import, when XDG_RUNTIME_DIR is unset
        # (containers, CI): harmless, and noise in the demo's output.
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            raise DemoError(
                "pgq demo without --url needs an embedded Postgres: "
                "pip install 'celery-pgq[embedded]', or pass --url pgq://user@host/db"
            ) from None
        try:
            server = pgserver.get_server(  # type: ignore[attr-defined]  # no __all__ there
                workdir / "pgdata", cleanup_mode="delete"
            )
        except (subprocess.SubprocessError, OSError, AssertionError) as exc:
            raise DemoError(f"could not start the embedded Postgres: {exc}") from exc
    try:
        yield "pgq://" + str(server.get_uri()).split("://", 1)[1]
    finally:
        server.cleanup()


class Demo:
    """One run of the demo; every step prints what it did."""

    def __init__(self, echo: Callable[..., None], url: str, schema: str) -> None:
        self.echo = echo
        self.url = url
        self.schema = schema
        self.connector = Connector(url_to_conninfo(url), display_url=mask_url(url))
        self.store = Store(self.connector, schema)
        self._listening: psycopg.Connection[Any] | None = None
        self.worker: Worker | None = None
        self.reports: dict[str, list[Report]] = {}

    # -- Postgres ------------------------------------------------------------
    def server_version(self) -> str:
        with self.connector.connection() as conn:
            return conn.info.parameter_status("server_version") or "?"

    def create_schema(self) -> None:
        """Create the schema, refusing one that exists: only what we created is dropped."""
        query = load_queries(self.schema)["create_schema_strict"]
        with self.connector.connection() as conn:
            try:
                conn.execute(query)
            except psycopg.errors.DuplicateSchema:
                raise DemoError(
                    f"schema {self.schema!r} already exists; the demo drops its schema at the "
                    "end, so give it a new name with --schema (or leave --schema out)"
                ) from None

    def migrate(self) -> list[str]:
        with self.connector.connection() as conn:
            return migrate(conn, self.schema)

    def drop_schema(self) -> None:
        query = load_queries(self.schema)["drop_schema"]
        with self.connector.connection() as conn:
            conn.execute(query)

    # -- tasks ---------------------------------------------------------------
    def send(self, client: Celery, x: int, y: int, priority: int = 0) -> Sent:
        at = time.time()
        result = client.send_task(ADD, args=(x, y), queue=QUEUE, priority=priority)
        return Sent(x, y, priority, str(result.id), at)

    def collect(self, sent: list[Sent], timeout: float = TASKS_TIMEOUT) -> None:
        """Read the workers' reports until every task in ``sent`` has one."""
        want = {s.task_id for s in sent}
        deadline = time.monotonic() + timeout
        while True:
            self.drain_reports()
            missing = [s for s in sent if s.task_id not in self.reports]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                calls = ", ".join(s.call for s in missing)
                self.fail(
                    f"{len(want) - len(missing)} of {len(want)} tasks ran within {timeout:.0f} s; "
                    f"still waiting for {calls}"
                )
            # A report's publish NOTIFYs its queue's channel: no need to poll fast.
            self.wait_for_reports(min(remaining, 1.0))

    def listen_for_reports(self) -> None:
        """LISTEN on the report queue's channel (before any task is sent)."""
        conn = self._listening = self.connector.connect()
        conn.execute(
            compose_channel(load_queries(self.schema)["listen"], self.store.channel(RESULTS))
        )

    def wait_for_reports(self, timeout: float) -> None:
        """Until a report's publish wakes us, or ``timeout``."""
        if self._listening is not None:
            for _ in self._listening.notifies(timeout=timeout, stop_after=1):
                pass

    def stop_listening(self) -> None:
        conn, self._listening = self._listening, None
        if conn is not None:
            conn.close()

    def drain_reports(self) -> None:
        claimed = self.store.claim([RESULTS], [60.0], 100)
        for message in claimed:
            if message.payload is None:
                continue  # (dead-lettered by the claim: not a report of ours)
            report = Report.from_payload(message.payload)
            self.reports.setdefault(report.task_id, []).append(report)
        self.store.ack([c.token for c in claimed])

    def report(self, sent: Sent) -> Report:
        return self.reports[sent.task_id][0]

    # -- the worker ----------------------------------------------------------
    def start_worker(self, workdir: Path) -> Worker:
        log = workdir / "worker.log"
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            APP_MODULE,
            "worker",
            "-P",
            "threads",
            "-c",
            "1",
            "-Q",
            QUEUE,
            "-n",
            f"pgq-demo-{os.getpid()}@%h",
            "-l",
            "info",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
        env.update(PGQ_URL=self.url, PGQ_SCHEMA=self.schema, PYTHONUNBUFFERED="1")
        with log.open("wb") as out:
            # Own session: stopping the worker's process group never signals us.
            proc = subprocess.Popen(
                cmd,
                cwd=workdir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.worker = Worker(proc, log)
        deadline = time.monotonic() + READY_TIMEOUT
        while " ready." not in self.worker.tail(200):
            code = proc.poll()
            if code is not None:
                self.fail(f"the Celery worker exited with code {code} before it was ready")
            if time.monotonic() > deadline:
                self.fail(f"the Celery worker was not ready after {READY_TIMEOUT:.0f} s")
            # Waiting on another process's log: there is nothing to block on.
            time.sleep(0.05)
        return self.worker

    def fail(self, message: str) -> NoReturn:
        if self.worker is not None:
            tail = self.worker.tail()
            if tail:
                self.echo("--- last lines of the worker's log ---", err=True)
                self.echo(tail, err=True)
                self.echo("---", err=True)
        raise DemoError(message)

    # -- the story -----------------------------------------------------------
    def play(self, client: Celery, workdir: Path) -> int:
        echo = self.echo
        queued = [self.send(client, 1, 2), self.send(client, 2, 3), self.send(client, 20, 22, 9)]
        echo("\n1. Three tasks published while no worker runs: they wait as rows in Postgres.")
        for s in queued:
            echo(f"     {s.call:<12} priority {s.priority}   task id {s.task_id[:8]}...")
        echo(f"   queue {QUEUE!r} holds {self.store.size(QUEUE)} messages")

        started = time.monotonic()
        worker = self.start_worker(workdir)
        echo(
            f"\n2. Started a real Celery worker (threads pool, one slot): ready in "
            f"{time.monotonic() - started:.1f} s, pid {worker.proc.pid}."
        )
        self.collect(queued)
        in_order = sorted(queued, key=lambda s: self.report(s).started)
        by_priority = sorted(queued, key=lambda s: -s.priority)  # stable: then send order
        # Said only when observed: the output reports what happened, not what should.
        how = ", highest priority first" if in_order == by_priority else " in this order"
        echo(f"   it drained the queue{how}:")
        for n, s in enumerate(in_order, start=1):
            r = self.report(s)
            done = f"{s.call} = {r.result}"
            echo(
                f"     {_ordinal(n):<4} {done:<17} priority {r.priority}   "
                f"waited {_ms(r.started - s.at)} in Postgres"
            )

        echo("\n3. Three tasks sent to the running worker: LISTEN/NOTIFY wakes it at once.")
        live: list[Sent] = []
        for x, y in ((5, 5), (6, 7), (100, -1)):
            # One at a time, so each latency is the broker's, not a wait behind another task.
            s = self.send(client, x, y)
            self.collect([s])
            r = self.report(s)
            live.append(s)
            done = f"{s.call} = {r.result}"
            echo(f"     {done:<18} sent -> running in the worker: {_ms(r.started - s.at)}")

        code = worker.stop()
        self.drain_reports()  # a duplicate run would have reported by now
        everything = queued + live
        twice = [s.call for s in everything if len(self.reports[s.task_id]) > 1]
        if twice:
            self.fail(f"tasks ran more than once: {', '.join(twice)}")
        left = self.store.size(QUEUE)
        if left:
            self.fail(f"queue {QUEUE!r} still holds {left} messages after the worker stopped")
        how_stopped = "warm shutdown, exit code 0" if code == 0 else f"exit code {code}"
        echo(f"\n4. Worker stopped ({how_stopped}).")
        echo(f"   queue {QUEUE!r} is empty: every message was acked")
        return len(everything)


def run(url: str | None, schema: str | None, echo: Callable[..., None] = click.echo) -> None:
    """Run the demo against ``url`` (or an embedded Postgres when None)."""
    begun = time.monotonic()
    schema = schema or f"pgq_demo_{uuid.uuid4().hex[:8]}"
    cleanup_notes: list[str] = []
    problems: list[str] = []
    echo("pgq demo: Celery tasks through PostgreSQL, end to end\n")
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pgq-demo-")))
        if url is None:
            booted = time.monotonic()
            url = stack.enter_context(_embedded_postgres(workdir))
            where = f"embedded, started in {time.monotonic() - booted:.1f} s"
            stack.callback(cleanup_notes.append, "stopped the embedded Postgres")
        else:
            where = mask_url(url)
        demo = Demo(echo, url, schema)
        stack.callback(demo.connector.close)
        stack.callback(demo.stop_listening)
        version = demo.server_version()
        demo.create_schema()

        def drop() -> None:
            try:
                demo.drop_schema()
                cleanup_notes.append(f"dropped schema {schema!r}")
            except (PgqError, psycopg.Error) as exc:
                # Said at once: if the demo failed too, its error is what propagates.
                problem = f"could not drop the demo schema {schema!r}: {exc}"
                echo(f"warning: {problem}", err=True)
                problems.append(problem)

        stack.callback(drop)
        applied = demo.migrate()
        echo(f"  postgres   PostgreSQL {version} ({where})")
        echo(f"  schema     {schema!r} (throwaway, dropped at the end)")
        echo(f"  migrated   {', '.join(applied)}")
        demo.listen_for_reports()

        def stop_worker() -> None:
            if demo.worker is not None:
                demo.worker.stop()

        stack.enter_context(_pgq_environ(schema))
        client = Celery("pgq-demo-client", broker=url, set_as_current=False)
        stack.callback(client.close)
        stack.callback(stop_worker)  # runs first: the worker ends before the schema goes
        tasks = demo.play(client, workdir)
    if cleanup_notes:
        echo("   " + "; ".join(cleanup_notes) + ".")
    if problems:
        raise DemoError("; ".join(problems))
    echo(f"\ndemo OK: {tasks} tasks, each ran exactly once, in {time.monotonic() - begun:.1f} s")
