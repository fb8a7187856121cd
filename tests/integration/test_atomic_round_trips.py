"""How many round trips an atomic run makes on a psycopg connection (issue 46: its cost
against a plain task's BEGIN, body, COMMIT), counted from libpq's own trace of the
messages the client sends: each round trip ends with a simple ``Query`` or a ``Sync``.
A run is its open (one), its body's statements, and its fence with its COMMIT (one)."""

from __future__ import annotations

import logging
import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.app.trace import build_tracer
from psycopg import sql

import pg_transport
from pg_transport.atomic.run import open_run
from pg_transport.errors import NotPermitted
from pg_transport.message.rows import Lease
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

    def sent(self) -> str:
        """What the client sent since the last call (libpq's trace), as text."""
        self._file.flush()
        self._file.seek(0)
        text = self._file.read()
        self._file.seek(0)
        self._file.truncate()
        return text

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


def claimed(store: PublishingStore) -> Lease:
    store.declare_queue("q")
    store.publisher.publish("q", {"body": "b", "headers": {"id": "t1"}}, priority=0)
    (row,) = store.claim(["q"], [30.0], 1)
    return Lease(row.id, row.lease, "q", "t1")


def bump_task(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], ran: list[str] | None = None
) -> Any:
    """The benchmark's body (benchmarks/exactly_once.py): an UPDATE and an INSERT (then
    the task's id added to ``ran``)."""
    app = Celery("round-trips", broker="pgq://" + pg_url.split("://", 1)[1], set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.pgq_atomic_connection = lambda: conn
    s = sql.Identifier(schema)

    @app.task(bind=True, base=pg_transport.AtomicTask)
    def bump(self: Any) -> None:
        on = self.transaction.connection
        on.execute(sql.SQL("UPDATE {}.counter SET n = n + 1 WHERE id = 1").format(s))
        on.execute(sql.SQL("INSERT INTO {}.audit VALUES (%s)").format(s), [self.request.id])
        if ran is not None:
            ran.append(self.request.id)

    return bump


def deliver(task: Any, token: Lease) -> None:
    """Run ``task`` as a worker runs a delivery: Celery's trace, whose ``task_postrun``
    commits the run; the delivery's token where the transport puts it."""
    info = {"pgq_token": [token.id, token.lease], "pgq_queue": token.queue}
    tracer = build_tracer(task.name, task, app=task.app, propagate=True)
    tracer(token.task, (), {}, {"id": token.task, "properties": {"delivery_info": info}})


@pytest.fixture
def tables(pg_url: str, schema: str, store: PublishingStore) -> Iterator[None]:
    s = sql.Identifier(schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.counter (id int PRIMARY KEY, n int)").format(s))
        conn.execute(sql.SQL("INSERT INTO {}.counter VALUES (1, 0)").format(s))
        conn.execute(sql.SQL("CREATE TABLE {}.audit (task_id text)").format(s))
    yield


def counted(pg_url: str, schema: str) -> tuple[int, int, int]:
    s = sql.Identifier(schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT (SELECT n FROM {0}.counter), (SELECT count(*) FROM {0}.audit),"
                " (SELECT count(*) FROM {0}.message)"
            ).format(s)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_an_atomic_run_of_two_statements_makes_four_round_trips(
    store: PublishingStore, tables: None, traced: Traced, pg_url: str, schema: str
) -> None:
    """Open (1), the body's UPDATE and INSERT (2), the fence with the COMMIT (1): four,
    as a plain task's BEGIN, UPDATE, INSERT, COMMIT (the fence alone used to take a
    fifth). What it ended committed: the writes and the end of the delivery."""
    task = bump_task(pg_url, schema, traced.conn)
    open_run(task).finish(commit=False)  # the connection's server check, once
    token = claimed(store)
    traced.round_trips()
    deliver(task, token)
    # (psycopg sends a statement without values as a simple query: the UPDATE's "Query")
    assert traced.round_trips() == ["Query", "Query", "Sync", "Query"]
    assert traced.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert counted(pg_url, schema) == (1, 1, 0)


def test_a_stale_run_is_refused_at_its_commit_and_keeps_nothing(
    store: PublishingStore,
    tables: None,
    traced: Traced,
    pg_url: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run whose lease was taken (the message claimed again under a new lease) runs its
    body and success path, then its fence refuses the COMMIT that travels with it:
    nothing of the run commits, the message stays the new delivery's, and the worker's
    log says why in one line."""
    task = bump_task(pg_url, schema, traced.conn)
    open_run(task).finish(commit=False)
    token = claimed(store)
    stale = Lease(token.id, token.lease - 1, token.queue, token.task)
    traced.round_trips()
    with caplog.at_level(logging.ERROR, logger="pg_transport.atomic"):
        deliver(task, stale)
    # The refused fence skips the COMMIT; the ROLLBACK that follows is the fifth.
    assert traced.round_trips() == ["Query", "Query", "Sync", "Query", "Query"]
    assert traced.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert counted(pg_url, schema) == (0, 0, 1)
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "lapsed and the message went to another delivery" in record.getMessage()
    assert "commit was refused" in record.getMessage()
    # The delivery that holds the message now still completes it.
    deliver(task, token)
    assert counted(pg_url, schema) == (1, 1, 0)


@pytest.fixture
def roles(pg_url: str, schema: str, tables: None) -> Iterator[tuple[str, str]]:
    """A role with a worker's rights to end a delivery (and the body's tables), and one
    without any, which the first may ``SET ROLE`` to."""
    suffix = uuid.uuid4().hex[:10]
    able, unable = f"pgq_t_able_{suffix}", f"pgq_t_unable_{suffix}"
    s = sql.Identifier(schema)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(able)))
        admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(unable)))
        admin.execute(sql.SQL("GRANT {} TO {}").format(*map(sql.Identifier, (unable, able))))
        for grant in (
            "GRANT USAGE ON SCHEMA {0} TO {1}",
            "GRANT SELECT, DELETE ON {0}.message TO {1}",
            "GRANT SELECT, UPDATE ON {0}.counter TO {1}",
            "GRANT INSERT ON {0}.audit TO {1}",
        ):
            admin.execute(sql.SQL(grant).format(s, sql.Identifier(able)))
    yield able, unable
    with psycopg.connect(pg_url, autocommit=True) as admin:
        for role in (able, unable):
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def published(store: PublishingStore, task_id: str) -> Lease:
    store.declare_queue("q")
    store.publisher.publish("q", {"body": "b", "headers": {"id": task_id}}, priority=0)
    (row,) = store.claim(["q"], [30.0], 1)
    return Lease(row.id, row.lease, "q", task_id)


def test_a_right_revoked_between_two_runs_on_one_connection_refuses_the_second_commit(
    store: PublishingStore,
    roles: tuple[str, str],
    pg_url: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The open asks whether the run's role may end a delivery once per connection and
    role (issue 46: four privilege lookups a run otherwise). A right revoked after the
    first run is not asked at the second run's open: its body runs, and the fence (the
    caller's rights) refuses its COMMIT, so nothing of it commits, and the log names the
    role and what to grant. The next open on that connection asks again, and refuses
    before the body, as the first run of a role without rights always is."""
    able, _ = roles
    conn = psycopg.connect(pg_url, user=able)
    try:
        ran: list[str] = []
        task = bump_task(pg_url, schema, conn, ran)
        deliver(task, published(store, "t1"))
        assert counted(pg_url, schema) == (1, 1, 0)
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("REVOKE DELETE ON {}.message FROM {}").format(
                    sql.Identifier(schema), sql.Identifier(able)
                )
            )
        with caplog.at_level(logging.ERROR, logger="pg_transport.atomic"):
            deliver(task, published(store, "t2"))
        # The body ran (its UPDATE and INSERT were sent) and none of it committed.
        assert ran == ["t1", "t2"]
        assert counted(pg_url, schema) == (1, 1, 1)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        message = record.getMessage()
        assert "may no longer end a delivery" in message, message
        assert repr(able) in message and "commit was refused" in message, message
        assert "GRANT pgq_worker" in message, message
        # Asked again at the next open on that connection: refused before any body.
        with pytest.raises(NotPermitted, match=f"its role '{able}' may not end a delivery"):
            open_run(task)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()


def test_a_role_changed_on_a_connection_is_asked_again_before_its_body(
    store: PublishingStore, roles: tuple[str, str], pg_url: str, schema: str
) -> None:
    """The answer kept is the role's, not the connection's: a session whose role changed
    (SET ROLE) since its last run is asked again, and a role without the rights is named
    before the body runs."""
    able, unable = roles
    conn = psycopg.connect(pg_url, user=able)
    try:
        task = bump_task(pg_url, schema, conn)
        deliver(task, published(store, "t1"))
        assert counted(pg_url, schema) == (1, 1, 0)
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(unable)))
        conn.commit()
        with pytest.raises(NotPermitted, match=f"its role '{unable}' may not end a delivery"):
            open_run(task)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.execute("RESET ROLE")
        conn.commit()
        deliver(task, published(store, "t2"))
        assert counted(pg_url, schema) == (2, 2, 0)
    finally:
        conn.close()


