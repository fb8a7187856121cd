"""The pgq result backend against real Postgres: storing, reading, waiting, expiring.

Waiters and storers are separate Celery apps (a client and a "worker"), each with its
own connections, as in production; waits are real LISTEN sessions.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, signals, states
from celery.result import GroupResult
from psycopg import sql

from pg_transport.errors import ConfigurationError, NotPermitted
from pg_transport.results.backend import PgqBackend
from pg_transport.results.errors import ResultTooLarge
from pg_transport.results.expiry import REAP_INTERVAL, reap_expired
from pg_transport.results.listener import result_channel
from tests.pg import pgq_url, to_broker_url


def make_app(pg_url: str, schema: str, **conf: Any) -> Celery:
    url = to_broker_url(pg_url)
    app = Celery("results-test", broker=url, backend=url, set_as_current=False)
    app.conf.update(broker_transport_options={"schema": schema}, **conf)
    return app


@pytest.fixture
def apps(pg_url: str, schema: str) -> Iterator[tuple[Celery, Celery]]:
    """(client, worker): the one waits, the other stores."""
    client, worker = make_app(pg_url, schema), make_app(pg_url, schema)
    yield client, worker
    for app in (client, worker):
        app.backend.listener.stop()


def q(pg_url: str, schema: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        cur = conn.execute(sql.SQL(query).format(schema=sql.Identifier(schema)), params)
        return cur.fetchall() if cur.description else []


SERIALIZERS = ["json", "pickle", "yaml", "msgpack"]


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_states_round_trip_with_every_serializer(pg_url: str, schema: str, serializer: str) -> None:
    if serializer == "msgpack" and importlib.util.find_spec("msgpack") is None:
        pytest.skip("msgpack is not installed")
    conf = {
        "result_serializer": serializer,
        "accept_content": [serializer, "json"],
        "result_extended": True,
    }
    writer, reader = make_app(pg_url, schema, **conf), make_app(pg_url, schema, **conf)
    wb, rb = writer.backend, reader.backend
    wb.store_result("t-ok", {"n": [1, 2.5, "x"], "nested": {"a": None}}, states.SUCCESS)
    wb.store_result("t-run", {"pid": 7}, states.STARTED)
    wb.store_result("t-bad", KeyError("gone"), states.FAILURE, traceback="Traceback: here")
    ok = rb.get_task_meta("t-ok")
    assert ok["status"] == states.SUCCESS
    assert ok["result"] == {"n": [1, 2.5, "x"], "nested": {"a": None}}
    assert ok["date_done"] is not None
    assert rb.get_task_meta("t-run")["status"] == states.STARTED
    bad = rb.get_task_meta("t-bad")
    assert bad["status"] == states.FAILURE
    assert isinstance(bad["result"], KeyError) and bad["traceback"] == "Traceback: here"
    assert rb.get_task_meta("never")["status"] == states.PENDING
    row = q(pg_url, schema, "SELECT content_type FROM {schema}.result WHERE task_id = 't-ok'")
    assert row == [(wb.content_type,)]


def test_a_reader_refuses_a_content_type_it_does_not_accept(pg_url: str, schema: str) -> None:
    writer = make_app(pg_url, schema, result_serializer="pickle", accept_content=["pickle"])
    reader = make_app(pg_url, schema, accept_content=["json"])
    writer.backend.store_result("t", {"x": 1}, states.SUCCESS)
    from kombu.exceptions import ContentDisallowed

    with pytest.raises(ContentDisallowed):
        reader.backend.get_task_meta("t")


def test_compressed_results_round_trip(pg_url: str, schema: str) -> None:
    app = make_app(pg_url, schema, result_compression="gzip")
    value = "abc" * 10_000
    app.backend.store_result("t", value, states.SUCCESS)
    size = q(pg_url, schema, "SELECT octet_length(meta) FROM {schema}.result")[0][0]
    assert size < 2_000  # stored compressed
    assert make_app(pg_url, schema).backend.get_task_meta("t")["result"] == value


def test_a_success_is_never_overwritten(apps: tuple[Celery, Celery]) -> None:
    _, worker = apps
    worker.backend.store_result("t", 1, states.SUCCESS)
    worker.backend.store_result("t", None, states.STARTED)  # a redelivery's start
    worker.backend.store_result("t", ValueError("late"), states.FAILURE)
    meta = worker.backend.get_task_meta("t", cache=False)
    assert (meta["status"], meta["result"]) == (states.SUCCESS, 1)


def test_get_is_woken_by_the_store_and_idle_waiting_sends_nothing(
    apps: tuple[Celery, Celery],
) -> None:
    client, worker = apps
    result = client.AsyncResult("t-wake")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(result.get(timeout=20)))
    waiter.start()
    listener = client.backend.listener
    deadline = time.monotonic() + 10
    while listener.waiting() != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Subscribed: its LISTEN and first read are done once two statements went out.
    while listener.statements < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = listener.statements
    time.sleep(1.0)  # a real second of waiting: no poll may happen in it
    assert listener.statements == before
    started = time.monotonic()
    worker.backend.store_result("t-wake", "done", states.SUCCESS)
    waiter.join(10)
    assert got == ["done"]
    assert time.monotonic() - started < 1.0  # woken, not polled (the drainer's step is 1 s)


def test_a_result_commits_before_its_wake_up_is_sent(
    pg_url: str, schema: str, apps: tuple[Celery, Celery]
) -> None:
    """The stored row and its wake-up are two transactions: while the row's commit is in
    progress the wake-up has not run in it. In one transaction the wake-up's NOTIFY would
    hold Postgres' notify lock through the row's WAL flush, and every other session's
    NOTIFYing commit (a publish, another result) would queue behind it.

    The row's commit is held at a deferred trigger (an advisory lock this test holds);
    the session is then asked which statement it ran last: the INSERT, not the NOTIFY."""
    client, worker = apps
    worker.backend.store_result("t-warm", 0, states.SUCCESS)  # the schema is there
    key = 4_205_001
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {schema}.hold() RETURNS trigger LANGUAGE plpgsql AS "
                "$$BEGIN PERFORM pg_advisory_xact_lock_shared({key}); RETURN NULL; END$$; "
                "CREATE CONSTRAINT TRIGGER hold AFTER INSERT ON {schema}.result "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.hold()"
            ).format(schema=sql.Identifier(schema), key=sql.Literal(key))
        )
        conn.execute("SELECT pg_advisory_lock(%s)", [key])
        stored = threading.Thread(
            target=worker.backend.store_result, args=("t-held", "done", states.SUCCESS)
        )
        stored.start()
        try:
            deadline = time.monotonic() + 20
            while True:
                held = conn.execute(
                    "SELECT query FROM pg_stat_activity WHERE wait_event = 'advisory' "
                    "AND pid <> pg_backend_pid() AND datname = current_database()"
                ).fetchall()
                if held:
                    break
                assert time.monotonic() < deadline, "the store never reached its commit"
                time.sleep(0.01)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", [key])
        stored.join(20)
    ((query,),) = held
    assert "INSERT" in query and "pg_notify" not in query, query
    assert client.AsyncResult("t-held").get(timeout=20) == "done"


def test_many_waiters_share_one_session(
    pg_url: str, schema: str, apps: tuple[Celery, Celery]
) -> None:
    client, worker = apps
    n = 60
    ids = [f"many-{i}" for i in range(n)]
    got: dict[str, Any] = {}
    lock = threading.Lock()

    def wait(task_id: str) -> None:
        value = client.AsyncResult(task_id).get(timeout=30)
        with lock:
            got[task_id] = value

    threads = [threading.Thread(target=wait, args=(t,)) for t in ids]
    for t in threads:
        t.start()
    listener = client.backend.listener
    deadline = time.monotonic() + 10
    while listener.waiting() != n:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    listening = q(
        pg_url,
        schema,
        "SELECT count(DISTINCT pid) FROM pg_stat_activity WHERE application_name = %s",
        f"pgq-results:{os.getpid()}",
    )[0][0]
    assert listening == 1
    for task_id in ids:
        worker.backend.store_result(task_id, task_id.upper(), states.SUCCESS)
    for t in threads:
        t.join(30)
    assert got == {t: t.upper() for t in ids}
    # Per result at most: its LISTEN batch, a read and an UNLISTEN batch (often fewer:
    # they are batched across results).
    assert listener.statements <= 3 * n + 4
    assert listener.waiting() == 0


@pytest.mark.parametrize("waiters", [5, 100])
def test_polling_costs_one_statement_per_interval_whatever_the_waiters(
    pg_url: str, schema: str, waiters: int
) -> None:
    interval = 0.1
    client = make_app(
        pg_url,
        schema,
        result_backend_transport_options={"use_notify": False, "polling_interval": interval},
    )
    worker = make_app(pg_url, schema)
    listener = client.backend.listener
    try:
        results = [client.AsyncResult(f"poll-{waiters}-{i}") for i in range(waiters)]
        threads = [
            threading.Thread(target=r.get, kwargs={"timeout": 30}, daemon=True) for r in results
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while listener.waiting() != waiters:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(2 * interval)
        before, window = listener.statements, 1.0
        time.sleep(window)
        spent = listener.statements - before
        # One batched read per interval (plus one for subscriptions landing late).
        assert spent <= window / interval + 2
        for r in results:
            worker.backend.store_result(r.id, 1, states.SUCCESS)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        listener.stop()


def test_a_forged_notification_delivers_nothing(
    pg_url: str, schema: str, apps: tuple[Celery, Celery]
) -> None:
    client, worker = apps
    result = client.AsyncResult("t-forged")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(result.get(timeout=20)))
    waiter.start()
    listener = client.backend.listener
    deadline = time.monotonic() + 10
    while listener.waiting() != 1 or listener.statements < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = listener.statements
    with psycopg.connect(pg_url, autocommit=True) as evil:
        evil.execute("SELECT pg_notify(%s, '')", [result_channel(schema, "t-forged")])
        evil.execute(
            "SELECT pg_notify(%s, %s)",
            [result_channel(schema, "t-forged"), '{"status": "SUCCESS", "result": "forged"}'],
        )
    while listener.statements == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not got and result.state == states.PENDING  # looked, found no row
    worker.backend.store_result("t-forged", "real", states.SUCCESS)
    waiter.join(10)
    assert got == ["real"]


def test_a_waiter_survives_its_session_being_terminated(
    pg_url: str, schema: str, apps: tuple[Celery, Celery]
) -> None:
    client, worker = apps
    result = client.AsyncResult("t-reaped")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(result.get(timeout=30)))
    waiter.start()
    listener = client.backend.listener
    deadline = time.monotonic() + 10
    while listener.waiting() != 1 or listener.statements < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    app_name = f"pgq-results:{os.getpid()}"
    killed = q(
        pg_url,
        schema,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE application_name = %s",
        app_name,
    )[0][0]
    assert killed == 1
    # Stored while the session is gone: the reconnect's read finds it.
    worker.backend.store_result("t-reaped", "after", states.SUCCESS)
    waiter.join(20)
    assert got == ["after"]


def test_forget_and_groups(apps: tuple[Celery, Celery]) -> None:
    client, worker = apps
    for i in range(3):
        worker.backend.store_result(f"g-{i}", i * 10, states.SUCCESS)
    group = GroupResult("grp", [client.AsyncResult(f"g-{i}") for i in range(3)], app=client)
    group.save()
    restored = GroupResult.restore("grp", app=worker)
    assert restored is not None and [r.id for r in restored.results] == ["g-0", "g-1", "g-2"]
    assert restored.get(timeout=5) == [0, 10, 20]
    assert client.GroupResult("grp", [client.AsyncResult(f"g-{i}") for i in range(3)]).join_native(
        timeout=5
    ) == [0, 10, 20]
    restored.delete()
    assert GroupResult.restore("grp", app=client) is None
    client.AsyncResult("g-1").forget()
    assert worker.backend.get_task_meta("g-1", cache=False)["status"] == states.PENDING
    assert worker.backend.get_task_meta("g-2", cache=False)["status"] == states.SUCCESS


def test_expired_results_are_reaped(pg_url: str, schema: str) -> None:
    app = make_app(pg_url, schema, result_expires=3600)
    short = make_app(pg_url, schema, result_expires=1)
    app.backend.store_result("keep", 1, states.SUCCESS)
    short.backend.store_result("old", 2, states.SUCCESS)
    GroupResult("old-group", [app.AsyncResult("old")], app=short).save()
    forever = make_app(pg_url, schema, result_expires=None)
    forever.backend.store_result("forever", 3, states.SUCCESS)
    never = "SELECT expires_at IS NULL FROM {schema}.result WHERE task_id = 'forever'"
    assert q(pg_url, schema, never) == [(True,)]
    q(
        pg_url,
        schema,
        "UPDATE {schema}.result SET expires_at = now() - interval '1 second' WHERE task_id = 'old'",
    )
    q(pg_url, schema, "UPDATE {schema}.result_group SET expires_at = now() - interval '1 second'")
    assert reap_expired(app.backend.connector, schema) == 2
    left = q(pg_url, schema, "SELECT task_id FROM {schema}.result ORDER BY task_id")
    assert left == [("forever",), ("keep",)]
    assert q(pg_url, schema, "SELECT count(*) FROM {schema}.result_group") == [(0,)]
    assert reap_expired(app.backend.connector, schema) == 0


def test_a_worker_on_the_pgq_backend_reaps_expired_results(pg_url: str, schema: str) -> None:
    """The result backend's own housekeeping (not the broker's): a worker whose backend is
    pgq's reaps expired results in the backend's database and schema from worker_ready,
    once at start and then every REAP_INTERVAL, until worker_shutdown."""
    # No barrier sweeper for this app, should the barrier's hooks be connected here.
    app = make_app(pg_url, schema, result_expires=3600, pgq_barrier_sweep_interval=0)
    app.backend.store_result("stale", 1, states.SUCCESS)
    app.backend.store_result("fresh", 2, states.SUCCESS)
    q(
        pg_url,
        schema,
        "UPDATE {schema}.result SET expires_at = now() - interval '1 second'"
        " WHERE task_id = 'stale'",
    )

    class Consumer:  # what worker_ready is sent by, as far as the hooks read it
        event_dispatcher = None
        hostname = "reaper-test"

        def __init__(self, app: Celery) -> None:
            self.app = app

    worker = Consumer(app)
    signals.worker_ready.send(sender=worker)
    try:
        # The first reap runs as the reaper starts: one interval bounds it generously.
        deadline = time.monotonic() + REAP_INTERVAL
        while q(pg_url, schema, "SELECT task_id FROM {schema}.result ORDER BY 1") != [("fresh",)]:
            assert time.monotonic() < deadline, "the worker's reaper never reaped"
            time.sleep(0.05)
    finally:
        signals.worker_shutdown.send(sender=worker)
    for reaper in [t for t in threading.enumerate() if t.name == "pgq-results-reaper"]:
        reaper.join(timeout=5)
        assert not reaper.is_alive(), "worker_shutdown did not stop the reaper"


def test_bad_input_gets_one_clear_error(pg_url: str, schema: str) -> None:
    with pytest.raises(ConfigurationError, match="unknown pgq result backend option 'use_notfy'"):
        PgqBackend(make_app(pg_url, schema, result_backend_transport_options={"use_notfy": 0}))
    with pytest.raises(ConfigurationError, match="polling_interval"):
        PgqBackend(
            make_app(pg_url, schema, result_backend_transport_options={"polling_interval": -1})
        )
    app = make_app(pg_url, schema, result_backend_transport_options={"max_result_bytes": 4096})
    with pytest.raises(ResultTooLarge, match="more than max_result_bytes \\(4096\\)"):
        app.backend.store_result("big", "x" * 10_000, states.SUCCESS)
    assert app.backend.get_task_meta("big")["status"] == states.PENDING
    # A failure too large to keep is stored as one that says so, never left unstored.
    app.backend.store_result("big-failure", ValueError("y" * 10_000), states.FAILURE)
    meta = app.backend.get_task_meta("big-failure")
    assert meta["status"] == states.FAILURE and isinstance(meta["result"], ResultTooLarge)


def test_a_role_without_grants_gets_one_clear_error(pg_url: str, schema: str) -> None:
    role = f"{schema}_nogrants"
    make_app(pg_url, schema).backend.store_result("t", 1, states.SUCCESS)  # migrates
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
        admin.execute(
            sql.SQL("GRANT SELECT ON {}.schema_version TO {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
    try:
        url = pgq_url(pg_url, user=role)
        app = Celery("nogrants", broker=url, backend=url, set_as_current=False)
        app.conf.broker_transport_options = {"schema": schema}
        with pytest.raises(NotPermitted, match=f"cannot read a result in schema '{schema}'"):
            app.backend.get_task_meta("t")
        with pytest.raises(NotPermitted, match="cannot store a result"):
            app.backend.store_result("t2", 1, states.SUCCESS)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_the_alias_resolves_to_the_backend(pg_url: str, schema: str) -> None:
    assert isinstance(make_app(pg_url, schema).backend, PgqBackend)


def test_a_reaped_connection_is_retried(pg_url: str, schema: str) -> None:
    app = make_app(pg_url, schema, result_backend_always_retry=True)
    backend = app.backend
    backend.store_result("before", 1, states.SUCCESS)
    # Every session of this process's pools, as a pooler or a restart would.
    killed = q(
        pg_url,
        schema,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE application_name = %s",
        f"pgq:{os.getpid()}",
    )[0][0]
    assert killed >= 1
    backend.store_result("after", 2, states.SUCCESS)  # on a fresh connection
    assert backend.get_task_meta("after")["result"] == 2
    dead = psycopg.OperationalError("server closed the connection unexpectedly")
    assert backend.exception_safe_to_retry(dead)
    assert not backend.exception_safe_to_retry(ResultTooLarge("too large"))
    assert not backend.exception_safe_to_retry(psycopg.errors.InsufficientPrivilege("no"))


class Inbox:
    """A subscriber that keeps what it is handed (the listener's side of a waiter)."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def deliver(self, row: Any) -> None:
        self.rows.append(row)


def test_a_new_waiter_is_handed_the_row_and_the_others_not_again(
    apps: tuple[Celery, Celery],
) -> None:
    client, worker = apps
    worker.backend.store_result("twice", "v1", states.STARTED)
    listener = client.backend.listener
    first, second = Inbox(), Inbox()
    listener.subscribe("twice", first)
    deadline = time.monotonic() + 10
    while not first.rows:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    listener.subscribe("twice", second)
    while not second.rows:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [r.status for r in first.rows] == [states.STARTED]
    worker.backend.store_result("twice", "v2", states.SUCCESS)  # a change: both see it
    while len(first.rows) < 2 or len(second.rows) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [r.status for r in first.rows] == [states.STARTED, states.SUCCESS]
    assert [r.status for r in second.rows] == [states.STARTED, states.SUCCESS]
    listener.unsubscribe("twice", first)
    listener.unsubscribe("twice", second)


@pytest.mark.parametrize(
    "payload",
    [
        # A body that claims base64 and is not.
        {
            "body": "not base64 at all!",
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "headers": {"task": "t"},
            "properties": {"body_encoding": "base64"},
        },
        # Headers and properties of the wrong shape.
        {"body": "W10=", "content-type": "application/json", "headers": ["x"], "properties": "p"},
    ],
    ids=["not-base64", "wrong-shapes"],
)
def test_a_dead_lettered_task_with_a_hostile_message_still_fails_its_result(
    apps: tuple[Celery, Celery], payload: dict[str, Any]
) -> None:
    """The dead-letter receiver ends the result whatever the message held, so get()
    raises DeadLettered at once instead of waiting to its timeout."""
    from celery import _state

    from pg_transport.results import deadletters
    from pg_transport.results.errors import DeadLettered
    from pg_transport.signals import message_dead_lettered

    deadletters.connect()  # as a pgq worker's transport does when it loads
    client, worker = apps
    task_id = str(uuid.uuid4())
    previous = _state.get_current_app()
    worker.set_current()
    try:
        message_dead_lettered.send(
            sender=None,
            queue="celery",
            task_id=task_id,
            reason="poisoned",
            dead_letter_id=7,
            payload=payload,
            settled=False,
        )
    finally:
        previous.set_current()
    with pytest.raises(DeadLettered, match="dead letter 7"):
        client.AsyncResult(task_id).get(timeout=30)


def test_a_result_collected_while_this_thread_subscribes_stops_nothing(
    pg_url: str, schema: str
) -> None:
    """Celery's ``AsyncResult.__del__`` stops waiting for its task (``cancel_for``: the
    process's listener, its locks) wherever the garbage collector finalizes it: on any
    thread, at any allocation, so also inside the listener's own locked sections, on a
    thread that holds them (a chord's failure building its errbacks' results hung so,
    holding the chord's row: the collector ran inside ``listener_for``). Here a waiter
    dropped in a reference cycle is collected after k more allocations, for every k up
    to well past the end of a new waiter's subscription (its listener made anew): the
    subscribing thread must never stop."""
    app = make_app(pg_url, schema)
    backend = app.backend
    errors: list[BaseException] = []

    def subscribe() -> None:
        try:
            for k in range(1, 120):
                gc.disable()
                dropped = app.AsyncResult(f"dropped-{k}", backend=backend)
                backend.add_pending_result(dropped, weak=True)
                dropped.cycle = [dropped]  # garbage only the collector finds
                del dropped
                backend.listener.stop()  # the next waiter's listener is made anew
                kept = app.AsyncResult(f"kept-{k}", backend=backend)
                gc.set_threshold(gc.get_count()[0] + k, 1, 1)
                gc.enable()
                backend.add_pending_result(kept)
        except BaseException as exc:
            errors.append(exc)

    thresholds = gc.get_threshold()
    try:
        thread = threading.Thread(target=subscribe, daemon=True)
        thread.start()
        thread.join(60)
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()
    assert not thread.is_alive(), "the subscribing thread is stuck"
    assert errors == []
    backend.listener.stop()
