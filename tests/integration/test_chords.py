"""Native chords at the SQL level: parts counted by real concurrent connections fire the
body once, a redelivered part counts once, concurrent failures fail the chord once."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, chord, group, states
from celery.app.task import Context
from celery.exceptions import ChordError
from celery.result import result_from_tuple
from celery.utils.functional import regen
from psycopg.types.json import Jsonb

import pg_transport
import pg_transport.fanin.backend
from pg_transport.message.unique import UniqueError
from pg_transport.results.chords import CHORD_PREFIX
from tests.integration.test_results import make_app, q


@pytest.fixture
def app(pg_url: str, schema: str) -> Iterator[Celery]:
    made = make_app(pg_url, schema)

    @made.task(name="t.collect", shared=False)
    def collect(results: list[Any]) -> int:
        return sum(results)

    @made.task(name="t.echo", shared=False)
    def echo(value: Any) -> Any:
        return value

    @made.task(name="t.on_error", shared=False)
    def on_error(task_id: str) -> None:
        return None

    @made.task(name="t.on_error_here", shared=False)
    def on_error_here(request: Any, exc: BaseException, traceback: Any) -> None:
        # Called in process (it takes request, exc, traceback): what it sends is sent
        # from the process that failed the chord.
        made.send_task("t.echo", args=["sent by the errback"])

    yield made
    pg_transport.fanin.backend.forget(made)


def arm(
    app: Celery, group_id: str, n: int, errback: Any = False, body: Any = None
) -> tuple[list[str], Any]:
    ids = [f"{group_id}-part-{i}" for i in range(n)]
    body = body if body is not None else app.signature("t.collect")
    body.freeze(group_id=group_id)
    if errback:
        body.link_error(app.signature("t.on_error") if errback is True else errback)
    app.backend.apply_chord((group_id, [app.AsyncResult(i) for i in ids]), body)
    return ids, body


def finish(
    app: Celery,
    group_id: str,
    body: Any,
    task_id: str,
    state: str,
    value: Any,
    **request: Any,
) -> None:
    """What a worker's mark_as_done / mark_as_failure does for a chord part."""
    request = Context({"id": task_id, "group": group_id, "chord": dict(body), **request})
    if state == states.SUCCESS:
        app.backend.mark_as_done(task_id, value, request=request)
    else:
        app.backend.mark_as_failure(task_id, value, request=request, call_errbacks=False)


def messages(pg_url: str, schema: str, task: str) -> list[Any]:
    rows = q(
        pg_url,
        schema,
        "SELECT payload FROM {schema}.message WHERE payload -> 'headers' ->> 'task' = %s"
        " ORDER BY id",
        task,
    )
    return [row[0] for row in rows]


@pytest.mark.sessions(11)  # 9 seen
def test_concurrent_parts_fire_the_body_once_with_results_in_order(
    app: Celery, pg_url: str, schema: str
) -> None:
    n = 8
    ids, body = arm(app, "g-race", n)
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def part(i: int) -> None:
        try:
            start.wait(10)
            finish(app, "g-race", body, ids[i], states.SUCCESS, i * 10)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=part, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    sent = messages(pg_url, schema, "t.collect")
    assert len(sent) == 1
    args = json.loads(sent[0]["body"])[0]
    assert args == [[i * 10 for i in range(n)]]
    assert q(pg_url, schema, "SELECT status FROM {schema}.barrier") == [("fired",)]
    # Every part's result was stored with its count.
    assert q(pg_url, schema, "SELECT count(*) FROM {schema}.result") == [(n,)]


def test_a_redelivered_part_counts_once(app: Celery, pg_url: str, schema: str) -> None:
    ids, body = arm(app, "g-dup", 2)
    finish(app, "g-dup", body, ids[0], states.SUCCESS, 1)
    finish(app, "g-dup", body, ids[0], states.SUCCESS, 1)  # delivered again
    assert q(pg_url, schema, "SELECT remaining FROM {schema}.barrier") == [(1,)]
    finish(app, "g-dup", body, ids[1], states.SUCCESS, 2)
    finish(app, "g-dup", body, ids[1], states.SUCCESS, 2)  # killed after commit, again
    assert len(messages(pg_url, schema, "t.collect")) == 1


