"""The fan-in barrier on a real Postgres: arming, counting, firing, failing,
sweeping, the callback's dedup, the worker hooks and the inspection views."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery import _state as celery_state
from psycopg import sql

from barrier import (
    TRANSPORT_MARKER,
    Barrier,
    BarrierError,
    BarrierExists,
    barrier_callback,
    barrier_stranded,
    current_connection,
    hooks,
    sweep,
)
from barrier.callback import skipped
from barrier.sweep import Sweeper
from pg_transport.db.locks import advisory_key
from pg_transport.fanin import state as st
from pg_transport.fanin.backend import Backend, backend_for, forget
from pg_transport.fanin.protocol import HEADER_BARRIER, HEADER_PART, HEADER_ROLE
from pg_transport.signals import message_poisoned
from tests.acceptance.harness import wait_for
from tests.integration.conftest import Peek
from tests.integration.squatter import squatter


class Calls:
    """What the in-process callback, errback and part tasks saw."""

    def __init__(self) -> None:
        self.callback: list[tuple[Any, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_after_effect = False


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
def app(broker_url: str, schema: str, calls: Calls) -> Iterator[Celery]:
    app = Celery("barrier-test", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.task_routes = {"t.routed": {"queue": "routed"}}

    @app.task(shared=False, name="t.part")
    def part(value: Any) -> Any:
        return value

    @app.task(shared=False, name="t.failing")
    def failing() -> None:
        raise ValueError("no luck")

    @app.task(shared=False, name="t.opaque")
    def opaque() -> Any:
        return object()

    @app.task(bind=True, shared=False, name="t.collect")
    @barrier_callback
    def collect(self: Any, results: Any, **kwargs: Any) -> int:
        with calls.lock:
            calls.callback.append((results, kwargs))
        conn = current_connection()
        if conn is not None:
            conn.execute(
                sql.SQL("INSERT INTO {}.barrier_effects (barrier_id) VALUES (%s)").format(
                    sql.Identifier(schema)
                ),
                [self.request.headers[HEADER_BARRIER]],
            )
        calls.entered.set()
        calls.release.wait(30)
        if calls.fail_after_effect:
            raise RuntimeError("worker died mid-callback")
        return len(results)

    yield app
    forget(app)


@pytest.fixture
def db(app: Celery, peek: Peek) -> Backend:
    # Side effects of the test callback.
    peek("CREATE TABLE {schema}.barrier_effects (barrier_id text NOT NULL)")
    return backend_for(app)


@pytest.fixture
def conn(pg_url: str, schema: str, db: Backend) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        yield c


def sigs(app: Celery, n: int, name: str = "t.part") -> list[Any]:
    return [app.signature(name, args=[f"r{i}"]) for i in range(n)]


def messages(peek: Peek) -> list[dict[str, Any]]:
    """Every queued message as (queue, priority, headers, args, kwargs)."""
    out = []
    for queue, priority, payload in peek(
        "SELECT queue, priority, payload FROM {schema}.message ORDER BY id"
    ):
        args, kwargs, _embed = json.loads(payload["body"])
        out.append(
            {
                "queue": queue,
                "priority": priority,
                "headers": payload["headers"],
                "task": payload["headers"]["task"],
                "args": args,
                "kwargs": kwargs,
            }
        )
    return out


def status(peek: Peek, barrier_id: str) -> tuple[str, int]:
    ((s, remaining),) = peek(
        "SELECT status, remaining FROM {schema}.barrier WHERE id = %s", barrier_id
    )
    return s, remaining


def done(db: Backend, conn: psycopg.Connection[Any], bid: str, index: int) -> str:
    return st.part_succeeded(db, conn, bid, index, json.dumps(f"r{index}"), f"task-{index}")


# -- dispatch -------------------------------------------------------------------
def test_dispatch_arms_and_queues_parts_with_headers_not_kwargs(
    app: Celery, db: Backend, peek: Peek
) -> None:
    parts = [
        app.signature("t.part", args=[0]),
        app.signature("t.part", args=[1], queue="other", priority=7),
        app.signature("t.routed", kwargs={"k": 2}),
    ]
    d = Barrier(app).dispatch("b1", parts, app.signature("t.collect"))
    assert status(peek, "b1") == ("armed", 3)
    queued = messages(peek)
    assert [m["queue"] for m in queued] == ["celery", "other", "routed"]
    assert [m["priority"] for m in queued] == [0, 7, 0]
    assert [m["headers"]["id"] for m in queued] == list(d.part_ids)
    for index, m in enumerate(queued):
        assert m["headers"][HEADER_BARRIER] == "b1"
        assert m["headers"][HEADER_PART] == index
        assert TRANSPORT_MARKER not in m["kwargs"] and HEADER_BARRIER not in m["kwargs"]
    assert queued[2]["kwargs"] == {"k": 2}
    assert Barrier(app).show("b1")["callback"] == {"task": "t.collect", "id": d.callback_id}


def test_a_part_with_a_countdown_waits_in_postgres(app: Celery, db: Backend, peek: Peek) -> None:
    parts = [app.signature("t.part", args=[0]), app.signature("t.part", args=[1], countdown=60)]
    Barrier(app).dispatch("b1", parts, app.signature("t.collect"))
    assert peek(
        "SELECT visible_at > now() + interval '50 s' FROM {schema}.message ORDER BY id"
    ) == [(False,), (True,)]


def test_dispatching_an_armed_id_is_refused_and_queues_nothing(
    app: Celery, db: Backend, peek: Peek
) -> None:
    Barrier(app).dispatch("b1", sigs(app, 2), app.signature("t.collect"))
    with pytest.raises(BarrierExists, match="'b1' already exists \\(status armed\\)"):
        Barrier(app).dispatch("b1", sigs(app, 5), app.signature("t.collect"))
    assert len(messages(peek)) == 2
    assert status(peek, "b1") == ("armed", 2)


def test_canvas_parts_and_bad_ids_are_refused(app: Celery, db: Backend) -> None:
    chain = app.signature("t.part", args=[1]) | app.signature("t.part")
    with pytest.raises(BarrierError, match="part 0 must be a single task signature"):
        Barrier(app).dispatch("b1", [chain], app.signature("t.collect"))
    with pytest.raises(BarrierError, match="non-empty string"):
        Barrier(app).dispatch("", [], app.signature("t.collect"))


@pytest.mark.sessions(10)
def test_dispatch_joins_the_callers_transaction(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek
) -> None:
    with pytest.raises(RuntimeError), conn.transaction():
        Barrier(app).dispatch("b1", sigs(app, 3), app.signature("t.collect"), conn=conn)
        raise RuntimeError("the caller's own work failed")
    assert peek("SELECT count(*) FROM {schema}.barrier") == [(0,)]
    assert messages(peek) == []


def test_zero_parts_fire_the_callback_at_once(app: Celery, db: Backend, peek: Peek) -> None:
    d = Barrier(app).dispatch("b0", [], app.signature("t.collect", kwargs={"x": 1}))
    assert status(peek, "b0") == ("fired", 0)
    [cb] = messages(peek)
    assert cb["task"] == "t.collect" and cb["headers"]["id"] == d.callback_id
    assert cb["args"] == [[]]
    assert cb["kwargs"] == {"x": 1, TRANSPORT_MARKER: True}
    assert cb["headers"][HEADER_BARRIER] == "b0"
    assert cb["headers"][HEADER_ROLE] == "callback"


# -- counting and firing ----------------------------------------------------------
@pytest.mark.sessions(10)
def test_last_part_fires_with_results_in_part_order(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek
) -> None:
    Barrier(app).dispatch("b1", sigs(app, 3), app.signature("t.collect", args=["extra"]))
    assert done(db, conn, "b1", 2) == st.COUNTED
    assert done(db, conn, "b1", 0) == st.COUNTED
    assert status(peek, "b1") == ("armed", 1)
    assert done(db, conn, "b1", 1) == st.FIRED
    assert status(peek, "b1") == ("fired", 0)
    callbacks = [m for m in messages(peek) if m["task"] == "t.collect"]
    assert len(callbacks) == 1
    assert callbacks[0]["args"] == [["r0", "r1", "r2"], "extra"]
    assert callbacks[0]["kwargs"] == {TRANSPORT_MARKER: True}


def test_immutable_callback_and_errback_get_no_results_or_failure(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek
) -> None:
    # .si(): as Celery's apply_async, the barrier's arguments are not prepended.
    Barrier(app).dispatch("b1", sigs(app, 1), app.signature("t.collect", args=[7], immutable=True))
    Barrier(app).dispatch(
        "b2",
        sigs(app, 1),
        app.signature("t.collect"),
        errback=app.signature("t.err", args=["x"], immutable=True),
    )
    assert done(db, conn, "b1", 0) == st.FIRED
    assert st.part_failed(db, conn, "b2", 0, "boom") == st.FAILED
    [callback] = [m for m in messages(peek) if m["task"] == "t.collect"]
    assert callback["args"] == [7]
    assert callback["kwargs"] == {TRANSPORT_MARKER: True}  # the marker is bookkeeping
    [errback] = [m for m in messages(peek) if m["task"] == "t.err"]
    assert errback["args"] == ["x"]


def test_a_redelivered_part_counts_once(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek
) -> None:
    Barrier(app).dispatch("b1", sigs(app, 3), app.signature("t.collect"))
    assert done(db, conn, "b1", 1) == st.COUNTED
    assert done(db, conn, "b1", 1) == st.DUPLICATE
    assert status(peek, "b1") == ("armed", 2)
    assert peek("SELECT count(*) FROM {schema}.barrier_part") == [(1,)]


def test_parts_of_unknown_barriers_or_out_of_range_are_ignored(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek
) -> None:
    Barrier(app).dispatch("b1", sigs(app, 2), app.signature("t.collect"))
    assert done(db, conn, "nope", 0) == st.IGNORED
    assert done(db, conn, "b1", 2) == st.DUPLICATE  # not recorded: index beyond total
    assert status(peek, "b1") == ("armed", 2)


@pytest.mark.sessions(11)
def test_callback_message_is_consumable_through_the_transport(
    app: Celery, db: Backend, conn: psycopg.Connection[Any]
) -> None:
    cb = app.signature("t.collect", serializer="pickle", queue="callbacks", priority=3)
    Barrier(app).dispatch("b1", sigs(app, 1), cb)
    assert done(db, conn, "b1", 0) == st.FIRED
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue("callbacks", accept=["pickle"])
        message = queue.get(timeout=10)
        args, kwargs, _embed = message.decode()
        assert message.headers["task"] == "t.collect"
        assert message.headers[HEADER_BARRIER] == "b1"
        assert message.properties["priority"] == 3
        assert (list(args), kwargs) == ([["r0"]], {TRANSPORT_MARKER: True})
        message.ack()
        queue.close()


# -- failure ----------------------------------------------------------------------
@pytest.mark.sessions(10)
def test_a_failed_part_fails_the_barrier_and_fires_the_errback_once(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek
) -> None:
    d = Barrier(app).dispatch(
        "b1",
        sigs(app, 3),
        app.signature("t.collect"),
        errback=app.signature("t.err", kwargs={"label": "x"}),
        metadata={"execution": 42},
    )
    assert done(db, conn, "b1", 0) == st.COUNTED
    assert st.part_failed(db, conn, "b1", 1, "ValueError('boom')") == st.FAILED
    assert st.part_failed(db, conn, "b1", 1, "ValueError('boom')") == st.DUPLICATE
    assert st.part_failed(db, conn, "b1", 2, "again") == st.IGNORED
    assert done(db, conn, "b1", 2) == st.DUPLICATE  # recorded as failed just above
    assert status(peek, "b1") == ("failed", 2)
    errbacks = [m for m in messages(peek) if m["task"] == "t.err"]
    assert len(errbacks) == 1
    assert errbacks[0]["headers"]["id"] == d.errback_id
    assert errbacks[0]["headers"][HEADER_ROLE] == "errback"
    assert errbacks[0]["kwargs"] == {"label": "x"}
    assert errbacks[0]["args"] == [
        {
            "barrier_id": "b1",
            "status": "failed",
            "part": 1,
            "total": 3,
            "remaining": 2,
            "reason": "part 1 failed: ValueError('boom')",
            "metadata": {"execution": 42},
        }
    ]
    assert not [m for m in messages(peek) if m["task"] == "t.collect"]


# -- the worker hooks (eager apply sends the same signals a worker does) ----------
def test_hooks_record_parts_from_message_headers(app: Celery, db: Backend, peek: Peek) -> None:
    Barrier(app).dispatch("b1", sigs(app, 2), app.signature("t.collect"))
    part = app.tasks["t.part"]
    part.apply(args=[{"n": 1}], headers={HEADER_BARRIER: "b1", HEADER_PART: 1})
    part.apply(args=[{"n": 1}], headers={HEADER_BARRIER: "b1", HEADER_PART: 1})
    assert status(peek, "b1") == ("armed", 1)
    part.apply(args=["plain"])  # no barrier headers: not a part, nothing happens
    part.apply(args=[[0]], headers={HEADER_BARRIER: "b1", HEADER_PART: 0})
    assert status(peek, "b1") == ("fired", 0)
    [cb] = [m for m in messages(peek) if m["task"] == "t.collect"]
    assert cb["args"] == [[[0], {"n": 1}]]


def test_hooks_fail_the_barrier_on_a_final_failure(app: Celery, db: Backend, peek: Peek) -> None:
    Barrier(app).dispatch("b1", sigs(app, 2), app.signature("t.collect"))
    app.tasks["t.failing"].apply(headers={HEADER_BARRIER: "b1", HEADER_PART: 0})
    assert peek("SELECT status, reason FROM {schema}.barrier") == [
        ("failed", "part 0 failed: ValueError('no luck')")
    ]


def test_a_result_that_is_not_json_fails_the_barrier(app: Celery, db: Backend, peek: Peek) -> None:
    Barrier(app).dispatch("b1", sigs(app, 2), app.signature("t.collect"))
    app.tasks["t.opaque"].apply(headers={HEADER_BARRIER: "b1", HEADER_PART: 0})
    ((s, reason),) = peek("SELECT status, reason FROM {schema}.barrier")
    assert s == "failed" and "not JSON-serializable" in reason


def test_a_poisoned_part_fails_the_barrier(app: Celery, db: Backend, peek: Peek) -> None:
    Barrier(app).dispatch(
        "b1", sigs(app, 2), app.signature("t.collect"), errback=app.signature("t.err")
    )
    # Part 1 went past max_attempts: the transport moved it to dead_letter and sends
    # message_poisoned (a poisoned message never reaches task_failure).
    ((dead_id, task_id),) = peek(
        "INSERT INTO {schema}.dead_letter (message_id, queue, read_ct, enqueued_at, reason,"
        " task_id, payload) SELECT id, queue, 5, enqueued_at, 'poisoned',"
        " payload->'headers'->>'id', payload FROM {schema}.message"
        " WHERE payload->'headers'->>'pgq_barrier_part' = '1' RETURNING id, task_id"
    )
    previous = celery_state.get_current_app()
    app.set_current()  # in a worker, the worker's app is the current one
    try:
        for _ in range(2):  # `pgq dead rehook` may send it again: no second errback
            responses = message_poisoned.send(
                sender="t.part",
                queue="celery",
                task_id=task_id,
                identity={},
                args=[],
                kwargs={},
                attempts=5,
                dead_letter_id=dead_id,
            )
            assert not [r for _, r in responses if isinstance(r, BaseException)]
    finally:
        previous.set_current()
    ((s, reason),) = peek("SELECT status, reason FROM {schema}.barrier")
    assert s == "failed" and reason == (
        f"part 1 failed: dead-lettered after 5 deliveries (dead letter {dead_id})"
    )
    assert len([m for m in messages(peek) if m["task"] == "t.err"]) == 1
    assert peek("SELECT task_id FROM {schema}.barrier_part") == [(task_id,)]


def test_worker_ready_starts_a_sweeper_and_shutdown_stops_it(
    app: Celery, db: Backend, peek: Peek
) -> None:
    app.conf.pgq_barrier_sweep_interval = 0.05
    Barrier(app).dispatch("b1", sigs(app, 1), app.signature("t.collect"))
    peek("UPDATE {schema}.barrier SET expires_at = now() - interval '1 s'")
    hooks.on_worker_ready(sender=SimpleNamespace(app=app))
    hooks.on_worker_ready(sender=SimpleNamespace(app=app))  # one sweeper per app
    sweepers = list(hooks._sweepers.values())
    assert len(sweepers) == 1
    wait_for(lambda: status(peek, "b1")[0] == "expired", 10, "the sweeper to expire b1")
    hooks.on_worker_shutdown()
    sweepers[0].join(10)
    assert not sweepers[0].is_alive()


def test_a_sweeper_whose_rounds_are_rarer_than_its_pool_keeps_a_session_holds_none(
    app: Celery, db: Backend, peek: Peek
) -> None:
    """Between two rounds 30 s apart (the default), a worker's main process keeps no
    barrier session: each round opens one and closes it."""
    Barrier(app).dispatch("b1", sigs(app, 1), app.signature("t.collect"))
    peek("UPDATE {schema}.barrier SET expires_at = now() - interval '1 s'")
    db.connector.discard_idle()
    sweeper = Sweeper(app, db.connector.idle_timeout)
    assert sweeper.round() == ["b1"]
    assert status(peek, "b1")[0] == "expired"
    assert db.connector.idle_count == 0
    sessions = (
        "SELECT count(*) FROM pg_stat_activity WHERE split_part(application_name, ':', 1)"
        " = 'pgq-barrier' AND split_part(application_name, ':', 2) = %s"
    )
    # A closed session's backend leaves pg_stat_activity a moment after the close (and
    # an earlier test's, closed as it ended, may be leaving still): gone well within the
    # pool's idle timeout, which a session kept idle would have to outlive.
    bound = db.connector.idle_timeout / 3
    assert bound >= 5
    wait_for(
        lambda: peek(sessions, str(os.getpid())) == [(0,)],
        bound,
        "no pgq-barrier session of this process",
    )
    # Rounds closer together than that keep theirs in the pool.
    Sweeper(app, db.connector.idle_timeout / 2).round()
    assert db.connector.idle_count == 1


# -- the callback's dedup -----------------------------------------------------------
def deliver_callback(app: Celery, barrier_id: str, results: Any = ("r0",)) -> Any:
    """What a worker does with the callback message: run it with marker and header."""
    return (
        app.tasks["t.collect"]
        .apply(
            args=[list(results)],
            kwargs={TRANSPORT_MARKER: True},
            headers={HEADER_BARRIER: barrier_id},
        )
        .get(propagate=True)
    )


def fired(app: Celery, db: Backend, conn: psycopg.Connection[Any], bid: str) -> None:
    Barrier(app).dispatch(bid, sigs(app, 1), app.signature("t.collect"))
    assert done(db, conn, bid, 0) == st.FIRED


def effects(peek: Peek) -> int:
    return int(peek("SELECT count(*) FROM {schema}.barrier_effects")[0][0])


def test_callback_redelivered_after_completed_is_skipped(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek, calls: Calls
) -> None:
    fired(app, db, conn, "b1")
    assert deliver_callback(app, "b1") == 1
    assert status(peek, "b1") == ("completed", 0)
    assert deliver_callback(app, "b1") == {
        "status": "skipped_duplicate_callback",
        "barrier_id": "b1",
    }
    assert len(calls.callback) == 1 and effects(peek) == 1
    assert calls.callback[0][1] == {}  # the marker never reaches the body


def test_callback_redelivered_after_fired_runs_again(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek, calls: Calls
) -> None:
    fired(app, db, conn, "b1")
    calls.fail_after_effect = True  # the worker dies mid-callback
    with pytest.raises(RuntimeError):
        deliver_callback(app, "b1")
    assert status(peek, "b1") == ("fired", 0)
    assert effects(peek) == 0  # its transactional side effect died with it
    calls.fail_after_effect = False
    assert deliver_callback(app, "b1") == 1
    assert len(calls.callback) == 2 and effects(peek) == 1
    assert status(peek, "b1") == ("completed", 0)


@pytest.mark.parametrize("elsewhere", ["failed", "expired"])
def test_a_status_set_elsewhere_does_not_suppress_the_first_run(
    app: Celery,
    db: Backend,
    conn: psycopg.Connection[Any],
    peek: Peek,
    calls: Calls,
    elsewhere: str,
) -> None:
    fired(app, db, conn, "b1")
    peek("UPDATE {schema}.barrier SET status = %s", elsewhere)
    assert deliver_callback(app, "b1") == 1
    assert len(calls.callback) == 1
    assert status(peek, "b1") == (elsewhere, 0)


def test_a_direct_call_always_runs_and_touches_nothing(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek, calls: Calls
) -> None:
    fired(app, db, conn, "b1")
    deliver_callback(app, "b1")
    collect = app.tasks["t.collect"]
    assert collect(["direct"]) == 1
    assert collect.apply(args=[["again"]], headers={HEADER_BARRIER: "b1"}).get() == 1
    assert [c[0] for c in calls.callback] == [["r0"], ["direct"], ["again"]]


@pytest.mark.sessions(10)
def test_concurrent_deliveries_of_one_callback_run_the_body_once(
    app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek, calls: Calls
) -> None:
    fired(app, db, conn, "b1")
    calls.release.clear()
    results: list[Any] = []

    def deliver() -> None:
        results.append(deliver_callback(app, "b1"))

    first = threading.Thread(target=deliver)
    first.start()
    assert calls.entered.wait(10)  # the first delivery is inside the body
    second = threading.Thread(target=deliver)
    second.start()
    # The second delivery waits on the barrier's lock (its row's), not in the body.
    ours = f"pgq-barrier:{os.getpid()}"  # the application_name of our backend's sessions
    wait_for(
        lambda: peek(
            "SELECT 1 FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND application_name = %s",
            ours,
        ),
        10,
        "the second delivery to wait for the barrier's lock",
    )
    calls.release.set()
    first.join(10)
    second.join(10)
    assert sorted(results, key=str) == [
        1,
        {"status": "skipped_duplicate_callback", "barrier_id": "b1"},
    ]
    assert len(calls.callback) == 1 and effects(peek) == 1


@pytest.mark.sessions(11)
def test_a_connect_only_role_holding_the_callbacks_key_delays_no_callback(
    pg_url: str, app: Celery, db: Backend, conn: psycopg.Connection[Any], peek: Peek, calls: Calls
) -> None:
    with squatter(pg_url) as squat:
        # The key earlier pgq versions serialised a barrier's callback on.
        squat.hold(advisory_key("pgq:barrier-callback", db.schema, "b1"))
        squat.beside("a barrier's parts", lambda: fired(app, db, conn, "b1"))
        assert squat.beside("the callback", lambda: deliver_callback(app, "b1")) == 1
        assert squat.beside("its redelivery", lambda: deliver_callback(app, "b1")) == skipped("b1")
    assert status(peek, "b1") == ("completed", 0)
    assert len(calls.callback) == 1 and effects(peek) == 1


# -- sweeps ------------------------------------------------------------------------
@pytest.fixture
def stranded() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        with lock:
            seen.append({"sender": sender, **kwargs})

    barrier_stranded.connect(receiver, weak=False)
    yield seen
    barrier_stranded.disconnect(receiver)


def test_sweep_expires_past_ttl_and_stuck_barriers_once(
    app: Celery,
    db: Backend,
    conn: psycopg.Connection[Any],
    peek: Peek,
    stranded: list[dict[str, Any]],
) -> None:
    errback = app.signature("t.err")
    for bid in ("old", "stuck", "fine"):
        Barrier(app).dispatch(
            bid,
            sigs(app, 2),
            app.signature("t.collect"),
            errback=errback,
            ttl=3600,
            stuck_timeout=600,
            metadata={"who": bid},
        )
    peek("UPDATE {schema}.barrier SET expires_at = now() - interval '1 s' WHERE id = 'old'")
    peek("UPDATE {schema}.barrier SET progressed_at = now() - interval '601 s' WHERE id = 'stuck'")
    assert sorted(sweep(app)) == ["old", "stuck"]
    assert sweep(app) == []
    assert status(peek, "old") == ("expired", 2) and status(peek, "fine") == ("armed", 2)
    assert dict(peek("SELECT id, reason FROM {schema}.barrier WHERE status = 'expired'")) == {
        "old": "ttl",
        "stuck": "stuck",
    }
    infos = {
        m["args"][0]["barrier_id"]: m["args"][0] for m in messages(peek) if m["task"] == "t.err"
    }
    assert set(infos) == {"old", "stuck"}
    assert infos["stuck"]["status"] == "expired" and infos["stuck"]["metadata"] == {"who": "stuck"}
    assert sorted((s["barrier_id"], s["reason"], s["sender"]) for s in stranded) == [
        ("old", "ttl", "t.collect"),
        ("stuck", "stuck", "t.collect"),
    ]
    assert done(db, conn, "old", 0) == st.IGNORED  # late parts change nothing


@pytest.mark.sessions(12)
def test_every_worker_sweeping_at_once_expires_each_barrier_once(
    app: Celery, db: Backend, peek: Peek, stranded: list[dict[str, Any]]
) -> None:
    for n in range(30):
        Barrier(app).dispatch(
            f"b{n}", sigs(app, 1), app.signature("t.collect"), errback=app.signature("t.err")
        )
    peek("UPDATE {schema}.barrier SET expires_at = now() - interval '1 s'")
    start = threading.Barrier(4)
    found: list[str] = []
    errors: list[BaseException] = []
    per: list[int] = []

    def sweeper() -> None:
        start.wait(10)
        try:
            got = sweep(app, batch=7)
            found.extend(got)
            per.append(len(got))
        except BaseException as exc:  # reported below, failing the test
            errors.append(exc)

    threads = [threading.Thread(target=sweeper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(found) == sorted(f"b{n}" for n in range(30)), (
        per,
        peek(
            "SELECT id, status, expires_at < now(), finished_at FROM {schema}.barrier"
            " WHERE status = 'armed'"
        ),
    )
    assert len(stranded) == 30
    assert len([m for m in messages(peek) if m["task"] == "t.err"]) == 30


# -- inspection -----------------------------------------------------------------------
@pytest.mark.sessions(10)
def test_show_and_counts(app: Celery, db: Backend, conn: psycopg.Connection[Any]) -> None:
    b = Barrier(app)
    assert b.show("nope") is None
    b.dispatch("b1", sigs(app, 3), app.signature("t.collect"), metadata={"k": "v"})
    b.dispatch("b2", [], app.signature("t.collect"))
    done(db, conn, "b1", 1)
    shown = b.show("b1")
    assert shown is not None
    assert {
        k: shown[k]
        for k in (
            "id",
            "status",
            "total",
            "remaining",
            "parts_done",
            "parts_failed",
            "metadata",
            "fired_at",
        )
    } == {
        "id": "b1",
        "status": "armed",
        "total": 3,
        "remaining": 2,
        "parts_done": 1,
        "parts_failed": 0,
        "metadata": {"k": "v"},
        "fired_at": None,
    }
    assert [(p["index"], p["task_id"], p["outcome"]) for p in shown["parts"]] == [
        (1, "task-1", "succeeded")
    ]
    assert all(isinstance(shown[k], str) for k in ("created_at", "expires_at", "progressed_at"))
    json.dumps(shown)  # JSON-ready for `pgq barrier show --json`
    assert b.counts() == {"armed": 1, "fired": 1, "completed": 0, "failed": 0, "expired": 0}


def test_cli_barrier_show(app: Celery, broker_url: str, schema: str) -> None:
    from tests.integration.test_cli import invoke

    d = Barrier(app).dispatch("cli-b", sigs(app, 2), app.signature("t.collect"))
    shown = invoke("barrier", "show", "cli-b", "--json", "--url", broker_url, "--schema", schema)
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert (report["id"], report["status"], report["total"], report["remaining"]) == (
        "cli-b",
        "armed",
        2,
        2,
    )
    assert report["callback"] == {"task": "t.collect", "id": d.callback_id}
    table = invoke("barrier", "show", "cli-b", "--url", broker_url, "--schema", schema)
    assert table.exit_code == 0 and "status:         armed" in table.stdout
    missing = invoke("barrier", "show", "nope", "--url", broker_url, "--schema", schema)
    assert missing.exit_code == 1
    assert missing.stderr.strip() == f"Error: no barrier 'nope' in pgq schema {schema!r}"
