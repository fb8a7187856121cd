"""Native chords at the SQL level: parts counted by real concurrent connections fire the
body once, a redelivered part counts once, concurrent failures fail the chord once."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.exceptions import ChordError

import barrier.backend
from pg_transport.results.chords import CHORD_PREFIX
from tests.integration.test_results import make_app, q


@pytest.fixture
def app(pg_url: str, schema: str) -> Iterator[Celery]:
    made = make_app(pg_url, schema)

    @made.task(name="t.collect", shared=False)
    def collect(results: list[Any]) -> int:
        return sum(results)

    @made.task(name="t.on_error", shared=False)
    def on_error(task_id: str) -> None:
        return None

    yield made
    barrier.backend.forget(made)


def arm(app: Celery, group_id: str, n: int, errback: bool = False) -> tuple[list[str], Any]:
    ids = [f"{group_id}-part-{i}" for i in range(n)]
    body = app.signature("t.collect")
    body.freeze(group_id=group_id)
    if errback:
        body.link_error(app.signature("t.on_error"))
    app.backend.apply_chord((group_id, [app.AsyncResult(i) for i in ids]), body)
    return ids, body


def finish(app: Celery, group_id: str, body: Any, task_id: str, state: str, value: Any) -> None:
    """What a worker's mark_as_done / mark_as_failure does for a chord part."""
    request = Context({"id": task_id, "group": group_id, "chord": dict(body)})
    if state == states.SUCCESS:
        app.backend.mark_as_done(task_id, value, request=request)
    else:
        app.backend.mark_as_failure(task_id, value, request=request, call_errbacks=False)


def messages(pg_url: str, schema: str, task: str) -> list[Any]:
    rows = q(
        pg_url,
        schema,
        "SELECT payload FROM {schema}.message WHERE payload -> 'headers' ->> 'task' = %s",
        task,
    )
    return [row[0] for row in rows]


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
