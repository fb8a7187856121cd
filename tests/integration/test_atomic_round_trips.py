"""How many round trips an atomic run makes on a psycopg connection (issue 46: its cost
against a plain task's BEGIN, body, COMMIT), counted from libpq's own trace of the
messages the client sends: each round trip ends with a simple ``Query`` or a ``Sync``."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

import pg_transport
from pg_transport.atomic.run import open_run
from tests.integration.conftest import PublishingStore

#: What ends a round trip, as libpq's trace writes a message the client sent.
ENDS = re.compile(r"^F\t\d+\t(Query|Sync)\b", re.MULTILINE)


class Traced:
    """A psycopg connection whose client messages libpq writes to a file."""

    def __init__(self, pg_url: str) -> None:
        self.conn = psycopg.connect(pg_url)
        # (open as long as libpq writes the connection's trace to it; closed by close())
        self._file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        pgconn = self.conn.pgconn
        pgconn.trace(self._file.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def round_trips(self) -> list[str]:
        """The round trips sent since the last call, by what ended each."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.seek(0)
        text = self._file.read()
        self._file.seek(0)
        self._file.truncate()
        return ENDS.findall(text)

    def close(self) -> None:
        self.conn.pgconn.untrace()
        self.conn.close()
        self._file.close()


@pytest.fixture
def traced(pg_url: str) -> Iterator[Traced]:
    found = Traced(pg_url)
    yield found
    found.close()


def atomic_task(pg_url: str, schema: str, conn: psycopg.Connection[Any]) -> Any:
    app = Celery("round-trips", broker="pgq://" + pg_url.split("://", 1)[1], set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.pgq_atomic_connection = lambda: conn

    @app.task(bind=True, base=pg_transport.AtomicTask)
    def noop(self: Any) -> None:
        pass

    return noop


def test_an_atomic_run_opens_in_one_round_trip(
    store: PublishingStore, traced: Traced, pg_url: str, schema: str
) -> None:
    """BEGIN, the open query and the body's savepoint go in one round trip (psycopg alone
    would send its BEGIN as one of its own, then the query, then the savepoint: three)."""
    task = atomic_task(pg_url, schema, traced.conn)
    # A connection's first run checks which server it is on (once per connection).
    first = open_run(task)
    assert first.finish(commit=False) is False
    traced.round_trips()

    run = open_run(task)
    assert traced.round_trips() == ["Query"]
    assert traced.conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    # The savepoint is there: the body's start can be rolled back to.
    traced.conn.execute("CREATE TEMPORARY TABLE body_wrote (i int)")
    run.rollback_body()
    assert traced.conn.execute("SELECT to_regclass('pg_temp.body_wrote')").fetchone() == (None,)
    traced.round_trips()
    assert run.finish(commit=True) is True
    assert traced.round_trips() == ["Query"]  # the COMMIT
    assert traced.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_run_refused_at_its_open_rolls_back_what_the_one_round_trip_began(
    store: PublishingStore, traced: Traced, pg_url: str, schema: str
) -> None:
    """The isolation check still refuses a connection set to REPEATABLE READ when the
    BEGIN travels with the query, and nothing is left open."""
    task = atomic_task(pg_url, schema, traced.conn)
    open_run(task).finish(commit=False)
    traced.conn.execute(
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ"
    )
    traced.conn.commit()
    with pytest.raises(pg_transport.TransactionRefused, match="REPEATABLE READ"):
        open_run(task)
    assert traced.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