def test_a_connection_whose_role_was_found_permitted_opens_without_its_rights_lookups(
    store: PublishingStore, traced: Traced, pg_url: str, schema: str
) -> None:
    """The open's four rights lookups are parsed and planned by the server on every run
    even when skipped: once a connection's role was found permitted, its runs send the
    short open (still one round trip), which asks only whether the role is that one."""
    task = atomic_task(pg_url, schema, traced.conn)
    traced.sent()
    open_run(task).finish(commit=False)
    assert "has_table_privilege" in traced.sent()
    run = open_run(task)
    text = traced.sent()
    assert "has_table_privilege" not in text and "pg_current_xact_id" in text
    assert len(ENDS.findall(text)) == 1
    assert run.finish(commit=True) is True


@pytest.mark.parametrize(
    ("conf", "prepares"),
    [
        ({}, True),
        ({"broker_transport_options": {"use_notify": False}}, False),
        ({"pgq_atomic_url": "same"}, False),
    ],
    ids=["broker-url", "use-notify-off", "atomic-url"],
)
def test_pgq_s_own_atomic_connection_prepares_unless_a_pooler_may_be_in_between(
    store: PublishingStore,
    pg_url: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
    conf: dict[str, Any],
    prepares: bool,
) -> None:
    """Like a plain task's psycopg connection, pgq's own one prepares what runs on it
    often (the task's SQL: parsed and planned once, not each run), but only on the
    broker's URL with use_notify on (pgq's sessions are its own: no transaction pooler);
    behind ``use_notify=False``, or on a ``pgq_atomic_url`` of its own, nothing is."""
    from pg_transport.atomic import providers

    monkeypatch.setattr(providers, "_own", {})
    broker = "pgq://" + pg_url.split("://", 1)[1]
    app = Celery("prepares", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = {
        "schema": schema,
        **conf.get("broker_transport_options", {}),
    }
    if "pgq_atomic_url" in conf:
        app.conf.pgq_atomic_url = broker

    @app.task(bind=True, base=pg_transport.AtomicTask)
    def noop(self: Any) -> None:
        pass

    handle = providers.handle_for(noop)
    conn = handle.target
    try:
        assert conn.prepare_threshold == (5 if prepares else None)
        for _ in range(6):
            conn.execute("SELECT 1 WHERE %s", [True])
        found = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        assert found is not None and (found[0] > 0) is prepares
        conn.rollback()
    finally:
        conn.close()


def test_an_app_s_atomic_settings_are_read_once_per_process(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pgq_atomic_connection`` (and the URL of pgq's own connection) are read at the
    app's first atomic run in a process, not on every run (four settings reads a run),
    as the broker's settings are: a value changed later is seen by a process started
    after it (here: another pid, as in a prefork child), not by this one."""
    from pg_transport.atomic import providers

    with psycopg.connect(pg_url) as first, psycopg.connect(pg_url) as second:
        app = Celery("settings-once", broker="pgq://" + pg_url.split("://", 1)[1])
        app.conf.pgq_atomic_connection = lambda: first

        @app.task(bind=True, base=pg_transport.AtomicTask)
        def noop(self: Any) -> None:
            pass

        assert providers.handle_for(noop).target is first
        app.conf.pgq_atomic_connection = lambda: second
        assert providers.handle_for(noop).target is first
        real = os.getpid()
        monkeypatch.setattr(providers.os, "getpid", lambda: real + 1)
        assert providers.handle_for(noop).target is second
