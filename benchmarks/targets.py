"""The brokers under test: how to reach each, give it a clean state, and clean up after.

Each broker answers :meth:`Broker.check` with a reason it cannot be used (or None),
:meth:`Broker.setup` with a :class:`Target` in a state no earlier run touched, and
:meth:`Broker.teardown` removes what setup made, even after a failed run.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from kombu.connection import Connection
from psycopg import sql
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from tests.acceptance.cluster import free_port
from tests.bouncer import BouncerUnavailable, pgbouncer

__all__ = [
    "AmqpBroker",
    "Broker",
    "PgqBouncerBroker",
    "PgqBroker",
    "RedisBroker",
    "RedisFsyncBroker",
    "SqlaBroker",
    "Target",
    "mask_url",
]

CONNECT_TIMEOUT = 3


def mask_url(url: str) -> str:
    """The URL with its password replaced, for printing and the JSON report."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1**@", url)


@dataclass
class Target:
    """One broker prepared for one run."""

    broker_url: str
    queue: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    # Extra environment of the worker subprocess (and of the publisher, for pgq).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def display_url(self) -> str:
        return mask_url(self.broker_url)


class Broker:
    """Base of the broker definitions; subclasses override all three steps."""

    name = "broker"

    def check(self) -> str | None:
        raise NotImplementedError

    def setup(self, run_id: str) -> Target:
        raise NotImplementedError

    def teardown(self, target: Target) -> None:
        raise NotImplementedError


def _pg_unreachable(pg_url: str) -> str | None:
    try:
        with psycopg.connect(pg_url, connect_timeout=CONNECT_TIMEOUT) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"PostgreSQL at {mask_url(pg_url)} not reachable: {str(exc).strip()}"
    return None


def _amqp(url: str) -> Connection:
    return Connection(url, connect_timeout=CONNECT_TIMEOUT)  # type: ignore[no-untyped-call]


def _after_scheme(url: str) -> str:
    return url.split("://", 1)[1]


class PgqBroker(Broker):
    """pgq in a fresh schema (``schema`` option and ``PGQ_SCHEMA``), dropped afterwards.

    ``options`` are further transport options, set the same way in the worker
    (``PGQ_<KEY>``): ``pgq-async`` is pgq with ``durable_publish`` off.
    """

    def __init__(self, pg_url: str, name: str = "pgq", options: dict[str, Any] | None = None):
        self.pg_url = pg_url
        self.name = name
        self.options = dict(options or {})

    def check(self) -> str | None:
        return _pg_unreachable(self.pg_url)

    def setup(self, run_id: str) -> Target:
        # A schema per variant and run: one variant's teardown never touches another's.
        schema = f"{self.name.replace('-', '_')}_bench_{run_id}"
        env = {"PGQ_SCHEMA": schema}
        env.update({f"PGQ_{k.upper()}": str(v).lower() for k, v in self.options.items()})
        # The transport migrates the schema on first connect, as it would for a user.
        return Target(
            broker_url="pgq://" + _after_scheme(self.pg_url),
            queue=f"bench_{run_id}",
            transport_options={"schema": schema, **self.options},
            env=env,
        )

    def teardown(self, target: Target) -> None:
        schema = target.transport_options["schema"]
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


class PgqBouncerBroker(PgqBroker):
    """pgq behind a PgBouncer of its own (transaction pooling, started for the run):
    ``use_notify`` off, and with ``listen`` a direct LISTEN-only session per process
    (``listen_url``, Postgres itself); without it, idle workers poll."""

    def __init__(self, pg_url: str, name: str, *, listen: bool) -> None:
        options: dict[str, Any] = {"use_notify": False}
        if listen:
            options["listen_url"] = "pgq://" + _after_scheme(pg_url)
        super().__init__(pg_url, name, options)
        self._bouncer: contextlib.AbstractContextManager[Any] | None = None

    def check(self) -> str | None:
        if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
            return "pgbouncer is not installed"
        return super().check()

    def setup(self, run_id: str) -> Target:
        target = super().setup(run_id)
        # The schema is made on Postgres directly, as `pgq migrate` would.
        conn = Connection(target.broker_url, transport_options=target.transport_options)  # type: ignore[no-untyped-call]
        with conn:
            conn.connect()  # type: ignore[no-untyped-call]
        self._bouncer = pgbouncer(self.pg_url, pool_size=8)
        try:
            bouncer = self._bouncer.__enter__()
        except BouncerUnavailable:
            self._bouncer = None
            raise
        target.broker_url = bouncer.url("pgq")
        return target

    def teardown(self, target: Target) -> None:
        if self._bouncer is not None:
            self._bouncer.__exit__(None, None, None)
            self._bouncer = None
        super().teardown(target)


class RedisBroker(Broker):
    """Redis in a dedicated database number, flushed before and after."""

    name = "redis"

    def __init__(self, redis_url: str, db: int) -> None:
        parts = urlsplit(redis_url)
        self.url = urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, ""))

    def _client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_TIMEOUT)

    def check(self) -> str | None:
        try:
            self._client().ping()
        except redis.RedisError as exc:
            return f"Redis at {mask_url(self.url)} not reachable: {exc}"
        return None

    def setup(self, run_id: str) -> Target:
        self._client().flushdb()
        return Target(broker_url=self.url, queue=f"bench_{run_id}")

    def teardown(self, target: Target) -> None:
        self._client().flushdb()


