"""Native chords through real workers: the body runs once, with the header's results in
order, after 1, 10 or 1,000 parts, after a worker is SIGKILLed inside the last part, and
a failing part fails over to the errbacks once. No chord_unlock task exists."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from celery import Celery, chord, group, states
from celery.exceptions import ChordError

from pg_transport.fanin.backend import forget
from pg_transport.message.unique import UniqueError
from tests.acceptance.harness import (
    QUICK_STOP,
    Env,
    Fleet,
    fleet,
    start_worker,
    wait_for,
    workers,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning"),
]


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


APP = "tests.acceptance.results_app"
T = "tests.acceptance.results_app."


@pytest.fixture(scope="module")
def chord_fleet(module_env: Env) -> Iterator[Fleet]:
    """One worker for the tests that only need one running (no kill, no restart)."""
    module_env.extra.update(QUICK_STOP)
    with fleet(module_env, "chords", app=APP, concurrency=4) as started:
        yield started


@pytest.fixture
def shared(chord_fleet: Fleet) -> Iterator[Env]:
    with chord_fleet.serve() as env:
        yield env


#: The client apps the running test made (closed after it: :func:`close_clients`).
_clients: list[Celery] = []


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    """A test's client apps close after it, with the sessions of their barrier backends:
    an app's backend keeps its idle sessions as long as the app, and they piled up here,
    test after test (7 idle sessions of this process by the last test)."""
    yield
    while _clients:
        app = _clients.pop()
        forget(app)
        app.close()


def client(env: Env) -> Celery:
    app = Celery("client", broker=env.broker_url, backend=env.broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": env.schema}
    _clients.append(app)
    return app


def labels(env: Env, prefix: str) -> list[str]:
    return [r[1] for r in env.runs() if r[1].startswith(prefix)]


def no_chord_unlock(env: Env) -> None:
    sent = env.scalar(
        "SELECT count(*) FROM {schema}.message"
        " WHERE payload -> 'headers' ->> 'task' = 'celery.chord_unlock'"
    )
    assert sent == 0


@pytest.mark.parametrize("parts", [1, 10, 1000])
@pytest.mark.sessions(18)  # the most of two runs, -n 0
def test_a_chord_fires_once_with_its_results_in_order(shared: Env, parts: int) -> None:
    env = shared
    app = client(env)
    header = [app.signature(T + "part", args=[i]) for i in range(parts)]
    body = app.signature(T + "collect", kwargs={"label": f"n{parts}"})
    result = chord(header, app=app)(body)
    no_chord_unlock(env)
    assert result.get(timeout=120) == sum(range(parts))
    wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 30, "acks")
    time.sleep(0.5)  # a second body would start within this
    assert labels(env, "callback:") == [f"callback:n{parts}"]
    assert result.parent is not None
    assert result.parent.get(timeout=10) == list(range(parts))


@pytest.mark.sessions(13)  # the most of two runs, -n 0
def test_a_worker_killed_inside_the_last_part_still_fires_once(env: Env) -> None:
    app = client(env)
    environ = {"PGQ_VISIBILITY_TIMEOUT": "2"}
    first = start_worker(env, "kill-1", app=APP, concurrency=4, environ=environ)
    header = [app.signature(T + "part", args=[i]) for i in range(3)]
    header.append(app.signature(T + "part", args=[3, 3.0]))  # the last to finish
    result = chord(header, app=app)(app.signature(T + "collect", kwargs={"label": "kill"}))
    try:
        wait_for(lambda: len(labels(env, "part:")) == 4, 30, "every part to start")
        wait_for(
            lambda: (
                env.scalar("SELECT remaining FROM {schema}.barrier WHERE id LIKE 'celery-chord:%%'")
                == 1
            ),
            30,
            "three parts counted",
        )
    finally:
        first.kill(signal.SIGKILL)  # inside part 3's sleep
    assert first.proc.wait(10) == -signal.SIGKILL
    assert labels(env, "callback:") == []
    with workers(env, "kill-2", app=APP, concurrency=4, environ=environ):
        assert result.get(timeout=60) == 0 + 1 + 2 + 3
        time.sleep(0.5)
    assert labels(env, "callback:") == ["callback:kill"]
    assert labels(env, "part:3") == ["part:3", "part:3"]  # it ran again after the kill


@pytest.mark.parametrize("allow_header_errbacks", [False, True])
@pytest.mark.sessions(15)  # the most of two runs, -n 0
def test_a_failing_part_fails_over_to_the_errbacks_once(
    shared: Env, allow_header_errbacks: bool
) -> None:
    env = shared
    app = client(env)
    app.conf.task_allow_error_cb_on_chord_header = allow_header_errbacks
    header = [app.signature(T + "part", args=[i]) for i in range(4)]
    header += [app.signature(T + "failing_part", args=[4])]
    header += [app.signature(T + "failing_part", args=[5])]
    errback = app.signature(T + "on_error", kwargs={"label": "chord"})
    body = app.signature(T + "collect", kwargs={"label": "never"})
    canvas = chord(header, body, app=app)
    canvas.link_error(errback)
    result = canvas.apply_async()
    # get() raises the header's error first (it follows the parents, as with Redis)...
    with pytest.raises(ValueError, match=r"part [45] fails"):
        result.get(timeout=60)
    # ...and the body itself fails with a ChordError naming the part.
    with pytest.raises(ChordError, match=r"Dependency .* raised ValueError"):
        result.get(timeout=60, follow_parents=False)
    assert result.state == states.FAILURE
    # Once for the chord; with header errbacks allowed, Celery links the errback to
    # each header task too, and each failing part runs it.
    expected = 3 if allow_header_errbacks else 1
    wait_for(lambda: len(labels(env, "errback:")) >= expected, 30, "the errbacks")
    wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 30, "acks")
    time.sleep(0.5)
    assert labels(env, "callback:") == []
    assert len(labels(env, "errback:")) == expected


def test_a_chord_whose_second_part_is_refused_fails_over_to_the_errback_once(
    shared: Env,
) -> None:
    """Celery arms the chord before it sends its header: the second part, refused as it
    is sent (a unique key on a chord's part), raises to the caller and fails the chord
    there. The first part, sent already, runs on the worker and fires nothing; the
    body's errback runs once; no part after the refused one is sent; no chord waits."""
    env = shared
    app = client(env)
    header = [
        app.signature(T + "part", args=[0]),
        app.signature(T + "part", args=[1], options={"unique_key": "refused"}),
        app.signature(T + "part", args=[2]),
    ]
    canvas = chord(header, app.signature(T + "collect", kwargs={"label": "refused"}), app=app)
    canvas.link_error(app.signature(T + "on_error", kwargs={"label": "refused"}))
    result = canvas.freeze()
    with pytest.raises(UniqueError, match=r"unique_key='refused'.*part of chord"):
        canvas.apply_async()
    with pytest.raises(ChordError, match=r"Dependency .* was refused"):
        result.get(timeout=60, follow_parents=False)
    assert result.state == states.FAILURE
    wait_for(lambda: labels(env, "errback:") and labels(env, "part:"), 30, "part 0, errback")
    wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 30, "acks")
    # Part 0 ended on the worker: recorded against the failed chord, nothing fired.
    chord_id = "celery-chord:" + result.parent.id
    wait_for(
        lambda: (
            env.scalar("SELECT count(*) FROM {schema}.barrier_part WHERE barrier_id = %s", chord_id)
            == 1
        ),
        30,
        "part 0 counted",
    )
    assert env.scalar("SELECT status FROM {schema}.barrier WHERE id = %s", chord_id) == "failed"
    assert labels(env, "part:") == ["part:0"]
    assert labels(env, "callback:") == []
    assert labels(env, "errback:") == ["errback:refused"]


