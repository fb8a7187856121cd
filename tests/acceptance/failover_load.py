"""The load the failover tests put on a broker while it fails, and their tally.

Shared by test_failover.py (a primary and a streaming standby) and test_patroni.py
(Patroni): a backlog published in one batch, then two Celery workers (threads, acks_late:
:mod:`tests.acceptance.failover_app`) and a producer publishing a task every 20 ms with
Celery's publish retry, all on one multi-host URL. Each run is recorded on the test's
own server (:class:`Record`, the ``record`` fixture of conftest.py), never on the one
that fails. A task counts as published once its publish returned; the tally says which
of those never ran and how many ran twice.

    with under_load(url, primary, record, outcome, retries=200, environ={}) as load:
        ...                                  # the failure under test
        probe = load.probe()                 # published ahead of the backlog
        load.ran_at(probe, 60, "the probe")  # when it ran
        load.stop()                          # the producer stops
        load.wait_all_ran(60)
    outcome.lost, outcome.duplicates         # the runs counted once the workers stopped
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

import pg_transport
from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from tests.acceptance.harness import Env, wait_for, workers
from tests.pg import to_broker_url

__all__ = [
    "BACKLOG",
    "CONCURRENCY",
    "SCHEMA",
    "WORK",
    "WORKERS",
    "Load",
    "Record",
    "Tally",
    "migrate",
    "under_load",
]

WORK = "tests.acceptance.failover_app.work"
SCHEMA = "pgq"
WORKERS = ("w1", "w2")
CONCURRENCY = 4
BACKLOG = 1500


@dataclass
class Tally:
    """Every task published (its publish returned) and how often each ran."""

    published: dict[str, float] = field(default_factory=dict)  # task id: when it returned
    runs: Counter[str] = field(default_factory=Counter)
    #: When the producer's last publish returned (set by its thread: no iteration of
    #: published from another).
    last_published: float = 0.0

    @property
    def lost(self) -> set[str]:
        return set(self.published) - set(self.runs)

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.runs.values() if n > 1)


@dataclass
class Record:
    """Where the workers record their runs: the test's own server, not the one failing."""

    pg_url: str
    schema: str

    def create(self) -> None:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE SCHEMA {0}; CREATE TABLE {0}.runs (run_id uuid PRIMARY KEY,"
                    " task_id text NOT NULL, n integer,"
                    " at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ).format(sql.Identifier(self.schema))
            )

    def runs(self) -> list[tuple[str, float]]:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            query = sql.SQL("SELECT task_id, extract(epoch FROM at) FROM {}.runs").format(
                sql.Identifier(self.schema)
            )
            return [(str(r[0]), float(r[1])) for r in conn.execute(query)]


def migrate(primary_url: str) -> None:
    """pgq's schema on the server that takes writes."""
    connector = Connector(primary_url)
    ensure_schema(connector, SCHEMA, auto_migrate=True)
    connector.close()


def producer_app(url: str, retries: int) -> Celery:
    """A producer on ``url`` (a postgresql:// URL) whose publishes retry ``retries``
    times, 0.1-0.2 s apart: through the failover (``retries`` says for how long)."""
    app = Celery("producer", broker=to_broker_url(url), set_as_current=False)
    app.conf.broker_transport_options = {"schema": SCHEMA}
    app.conf.task_publish_retry_policy = {
        "max_retries": retries,
        "interval_start": 0,
        "interval_step": 0.1,
        "interval_max": 0.2,
    }
    return app


class Load:
    """The producer of a running :func:`under_load`, and what the test asks of the runs."""

    def __init__(self, app: Celery, record: Record, tally: Tally) -> None:
        self.app = app
        self.record = record
        self.tally = tally
        self._stop = threading.Event()
        self._producer = threading.Thread(target=self._produce)

    def _produce(self) -> None:
        n = BACKLOG
        with self.app.connection_for_write() as conn:
            while not self._stop.is_set():
                try:
                    result = self.app.send_task(WORK, args=[n], connection=conn)
                except Exception:
                    continue  # not published: not counted
                self.tally.published[result.id] = self.tally.last_published = time.time()
                n += 1
                self._stop.wait(0.02)

    def start(self) -> None:
        self._producer.start()

    def stop(self) -> None:
        """The producer stops publishing (and its last publish has returned)."""
        self._stop.set()
        if self._producer.is_alive():
            self._producer.join(60)

    def probe(self, conn: Any = None) -> str:
        """A task published now on ``conn`` (a new connection when None), ahead of the
        backlog (highest priority): its id, its publish's return time in the tally."""
        if conn is None:
            conn = self.app.connection_for_write()
        with conn:
            probe = self.app.send_task(WORK, args=[-1], priority=255, connection=conn).id
        self.tally.published[probe] = time.time()
        return str(probe)

    def ran_at(self, task: str, timeout: float, what: str) -> float:
        """When ``task`` first ran (waits for it)."""
        found: float = wait_for(
            lambda: next((at for ran, at in self.record.runs() if ran == task), None),
            timeout,
            what,
        )
        return found

    def wait_drained(self, url: str, timeout: float) -> None:
        """Nothing left in the queue on ``url`` (libpq picks the writable member): what
        survived has run and been acked, a delivery a stopped worker held included (it
        comes back when its lease runs out). For a case that loses messages, where
        "every published task ran" never holds."""
        query = sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(SCHEMA))

        def left() -> int:
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute(query).fetchone()
            return int(row[0]) if row else 0

        wait_for(lambda: left() == 0, timeout, "the queue to drain", step=0.5)

    def wait_all_ran(self, timeout: float) -> None:
        """Every task published so far has run (once at least)."""
        published = set(self.tally.published)
        wait_for(
            lambda: published <= {task for task, _ in self.record.runs()} or None,
            timeout,
            "every published task to run",
            step=0.5,
        )


@contextmanager
def under_load(
    url: str,
    primary_url: str,
    record: Record,
    tally: Tally,
    *,
    retries: int,
    environ: Mapping[str, str],
) -> Iterator[Load]:
    """The backlog published, the workers (``environ`` added to theirs) and the producer
    running on ``url`` (postgresql://, every member: libpq picks the writable one; pgq's
    schema made on ``primary_url``), yielded once tasks flow; once the block is left the
    producer and the workers stop, and the tally counts the runs."""
    migrate(primary_url)
    record.create()
    load = Load(producer_app(url, retries), record, tally)
    with load.app.connection_for_write() as conn, pg_transport.batch():
        for n in range(BACKLOG):
            tally.published[load.app.send_task(WORK, args=[n], connection=conn).id] = 0.0
    with workers(
        Env(url, SCHEMA),
        *WORKERS,
        app="tests.acceptance.failover_app",
        concurrency=CONCURRENCY,
        environ={
            **environ,
            "TEST_PG_URL": record.pg_url,
            "TEST_RUNS_SCHEMA": record.schema,
        },
    ):
        load.start()
        try:
            wait_for(lambda: len(record.runs()) >= 200, 60, "tasks flowing")
            yield load
        finally:
            load.stop()
    tally.runs = Counter(task for task, _ in record.runs())