class RedisFsyncBroker(Broker):
    """A Redis server of its own per round that fsyncs every write before it answers
    (``appendonly yes``, ``appendfsync always``): a publish that returns is on disk, the
    guarantee durable pgq gives. The ``redis`` broker is the Redis server as it is
    configured (by default without an append-only file: a crash loses what came after
    its last snapshot); this one is Redis made as durable as durable pgq, for a
    like-for-like publish rate.

    It listens on a free local TCP port (as the other brokers are reached) and keeps its
    data in a new directory under ``data_dir`` (default: the system's temporary
    directory), removed at teardown. Put ``data_dir`` on the disk that holds
    Postgres's WAL: an fsync costs what that disk takes, nothing on a tmpfs. Teardown
    stops the server (a harness stopped by Ctrl-C too; one killed by a signal leaves it
    running).
    """

    name = "redis-fsync"

    def __init__(self, data_dir: Path | None = None, server: str = "redis-server") -> None:
        self.data_dir = data_dir
        self.server = server
        self._running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}

    def check(self) -> str | None:
        if shutil.which(self.server) is None:
            return f"{self.server} not found on PATH (this broker starts a Redis of its own)"
        if self.data_dir is not None and not self.data_dir.is_dir():
            return f"data directory {self.data_dir} does not exist"
        return None

    def setup(self, run_id: str) -> Target:
        directory = Path(tempfile.mkdtemp(prefix=f"pgq-bench-redis-{run_id}-", dir=self.data_dir))
        port = free_port()
        command = [
            self.server, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--logfile", "redis.log", "--daemonize", "no",
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=directory
        )
        url = f"redis://127.0.0.1:{port}/0"
        self._running[url] = (process, directory)
        try:
            _await_redis(url, process, directory / "redis.log")
        except BaseException:
            self.teardown(Target(broker_url=url, queue=""))
            raise
        return Target(broker_url=url, queue=f"bench_{run_id}")

    def teardown(self, target: Target) -> None:
        process, directory = self._running.pop(target.broker_url)
        try:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _await_redis(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the started server answers, and check it fsyncs every write."""

    def answer() -> dict[str, str]:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"redis-server exited with {process.returncode}: {tail}")
        with redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT) as client:
            return dict(client.config_get("appendfsync"))

    retrying = Retrying(
        retry=retry_if_exception_type(redis.ConnectionError),
        stop=stop_after_delay(10),
        wait=wait_fixed(0.05),
        reraise=True,
    )
    settings = retrying(answer)
    if settings.get("appendfsync") != "always":
        raise RuntimeError(f"redis-server at {url} does not fsync every write: {settings}")


class AmqpBroker(Broker):
    """RabbitMQ with a queue (and exchange) named for this run, deleted afterwards.

    ``confirm``: publish with publisher confirms (``confirm_publish``), so that
    ``apply_async`` returns once RabbitMQ has taken the persistent message into its
    durable queue, the guarantee durable pgq gives. Without it, the publish returns
    once the frame is written to the socket.
    """

    def __init__(self, amqp_url: str, *, confirm: bool = False) -> None:
        self.url = amqp_url
        self.confirm = confirm
        self.name = "rabbitmq-confirm" if confirm else "rabbitmq"

    def check(self) -> str | None:
        try:
            with _amqp(self.url) as conn:
                conn.ensure_connection(max_retries=1)
        except Exception as exc:  # kombu raises a variety of socket and amqp errors
            return f"RabbitMQ at {mask_url(self.url)} not reachable: {exc}"
        return None

    def setup(self, run_id: str) -> Target:
        if not self.confirm:
            return Target(broker_url=self.url, queue=f"bench_{run_id}")
        # Its own queue: both variants may run in the same round on the same server.
        return Target(
            broker_url=self.url,
            queue=f"bench_confirm_{run_id}",
            transport_options={"confirm_publish": True},
        )

    def teardown(self, target: Target) -> None:
        # Celery names the default exchange after the default queue.
        with _amqp(self.url) as conn:
            channel = conn.default_channel
            channel.queue_delete(target.queue)
            channel.exchange_delete(target.queue)


class SqlaBroker(Broker):
    """kombu's SQLAlchemy transport on a scratch database, created and dropped per run.

    The URL is ``sqla+postgresql+psycopg://``: plain ``sqla+postgresql://`` means
    SQLAlchemy's default driver, psycopg2, which this project does not depend on.
    """

    name = "sqla"

    def __init__(self, pg_url: str) -> None:
        self.pg_url = pg_url

    def check(self) -> str | None:
        reason = _pg_unreachable(self.pg_url)
        if reason:
            return reason
        try:
            import sqlalchemy  # noqa: F401  (optional: only this broker needs it)
        except ImportError:
            return "sqlalchemy is not installed (pip install sqlalchemy)"
        return None

    def _database_url(self, database: str) -> str:
        parts = urlsplit(self.pg_url)
        return urlunsplit(("postgresql+psycopg", parts.netloc, f"/{database}", parts.query, ""))

    def setup(self, run_id: str) -> Target:
        database = f"pgq_bench_sqla_{run_id}"
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        return Target(broker_url="sqla+" + self._database_url(database), queue=f"bench_{run_id}")

    def teardown(self, target: Target) -> None:
        _dispose_sqla_engine(target.broker_url)
        database = urlsplit(target.broker_url.removeprefix("sqla+")).path.lstrip("/")
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            # FORCE: a worker killed mid-run may leave sessions behind.
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )


def _dispose_sqla_engine(broker_url: str) -> None:
    """Close the publisher's pooled connections; kombu caches one engine per URL."""
    with contextlib.suppress(ImportError):
        from kombu.transport.sqlalchemy import Channel

        cached = Channel._engines.pop(broker_url.removeprefix("sqla+"), None)
        if cached is not None:
            cached[0].dispose()