@pytest.mark.sessions(17)  # the most of two runs, -n 0
def test_the_chord_shapes_celery_documents(shared: Env) -> None:
    """Immutable bodies and errbacks, a frozen chord applied again, a generator header,
    the body's parent and the errbacks as its children, add_to_chord: one fleet."""
    env = shared
    app = client(env)
    sig = app.signature
    # chord(header)(body.si(...)): the body gets its own arguments only.
    header = [sig(T + "part", args=[i]) for i in range(3)]
    immutable = chord(header, app=app)(sig(T + "add", args=(2, 3), immutable=True))
    assert immutable.get(timeout=60) == 5
    # The body was sent by the part that completed the chord.
    header_ids = [r.id for r in immutable.parent.results]
    meta = app.backend.get_task_meta(immutable.id)
    assert meta["parent_id"] in header_ids

    # link_error(errback.si(...)): the errback gets no body id; it is the body's child.
    failing = chord([sig(T + "failing_part", args=[0])], sig(T + "collect"), app=app)
    failing.link_error(sig(T + "note", args=("si-errback",), immutable=True))
    failed = failing.apply_async()
    with pytest.raises(ChordError):
        failed.get(timeout=60, follow_parents=False)
    wait_for(lambda: labels(env, "note:"), 30, "the immutable errback")
    [child] = app.AsyncResult(failed.id).children
    [errback] = child.results
    assert errback.get(timeout=30) == "si-errback"

    # A frozen chord applied again is a new run: its body runs again.
    again = chord(
        [sig(T + "part", args=[i]) for i in range(2)],
        sig(T + "collect", kwargs={"label": "again"}),
        app=app,
    )
    again.freeze()
    assert again.apply_async().get(timeout=60) == 1
    again.apply_async()
    wait_for(lambda: len(labels(env, "callback:again")) == 2, 60, "the second run")

    # A generator header is streamed, its results in header order.
    generated = chord(
        (sig(T + "part", args=[i]) for i in range(5)),
        sig(T + "collect", kwargs={"label": "gen"}),
        app=app,
    )()
    assert generated.get(timeout=60) == 10

    # add_to_chord: the body waits for the added task and gets its result last.
    added = chord(
        [sig(T + "adder", args=[0, 100]), sig(T + "part", args=[1])],
        sig(T + "collect", kwargs={"label": "added"}),
        app=app,
    )()
    assert added.get(timeout=60) == 101

    # A chain, a group or a chord as body, a chord in the header: sent by Celery's
    # canvas in the completing part's transaction, from that part.
    two = [sig(T + "part", args=[i]) for i in range(2)]
    chained = chord(two, sig(T + "collect") | sig(T + "echo"), app=app)()
    grouped = chord(two, group(sig(T + "collect"), sig(T + "collect")), app=app)()
    inner = chord(two, sig(T + "collect", kwargs={"label": "inner"}), app=app)
    nested = chord(
        [inner, sig(T + "part", args=[2])],
        sig(T + "collect", kwargs={"label": "outer"}),
        app=app,
    )()
    assert chained.get(timeout=60) == 1
    first = app.backend.get_task_meta(chained.id)["parent_id"]  # the chain's collect
    assert app.backend.get_task_meta(first)["parent_id"] in [r.id for r in chained.parent]
    assert grouped.get(timeout=60) == [1, 1]
    assert nested.get(timeout=60) == 1 + 2
    no_chord_unlock(env)
    wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 30, "acks")
    time.sleep(0.5)  # a second body would start within this
    assert len(labels(env, "callback:again")) == 2
    assert labels(env, "callback:outer") == ["callback:outer"]
    assert labels(env, "callback:gen") == ["callback:gen"]
    assert labels(env, "callback:added") == ["callback:added"]
    assert labels(env, "note:") == ["note:si-errback"]