@pytest.mark.sessions(9)  # side by side, the run's meter
def test_concurrent_failures_fail_the_chord_once(app: Celery, pg_url: str, schema: str) -> None:
    n = 4
    ids, body = arm(app, "g-fail", n, errback=True)
    start = threading.Barrier(n)

    def part(i: int) -> None:
        start.wait(10)
        finish(app, "g-fail", body, ids[i], states.FAILURE, ValueError(f"part {i}"))

    threads = [threading.Thread(target=part, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert messages(pg_url, schema, "t.collect") == []
    errbacks = messages(pg_url, schema, "t.on_error")
    assert len(errbacks) == 1
    assert json.loads(errbacks[0]["body"])[0] == [body.id]
    meta = app.backend.get_task_meta(body.id, cache=False)
    assert meta["status"] == states.FAILURE and isinstance(meta["result"], ChordError)
    assert q(pg_url, schema, "SELECT status FROM {schema}.barrier") == [("failed",)]
    assert q(pg_url, schema, "SELECT count(*) FROM {schema}.barrier_part") == [(n,)]


def test_an_unknown_chord_only_stores_the_result(app: Celery, pg_url: str, schema: str) -> None:
    finish(app, "g-none", app.signature("t.collect"), "lonely", states.SUCCESS, 5)
    assert app.backend.get_task_meta("lonely")["result"] == 5
    assert q(pg_url, schema, "SELECT count(*) FROM {schema}.barrier_part") == [(0,)]


def test_the_chord_is_a_barrier_named_after_its_group(
    app: Celery, pg_url: str, schema: str
) -> None:
    arm(app, "g-name", 3)
    rows = q(pg_url, schema, "SELECT id, total, status FROM {schema}.barrier")
    assert rows == [(CHORD_PREFIX + "g-name", 3, "armed")]


def test_a_part_that_stored_no_result_fails_the_chord_once(
    app: Celery, pg_url: str, schema: str
) -> None:
    ids, body = arm(app, "g-ignored", 2, errback=True)
    finish(app, "g-ignored", body, ids[0], states.SUCCESS, 1)
    # ignore_result: the worker stores nothing, the part still returns.
    request = Context({"id": ids[1], "group": "g-ignored", "chord": dict(body)})
    app.backend.mark_as_done(ids[1], 2, request=request, store_result=False)
    assert messages(pg_url, schema, "t.collect") == []
    assert len(messages(pg_url, schema, "t.on_error")) == 1
    meta = app.backend.get_task_meta(body.id, cache=False)
    assert isinstance(meta["result"], ChordError)
    assert f"part {ids[1]} succeeded but its result is not stored" in str(meta["result"])
    assert q(pg_url, schema, "SELECT status FROM {schema}.barrier") == [("failed",)]


def test_an_immutable_body_and_errback_get_no_results_or_body_id(
    app: Celery, pg_url: str, schema: str
) -> None:
    # chord(header)(body.si(...)) and link_error(cb.si()): as Celery, nothing is prepended.
    body = app.signature("t.collect", args=([1, 2],), immutable=True)
    ids, body = arm(app, "g-si", 2, body=body)
    finish(app, "g-si", body, ids[0], states.SUCCESS, 10)
    finish(app, "g-si", body, ids[1], states.SUCCESS, 20)
    [sent] = messages(pg_url, schema, "t.collect")
    assert json.loads(sent["body"])[0] == [[1, 2]]

    errback = app.signature("t.on_error", args=("mine",), immutable=True)
    ids, body = arm(app, "g-si-err", 2, errback=errback)
    finish(app, "g-si-err", body, ids[0], states.FAILURE, ValueError("no"))
    [sent] = messages(pg_url, schema, "t.on_error")
    assert json.loads(sent["body"])[0] == ["mine"]


def test_the_body_is_sent_from_the_part_that_completed_the_chord(
    app: Celery, pg_url: str, schema: str
) -> None:
    ids, body = arm(app, "g-parent", 2)
    finish(app, "g-parent", body, ids[1], states.SUCCESS, 1, root_id="the-root")
    finish(app, "g-parent", body, ids[0], states.SUCCESS, 2, root_id="the-root")
    [sent] = messages(pg_url, schema, "t.collect")
    assert sent["headers"]["id"] == body.id
    assert sent["headers"]["parent_id"] == ids[0]  # the last to return
    assert sent["headers"]["root_id"] == "the-root"


def test_a_failed_chord_records_its_errbacks_as_the_bodys_children(
    app: Celery, pg_url: str, schema: str
) -> None:
    ids, body = arm(app, "g-children", 2, errback=True)
    finish(app, "g-children", body, ids[0], states.FAILURE, ValueError("no"))
    [sent] = messages(pg_url, schema, "t.on_error")
    errback_id = sent["headers"]["id"]
    assert sent["headers"]["parent_id"] == body.id
    assert sent["headers"]["root_id"] == body.id
    result = app.AsyncResult(body.id)
    assert result.state == states.FAILURE
    [child] = result.children
    assert [r.id for r in child.results] == [errback_id]


def test_a_chord_applied_again_is_a_new_run(app: Celery, pg_url: str, schema: str) -> None:
    # A frozen chord applied twice: the same group id, header ids and body id.
    for run in (1, 2):
        ids, body = arm(app, "g-again", 2)
        assert q(pg_url, schema, "SELECT status, remaining FROM {schema}.barrier") == [("armed", 2)]
        finish(app, "g-again", body, ids[0], states.SUCCESS, run)
        finish(app, "g-again", body, ids[1], states.SUCCESS, run)
        assert len(messages(pg_url, schema, "t.collect")) == run
    # A late copy of a part of the finished run fires nothing more.
    finish(app, "g-again", body, ids[1], states.SUCCESS, 2)
    assert len(messages(pg_url, schema, "t.collect")) == 2


def test_a_generator_header_is_streamed(app: Celery, pg_url: str, schema: str) -> None:
    n = 5
    queued_when_read: list[int] = []
    pg_transport.fanin.backend.backend_for(app)  # the schema, before the header is read

    def header() -> Iterator[Any]:
        for i in range(n):
            queued_when_read.append(len(messages(pg_url, schema, "t.part")))
            yield app.signature("t.part", args=(i,))

    result = chord(header(), app=app)(app.signature("t.collect"))
    # Header tasks were sent as the generator went (Celery reads a little ahead): the
    # last ones were read after the first were queued, not all before any was.
    assert queued_when_read[0] == 0 and queued_when_read[-1] > 0
    sent = messages(pg_url, schema, "t.part")
    assert len(sent) == n
    # The parts return out of order, before and after the size is known.
    for i in (3, 0, 4, 1, 2):
        headers = sent[i]["headers"]
        assert headers["group_index"] == i
        body = json.loads(sent[i]["body"])[2]["chord"]
        assert body["options"]["task_id"] == result.id
        finish(app, headers["group"], body, headers["id"], states.SUCCESS, i * 10, group_index=i)
        assert len(messages(pg_url, schema, "t.collect")) == (1 if i == 2 else 0)
    [body] = messages(pg_url, schema, "t.collect")
    assert json.loads(body["body"])[0] == [[0, 10, 20, 30, 40]]


def test_add_to_chord_waits_for_the_added_task_too(app: Celery, pg_url: str, schema: str) -> None:
    ids, body = arm(app, "g-add", 2)
    finish(app, "g-add", body, ids[0], states.SUCCESS, 1)
    app.backend.add_to_chord("g-add", app.AsyncResult("added"))
    with pytest.raises(ChordError, match="was added to it already"):
        app.backend.add_to_chord("g-add", app.AsyncResult("added"))
    finish(app, "g-add", body, ids[1], states.SUCCESS, 2)
    assert messages(pg_url, schema, "t.collect") == []
    finish(app, "g-add", body, "added", states.SUCCESS, 3, group_index=0)
    [sent] = messages(pg_url, schema, "t.collect")
    assert json.loads(sent["body"])[0] == [[1, 2, 3]]
    with pytest.raises(ChordError, match="fired already"):
        app.backend.add_to_chord("g-add", app.AsyncResult("late"))


def test_a_generator_header_may_hold_a_group(app: Celery, pg_url: str, schema: str) -> None:
    pg_transport.fanin.backend.backend_for(app)

    def header() -> Iterator[Any]:
        # The group's tasks are numbered from 0 again: two parts share group index 1.
        yield group(app.signature("t.part", args=(0,)), app.signature("t.part", args=(1,)))
        yield app.signature("t.part", args=(2,))

    chord(header(), app=app)(app.signature("t.collect"))
    sent = messages(pg_url, schema, "t.part")
    assert [m["headers"]["group_index"] for m in sent] == [0, 1, 1]
    for value, m in enumerate(sent):
        body = json.loads(m["body"])[2]["chord"]
        headers = m["headers"]
        request = {"group_index": headers["group_index"]}
        finish(app, headers["group"], body, headers["id"], states.SUCCESS, value, **request)
        finish(app, headers["group"], body, headers["id"], states.SUCCESS, value, **request)
    [sent_body] = messages(pg_url, schema, "t.collect")
    assert json.loads(sent_body["body"])[0] == [[0, 1, 2]]


@pytest.mark.sessions(13)
def test_concurrent_streamed_parts_and_their_copies_fire_once_in_header_order(
    app: Celery, pg_url: str, schema: str
) -> None:
    n = 6
    body = app.signature("t.collect")
    body.freeze(group_id="g-stream")
    app.backend.apply_chord(("g-stream", regen(iter(()))), body)
    app.backend.set_chord_size("g-stream", n)
    start = threading.Barrier(2 * n)
    errors: list[BaseException] = []

    def part(i: int) -> None:
        try:
            start.wait(10)
            finish(app, "g-stream", body, f"s-{i}", states.SUCCESS, i, group_index=i)
        except BaseException as exc:
            errors.append(exc)

    # Every part twice at once: a redelivery racing the first delivery.
    threads = [threading.Thread(target=part, args=(i % n,)) for i in range(2 * n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    [sent] = messages(pg_url, schema, "t.collect")
    assert json.loads(sent["body"])[0] == [list(range(n))]
    assert q(pg_url, schema, "SELECT count(*) FROM {schema}.barrier_part") == [(n,)]


def test_a_chain_body_is_sent_from_the_completing_part_without_chord_unlock(
    app: Celery, pg_url: str, schema: str
) -> None:
    ids, body = arm(app, "g-chain", 2, body=app.signature("t.collect") | app.signature("t.echo"))
    finish(app, "g-chain", body, ids[0], states.SUCCESS, 1)
    assert messages(pg_url, schema, "t.collect") == []
    finish(app, "g-chain", body, ids[1], states.SUCCESS, 2)
    [first] = messages(pg_url, schema, "t.collect")
    assert json.loads(first["body"])[0] == [[1, 2]]
    # (Its parent is the worker's current task, the part: tests/acceptance/test_chords.py.)
    assert json.loads(first["body"])[2]["chain"][0]["task"] == "t.echo"  # the rest follows
    assert messages(pg_url, schema, "celery.chord_unlock") == []


def test_a_failed_chord_fails_its_group_body_as_celery_does(
    app: Celery, pg_url: str, schema: str
) -> None:
    body = group(app.signature("t.collect"), app.signature("t.collect"))
    ids, body = arm(app, "g-group", 2, body=body)
    finish(app, "g-group", body, ids[0], states.FAILURE, ValueError("no"))
    assert messages(pg_url, schema, "t.collect") == []
    for result in body.freeze().results:
        meta = app.backend.get_task_meta(result.id, cache=False)
        assert meta["status"] == states.FAILURE
        # As Celery fails a group body: with the part's own error, the ChordError's cause.
        assert isinstance(meta["result"], ValueError) and str(meta["result"]) == "no"
    assert messages(pg_url, schema, "celery.chord_unlock") == []


# -- a header part refused as it is sent (issue 47) -----------------------------------


def refusing_chord(app: Celery, refused: int, n: int = 3, *errbacks: str) -> Any:
    """A chord of ``n`` echo parts, part ``refused`` with a unique key (refused as it is
    sent), errbacks on its body (``t.on_error`` unless named), frozen."""
    header = [
        app.signature("t.echo", args=[i], options={"unique_key": "k"} if i == refused else {})
        for i in range(n)
    ]
    canvas = chord(header, app.signature("t.collect"), app=app)
    for name in errbacks or ("t.on_error",):
        canvas.link_error(app.signature(name))
    canvas.freeze()
    return canvas


def refused_chord(app: Celery, refused: int, n: int = 3, *errbacks: str) -> tuple[Any, Any]:
    """:func:`refusing_chord` applied, its UniqueError raised. Returns the frozen chord's
    result (the body's) and its group id."""
    canvas = refusing_chord(app, refused, n, *errbacks)
    result = canvas.freeze()
    with pytest.raises(UniqueError, match=r"unique_key='k'.*part of chord"):
        canvas.apply_async()
    return result, result.parent.id


@pytest.mark.parametrize("refused", [0, 1])
@pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")
def test_a_chord_whose_header_part_is_refused_fails_once(
    app: Celery, pg_url: str, schema: str, refused: int
) -> None:
    """Celery arms the chord before it sends the header: a part refused as it is sent
    (a unique key on it) fails the chord as a failed part does (its body's ChordError,
    its errback sent once), whether or not parts were sent before it; none after it is."""
    result, group_id = refused_chord(app, refused)
    rows = q(pg_url, schema, "SELECT id, status, reason FROM {schema}.barrier")
    assert [(r[0], r[1]) for r in rows] == [(CHORD_PREFIX + group_id, "failed")]
    assert "refused" in rows[0][2]
    sent = messages(pg_url, schema, "t.echo")
    assert [json.loads(m["body"])[0] for m in sent] == [[i] for i in range(refused)]
    errbacks = messages(pg_url, schema, "t.on_error")
    assert len(errbacks) == 1
    assert json.loads(errbacks[0]["body"])[0] == [result.id]
    meta = app.backend.get_task_meta(result.id, cache=False)
    assert meta["status"] == states.FAILURE
    assert isinstance(meta["result"], ChordError)
    assert "refused" in str(meta["result"])
    # The parts sent before the refused one end: they count against a failed chord,
    # fire nothing, fail nothing again.
    body = app.signature("t.collect")
    for m in sent:
        finish(app, group_id, body, m["headers"]["id"], states.SUCCESS, 1)
    assert messages(pg_url, schema, "t.collect") == []
    assert len(messages(pg_url, schema, "t.on_error")) == 1
    assert q(pg_url, schema, "SELECT status FROM {schema}.barrier") == [("failed",)]


def test_a_refused_part_outside_a_chord_fails_no_chord(
    app: Celery, pg_url: str, schema: str
) -> None:
    """Only a chord's header part fails its chord: a refused plain publish (here a
    unique key pgq cannot store) leaves an armed chord of this thread alone."""
    arm(app, "g-alone", 2)
    with pytest.raises(UniqueError):
        app.send_task("t.echo", args=[1], unique_key="x" * 10_000)
    assert q(pg_url, schema, "SELECT status FROM {schema}.barrier") == [("armed",)]


def test_a_refused_part_and_a_failing_part_fail_the_chord_once(
    app: Celery, pg_url: str, schema: str
) -> None:
    """A part refused as it is sent while a part sent before it fails on a worker: two
    connections flip the chord at once, one wins; its errback is sent once."""
    ids, body = arm(app, "g-refused-race", 2, errback=True)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def refused() -> None:
        try:
            start.wait(10)
            app.backend.chords.refused("g-refused-race", ids[1], UniqueError("refused"))
        except BaseException as exc:
            errors.append(exc)

    def failing() -> None:
        try:
            start.wait(10)
            finish(app, "g-refused-race", body, ids[0], states.FAILURE, ValueError("no"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=refused), threading.Thread(target=failing)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(messages(pg_url, schema, "t.on_error")) == 1
    assert q(pg_url, schema, "SELECT status FROM {schema}.barrier") == [("failed",)]
    meta = app.backend.get_task_meta(body.id, cache=False)
    assert meta["status"] == states.FAILURE and isinstance(meta["result"], ChordError)


# -- ... inside a transaction or batch of the caller's --------------------------------

ERRBACKS = ("t.on_error", "t.on_error_here")


def ours_idle_in_transaction(pg_url: str) -> list[Any]:
    """pgq's sessions on the test database left in an open transaction (none may be: a
    chord's row held there would hold up every part of it)."""
    return q(
        pg_url,
        "",
        "SELECT application_name, query FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'pgq%%'"
        " AND state LIKE 'idle in transaction%%'",
    )


def failed_apart(app: Celery, pg_url: str, schema: str, result: Any, group_id: str) -> None:
    """The chord failed once, committed on pgq's own sessions: its row, the body's
    ChordError, one errback message, and what the in-process errback sent."""
    rows = q(pg_url, schema, "SELECT id, status FROM {schema}.barrier")
    assert rows == [(CHORD_PREFIX + group_id, "failed")]
    meta = app.backend.get_task_meta(result.id, cache=False)
    assert meta["status"] == states.FAILURE and isinstance(meta["result"], ChordError)
    assert len(messages(pg_url, schema, "t.on_error")) == 1
    from_errback = [
        m
        for m in messages(pg_url, schema, "t.echo")
        if json.loads(m["body"])[0] == ["sent by the errback"]
    ]
    assert len(from_errback) == 1


def header_parts(pg_url: str, schema: str) -> list[Any]:
    return sorted(
        json.loads(m["body"])[0][0]
        for m in messages(pg_url, schema, "t.echo")
        if json.loads(m["body"])[0] != ["sent by the errback"]
    )


@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")
def test_a_part_refused_in_the_applications_transaction_fails_its_chord_apart(
    app: Celery, pg_url: str, schema: str, end: str
) -> None:
    """Inside ``pg_transport.transaction(conn)`` the parts join the application's
    transaction, but the chord is armed on pgq's own session: the refusal fails it there,
    committed before the application ends its transaction (which holds no lock of the
    chord's: nothing waits), and what the in-process errback sends is not the
    application's to roll back. Part 0 commits or rolls back with the application."""
    with psycopg.connect(pg_url) as conn:
        with pg_transport.transaction(conn):
            result, group_id = refused_chord(app, 1, 3, *ERRBACKS)
        # The application's transaction is still open: the chord's end is not in it.
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        failed_apart(app, pg_url, schema, result, group_id)
        assert header_parts(pg_url, schema) == []  # part 0: not committed yet
        assert ours_idle_in_transaction(pg_url) == []
        conn.commit() if end == "commit" else conn.rollback()
    failed_apart(app, pg_url, schema, result, group_id)
    assert header_parts(pg_url, schema) == ([0] if end == "commit" else [])


@pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")
def test_a_part_refused_in_a_batch_fails_its_chord_apart(
    app: Celery, pg_url: str, schema: str
) -> None:
    """Inside ``pg_transport.batch()``: the chord fails at once, apart from the batch
    (which is still open, its part 0 unsent); the batch left by the refusal's error
    publishes nothing of its own, and takes nothing of the chord's failure with it."""
    canvas = refusing_chord(app, 1, 3, *ERRBACKS)
    result = canvas.freeze()
    group_id = result.parent.id
    with pytest.raises(UniqueError), pg_transport.batch():
        try:
            canvas.apply_async()
        finally:
            failed_apart(app, pg_url, schema, result, group_id)
            assert ours_idle_in_transaction(pg_url) == []
    failed_apart(app, pg_url, schema, result, group_id)
    assert header_parts(pg_url, schema) == []
    # Caught inside the block, the batch goes on and commits part 0.
    canvas = refusing_chord(app, 1, 3, *ERRBACKS)
    result = canvas.freeze()
    with pg_transport.batch(), pytest.raises(UniqueError):
        canvas.apply_async()
    assert header_parts(pg_url, schema) == [0]
    assert q(pg_url, schema, "SELECT count(*) FROM {schema}.barrier WHERE status = 'failed'") == [
        (2,)
    ]


def test_a_failed_chord_leaves_nobody_waiting_for_its_errbacks(
    app: Celery, pg_url: str, schema: str
) -> None:
    """Failing a chord stores its body's result with its errbacks as children, but builds
    no result objects for them: nothing in this process subscribes to their results (a
    LISTEN, a listener thread, taken under the chord's row lock and kept until an
    errback that may ignore its result stores one)."""
    ids, body = arm(app, "g-nobody", 2, errback=True)
    listener = app.backend.listener
    assert listener.waiting() == 0
    app.backend.chords.refused("g-nobody", ids[1], UniqueError("refused"))
    assert listener.waiting() == 0
    (errback,) = messages(pg_url, schema, "t.on_error")
    # As Celery records them: one group, the failed body's child.
    (children,) = app.backend.get_task_meta(body.id, cache=False)["children"]
    assert [r.id for r in result_from_tuple(children, app).results] == [errback["headers"]["id"]]


def test_a_chord_armed_again_while_its_failure_was_made_ready_fails_its_new_run(
    app: Celery, pg_url: str, schema: str
) -> None:
    """A failure is made ready from the chord's row read unlocked, before its flip. Here
    the chord is applied again (a new run, another body and errback) between that read
    and the flip, which waits meanwhile on a session holding the row: the flip fails the
    new run, with the new run's errback, not the one read before."""
    ids, _ = arm(app, "g-again", 2, errback=True)  # run 1: errback t.on_error
    chord_id = CHORD_PREFIX + "g-again"
    new_body = app.signature("t.collect")
    new_body.freeze(group_id="g-again")
    new_body.link_error(app.signature("t.echo", args=["run 2"]))
    holder = psycopg.connect(pg_url)
    locking = f"SELECT 1 FROM {schema}.barrier WHERE id = %s FOR UPDATE"
    holder.execute(locking.replace(f"{schema}.", f'"{schema}".'), [chord_id])
    errors: list[BaseException] = []

    def refused() -> None:
        try:
            app.backend.chords.refused("g-again", ids[1], UniqueError("refused"))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=refused)
    thread.start()
    try:
        # The flip waits on the holder's lock: its failure was made ready already.
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND wait_event_type = 'Lock'"
        )
        deadline = time.monotonic() + 30
        while q(pg_url, schema, waiting, f"pgq-barrier:{os.getpid()}") != [(1,)]:
            assert thread.is_alive() and time.monotonic() < deadline, errors
            time.sleep(0.01)
        # Applied again, in the holder's transaction: run 2, another body.
        holder.execute(
            app.backend.q["chord_arm"],
            {
                "id": chord_id,
                "total": 2,
                "callback": json.dumps(dict(new_body)),
                "metadata": Jsonb({"kind": "celery-chord", "ids": ids}),
                "ttl": 3600,
                "stuck_timeout": 3600,
            },
        )
        holder.commit()
    finally:
        holder.close()
        thread.join(30)
    assert errors == []
    assert q(pg_url, schema, "SELECT status, metadata ->> 'run' FROM {schema}.barrier") == [
        ("failed", "2")
    ]
    assert messages(pg_url, schema, "t.on_error") == []
    (errback,) = messages(pg_url, schema, "t.echo")
    assert json.loads(errback["body"])[0] == [new_body.id, "run 2"]
    meta = app.backend.get_task_meta(new_body.id, cache=False)
    assert meta["status"] == states.FAILURE and isinstance(meta["result"], ChordError)
