"""Ordered delivery per key and follows, on real workers (docs/ordering.md).

Each task records when it started and ended on the database's clock (one clock for every
worker process), so the checks read what actually ran when: per key one at a time in
publish order, different keys at once, a crashed worker's message back first in its key,
strict and relaxed failure modes, followers after what they follow.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pg_transport
from tests.acceptance.harness import (
    ROOT,
    Env,
    Fleet,
    Worker,
    fleet,
    start_worker,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.acceptance

APP = "tests.acceptance.ordering_app"
STEP = f"{APP}.step"
KEY = "pgq-ordering-key"


@dataclass(frozen=True)
class Run:
    seq: int
    task: str
    task_id: str
    okey: str | None
    n: int | None
    attempt: int
    pid: int
    queue: str | None
    header_key: str | None
    missing: str | None
    started: datetime
    ended: datetime | None


@pytest.fixture
def oenv(env: Env) -> Env:
    from tests.acceptance.ordering_app import TABLES

    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(TABLES).format(schema=sql.Identifier(env.schema)))
    return env


@pytest.fixture(scope="module")
def ordering_fleet(module_env: Env) -> Iterator[Fleet]:
    """Two workers of the ordering app on every queue the tests use, for the tests that
    need workers running and nothing of their lives (no kill, stop, or pid checked)."""
    from tests.acceptance.ordering_app import TABLES

    with psycopg.connect(module_env.pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(TABLES).format(schema=sql.Identifier(module_env.schema)))
    tables = ("task_runs", "dead_letter", "ordering_runs", "ordering_signals")
    with fleet(
        module_env, "o1", "o2", app=APP, concurrency=2, queues="celery,relaxed,other", tables=tables
    ) as started:
        yield started


@pytest.fixture
def shared(ordering_fleet: Fleet) -> Iterator[Env]:
    with ordering_fleet.serve() as env:
        yield env


def runs(env: Env) -> list[Run]:
    with psycopg.connect(env.pg_url) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT seq, task, task_id, okey, n, attempt, pid, queue, header_key, missing,"
                " started, ended FROM {}.ordering_runs ORDER BY started, seq"
            ).format(sql.Identifier(env.schema))
        ).fetchall()
    return [Run(*row) for row in rows]


def ended(env: Env) -> int:
    return int(env.scalar("SELECT count(*) FROM {schema}.ordering_runs WHERE ended IS NOT NULL"))


def queue_empty(env: Env) -> bool:
    return env.scalar("SELECT count(*) FROM {schema}.message") == 0


def now(env: Env) -> datetime:
    return env.scalar("SELECT clock_timestamp()")  # type: ignore[no-any-return]


@contextmanager
def together(env: Env, *names: str, **kwargs: Any) -> Iterator[list[Worker]]:
    """Workers of the ordering app started at once (each takes seconds to be ready)."""
    kwargs.setdefault("app", APP)
    started = [start_worker(env, name, wait=False, **kwargs) for name in names]
    try:
        for worker in started:
            wait_for(lambda w=worker: ready(w), 60, f"worker {worker.name} to be ready")
        yield started
    finally:
        stop_all(started)  # side by side: each warm shutdown takes a moment of its own


def ready(worker: Worker) -> bool:
    if worker.proc.poll() is not None:
        raise AssertionError(f"worker {worker.name} exited:\n{worker.output()}")
    return " ready." in worker.output()


def by_key(rows: Sequence[Run]) -> dict[str, list[Run]]:
    keys: dict[str, list[Run]] = defaultdict(list)
    for run in sorted(rows, key=lambda r: (r.started, r.seq)):
        keys[str(run.okey)].append(run)
    return keys


def assert_one_at_a_time(key: str, rows: Sequence[Run]) -> None:
    """Each run of the key started after the one before it ended."""
    for before, after in itertools.pairwise(rows):
        assert before.ended is not None, f"{key}: {before} never ended, yet {after} ran"
        assert after.started > before.ended, f"{key}: {after} overlaps {before}"


def overlapping_pairs_of_different_keys(rows: Sequence[Run]) -> int:
    """How many pairs of runs of different keys were running at the same moment."""
    timed = sorted((r for r in rows if r.ended is not None), key=lambda r: r.started)
    pairs = 0
    for i, run in enumerate(timed):
        for other in timed[i + 1 :]:
            if other.started >= run.ended:  # type: ignore[operator]
                break
            pairs += other.okey != run.okey
    return pairs


# -- 1. many keys, many workers ----------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork", "threads"])
@pytest.mark.sessions(23)  # the most of two runs, -n 0
def test_three_workers_run_each_key_in_publish_order_one_at_a_time_and_keys_in_parallel(
    oenv: Env, pool: str
) -> None:
    keys, per_key = 100, 50
    total = keys * per_key
    rng = random.Random(7)
    client = oenv.client()
    with together(oenv, *(f"{pool}-{n}" for n in range(3)), pool=pool, concurrency=3):
        began = time.monotonic()
        # Interleaved across keys: k0:0, k1:0, ... k99:0, k0:1, ... one batch per round.
        with client.producer_or_acquire() as producer:
            for n in range(per_key):
                with pg_transport.batch():
                    for k in range(keys):
                        client.send_task(
                            STEP,
                            args=[f"k{k}", n, rng.uniform(0, 0.006)],
                            headers={KEY: f"k{k}"},
                            producer=producer,
                        )
        published = time.monotonic() - began
        wait_for(lambda: ended(oenv) >= total, 120, f"{total} runs")
        wait_for(lambda: queue_empty(oenv), 30, "every message acked")
        elapsed = time.monotonic() - began
    rows = runs(oenv)
    assert len(rows) == total, "each message ran once"
    for key, key_rows in by_key(rows).items():
        assert [r.n for r in key_rows] == list(range(per_key)), f"{key} out of publish order"
        assert all(r.header_key == key for r in key_rows)
        assert_one_at_a_time(key, key_rows)
    assert overlapping_pairs_of_different_keys(rows) > 0, "no two keys ever ran at once"
    assert len({r.pid for r in rows}) >= 3, "the work was not shared"
    print(f"{pool}: {total} ordered tasks in {elapsed:.1f}s (published in {published:.1f}s)")


# -- 2. a worker killed mid-key ----------------------------------------------------


@pytest.mark.sessions(15)  # the most of two runs, -n 0
def test_a_killed_worker_s_key_waits_out_the_lease_while_other_keys_flow(oenv: Env) -> None:
    vt = 3.0
    environ = {"PGQ_VISIBILITY_TIMEOUT": str(vt), "TEST_PREFETCH": "1"}
    client = oenv.client()
    # K:0 runs for a minute on its first delivery, on the worker the test kills;
    # K:1..K:3 wait behind it.
    client.send_task(f"{APP}.stall", args=["K", 0, 60.0], ordering_key="K")
    for n in (1, 2, 3):
        client.send_task(STEP, args=["K", n], ordering_key="K")
    doomed = start_worker(oenv, "doomed", concurrency=1, app=APP, environ=environ)
    try:
        wait_for(lambda: runs(oenv), 30, "K:0 to start on the doomed worker")
        # Holding K:0 (prefetch 1, one slot), it takes nothing else.
        with together(oenv, "s1", "s2", concurrency=2, environ=environ):
            for n in range(3):
                for k in range(8):
                    client.send_task(STEP, args=[f"a{k}", n], ordering_key=f"a{k}")
            wait_for(lambda: ended(oenv) >= 24, 30, "keys a0..a7 to run")
            doomed.kill()  # SIGKILL mid-task: K:0's lease lapses, nobody acks it
            doomed.proc.wait(10)
            killed_at = now(oenv)
            for n in range(3):
                for k in range(8):
                    client.send_task(STEP, args=[f"b{k}", n], ordering_key=f"b{k}")
            wait_for(lambda: ended(oenv) >= 24 + 24 + 4, 60, "every message to run")
            wait_for(lambda: queue_empty(oenv), 30, "every message acked")
    finally:
        doomed.kill()
    rows = runs(oenv)
    keys = by_key(rows)
    k = keys.pop("K")
    assert [(r.n, r.attempt) for r in k] == [(0, 0), (0, 0), (1, 0), (2, 0), (3, 0)]
    assert k[0].pid == doomed.proc.pid  # (a threads pool runs tasks in the worker)
    assert k[0].ended is None, "the killed run never ended"
    again = k[1]
    assert again.pid != k[0].pid
    # Back after the lease ran out (less what the kill took to be seen), first in K.
    back_after = (again.started - killed_at).total_seconds()
    assert vt - 1.5 <= back_after < vt + 5
    assert_one_at_a_time("K", k[1:])
    # Meanwhile every other key ran, in order, and was done before K:0 came back.
    assert len(keys) == 16
    for key, key_rows in keys.items():
        assert [r.n for r in key_rows] == [0, 1, 2], key
        assert_one_at_a_time(key, key_rows)
        assert all(r.ended is not None and r.ended < again.started for r in key_rows), key
    assert any(r.started > killed_at for r in rows if str(r.okey).startswith("b"))


# -- 3. strict and relaxed failure modes --------------------------------------------


@pytest.mark.parametrize(
    ("queue", "expected"),
    [
        # strict: the retry takes m1's place; m2 waits for it
        pytest.param("celery", [(1, 0), (1, 1), (2, 0), (3, 0)], id="strict"),
        # relaxed: the retry goes to the back of the key
        pytest.param("relaxed", [(1, 0), (2, 0), (3, 0), (1, 1)], id="relaxed"),
    ],
)
@pytest.mark.sessions(8)  # the most of two runs, -n 0
def test_a_retry_keeps_its_place_in_a_strict_queue_and_goes_last_in_a_relaxed_one(
    shared: Env, queue: str, expected: list[tuple[int, int]]
) -> None:
    oenv = shared
    client = oenv.client()
    # In one transaction: a worker cannot take m1 (and send its retry) before m3 is there.
    with pg_transport.batch():
        for n in (1, 2, 3):
            client.send_task(f"{APP}.retry_first", args=["R", n], ordering_key="R", queue=queue)
    wait_for(lambda: ended(oenv) >= 4, 30, "four runs")
    wait_for(lambda: queue_empty(oenv), 30, "every message acked")
    rows = runs(oenv)
    assert [(r.n, r.attempt) for r in rows] == expected
    assert {r.queue for r in rows} == {queue}
    mode = oenv.scalar("SELECT ordering FROM {schema}.queue WHERE name = %s", queue)
    assert mode == ("relaxed" if queue == "relaxed" else None)  # (None: strict)
    assert all(r.header_key == "R" for r in rows), "the retry kept its key"
    assert_one_at_a_time("R", rows)


@pytest.mark.parametrize(
    ("queue", "expected"),
    [
        # strict: given back, m1 stays first, until max_attempts dead-letters it
        pytest.param("celery", [1, 1, 2, 3], id="strict"),
        # relaxed: given back, m1 goes to the back of the key
        pytest.param("relaxed", [1, 2, 3, 1], id="relaxed"),
    ],
)
@pytest.mark.sessions(10)  # side by side, the run's meter
def test_a_message_given_back_until_dead_lettered_releases_its_key(
    oenv: Env, queue: str, expected: list[int]
) -> None:
    client = oenv.client()
    environ = {f"PGQ_MAX_ATTEMPTS_{queue.upper()}": "2"}
    with together(oenv, "g1", "g2", concurrency=2, queues="celery,relaxed", environ=environ):
        # In one transaction: a worker cannot take m1 (and give it back to the end of
        # its key) before m3 is there, which would put m1 before m3.
        with pg_transport.batch():
            first = client.send_task(
                f"{APP}.requeue_first", args=["G", 1], ordering_key="G", queue=queue
            )
            for n in (2, 3):
                client.send_task(
                    f"{APP}.requeue_first", args=["G", n], ordering_key="G", queue=queue
                )
        wait_for(lambda: ended(oenv) >= 4, 30, "four runs")
        wait_for(lambda: queue_empty(oenv), 30, "m1 dead-lettered, the others acked")
    rows = runs(oenv)
    assert [r.n for r in rows] == expected
    assert_one_at_a_time("G", rows)
    assert oenv.scalar("SELECT task_id FROM {schema}.dead_letter") == first.id
    assert oenv.scalar("SELECT count(*) FROM {schema}.dead_letter") == 1


@pytest.mark.sessions(9)  # the most of two runs, -n 0
def test_a_failure_rejected_without_requeue_is_dead_lettered_and_releases_its_key(
    shared: Env,
) -> None:
    oenv = shared
    client = oenv.client()
    first = client.send_task(f"{APP}.fail_first", args=["F", 1], ordering_key="F")
    for n in (2, 3):
        client.send_task(f"{APP}.fail_first", args=["F", n], ordering_key="F")
    wait_for(lambda: ended(oenv) >= 3, 30, "three runs")
    wait_for(lambda: queue_empty(oenv), 30, "m1 dead-lettered, the others acked")
    rows = runs(oenv)
    assert [r.n for r in rows] == [1, 2, 3]
    assert_one_at_a_time("F", rows)
    assert oenv.scalar("SELECT task_id FROM {schema}.dead_letter") == first.id


@pytest.mark.sessions(8)  # side by side, the run's meter: 6
def test_a_message_a_stopping_worker_gives_back_unstarted_keeps_its_place(oenv: Env) -> None:
    """Not a failure: a worker's warm shutdown gives back what it received and never
    started, in a relaxed queue as in a strict one, and its key keeps its order."""
    client = oenv.client()
    client.send_task(f"{APP}.stall", args=["x", 0, 2.0], ordering_key="x")
    for queue, key in (("celery", "s"), ("relaxed", "r")):
        for n in (1, 2, 3):
            client.send_task(STEP, args=[key, n], ordering_key=key, queue=queue)
    # One slot, busy with x: s:1 and r:1 are received and wait behind it.
    with together(oenv, "stopping", concurrency=1, queues="celery,relaxed") as (worker,):
        wait_for(
            lambda: (
                oenv.scalar(
                    "SELECT count(*) FROM {schema}.message WHERE okey IN ('s', 'r') AND read_ct > 0"
                )
                == 2
            ),
            30,
            "s:1 and r:1 to be received",
        )
        worker.stop()  # SIGTERM: x finishes, s:1 and r:1 are given back unstarted
    assert "Restoring 2 unacknowledged message(s)" in worker.output()
    assert [r.okey for r in runs(oenv)] == ["x"]
    with together(oenv, "next", concurrency=1, queues="celery,relaxed"):
        wait_for(lambda: ended(oenv) >= 7, 30, "every run")
        wait_for(lambda: queue_empty(oenv), 30, "every message acked")
    keys = by_key(runs(oenv))
    assert [r.n for r in keys["s"]] == [1, 2, 3]
    assert [r.n for r in keys["r"]] == [1, 2, 3], "r:1 went to the back of its key"


# -- 4. follows -----------------------------------------------------------------------


def parked(env: Env, task_id: str) -> bool:
    """A claim met the message and set it aside to wait (its due_at keeps when)."""
    return bool(
        env.scalar("SELECT due_at IS NOT NULL FROM {schema}.message WHERE task_id = %s", task_id)
    )


@pytest.mark.parametrize("findable", ["followable", "ordering_key"])
@pytest.mark.sessions(10)  # the most of two runs, -n 0
def test_a_follower_published_first_waits_for_its_predecessor(shared: Env, findable: str) -> None:
    oenv = shared
    client = oenv.client()
    before = str(uuid.uuid4())
    follower = client.send_task(STEP, args=[None, 2], follows=before, follows_timeout=60)
    wait_for(lambda: parked(oenv, follower.id), 30, "a claim to hold the follower back")
    options: dict[str, Any] = (
        {"followable": True} if findable == "followable" else {"ordering_key": "P"}
    )
    client.send_task(STEP, args=["P", 1, 0.5], task_id=before, **options)
    wait_for(lambda: ended(oenv) >= 2, 30, "both runs")
    wait_for(lambda: queue_empty(oenv), 30, "both acked")
    first, second = runs(oenv)
    assert (first.task_id, second.task_id) == (before, follower.id)
    assert first.ended is not None and second.started > first.ended
    assert second.missing is None
    assert oenv.scalar("SELECT count(*) FROM {schema}.ordering_signals") == 0


@pytest.mark.sessions(11)  # the most of two runs, -n 0
def test_a_chain_published_backwards_across_queues_runs_forwards(shared: Env) -> None:
    """c follows b follows a, published c, b, a, b in another queue; and a follower of a
    task that fails and is dead-lettered runs after it, as after one that succeeded."""
    oenv = shared
    client = oenv.client()
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    client.send_task(STEP, args=["c", 3], task_id=c, follows=b, follows_timeout=60)
    wait_for(lambda: parked(oenv, c), 30, "a claim to hold c back")
    client.send_task(
        STEP, args=["b", 2, 0.2], task_id=b, follows=a, follows_timeout=60, queue="other"
    )
    wait_for(lambda: parked(oenv, b), 30, "a claim to hold b back")
    client.send_task(STEP, args=["a", 1, 0.2], task_id=a, followable=True)
    failing = client.send_task(f"{APP}.fail_first", args=["p", 1], followable=True)
    client.send_task(STEP, args=["f", 2], follows=failing.id, follows_timeout=60)
    wait_for(lambda: ended(oenv) >= 5, 30, "five runs")
    wait_for(lambda: queue_empty(oenv), 30, "every message acked or dead-lettered")
    rows = runs(oenv)
    chain = [r for r in rows if r.okey in ("a", "b", "c")]
    assert [(r.okey, r.queue) for r in chain] == [("a", "celery"), ("b", "other"), ("c", "celery")]
    assert_one_at_a_time("chain", chain)
    after_failure = [r for r in rows if r.okey in ("p", "f")]
    assert [r.okey for r in after_failure] == ["p", "f"]
    assert_one_at_a_time("p, f", after_failure)
    assert all(r.missing is None for r in rows)
    assert oenv.scalar("SELECT task_id FROM {schema}.dead_letter") == failing.id


@pytest.mark.sessions(10)  # the most of two runs, -n 0
def test_a_follower_of_a_finished_followable_task_runs_at_once(shared: Env) -> None:
    oenv = shared
    client = oenv.client()
    before = client.send_task(STEP, args=[None, 1], followable=True)
    wait_for(lambda: queue_empty(oenv), 30, "the predecessor acked")
    published = now(oenv)
    follower = client.send_task(STEP, args=[None, 2], follows=before.id, follows_timeout=60)
    wait_for(lambda: ended(oenv) >= 2, 30, "the follower")
    rows = runs(oenv)
    assert [r.task_id for r in rows] == [before.id, follower.id]
    assert rows[1].missing is None
    assert (rows[1].started - published).total_seconds() < 10


@pytest.mark.sessions(7)  # the most of two runs, -n 0
def test_a_follower_whose_predecessor_never_comes_runs_after_its_wait(oenv: Env) -> None:
    client = oenv.client()
    never = str(uuid.uuid4())
    wait = 2.0
    with together(oenv, "fm", concurrency=2) as (worker,):
        published = now(oenv)
        follower = client.send_task(STEP, args=[None, 1], follows=never, follows_timeout=wait)
        wait_for(lambda: ended(oenv) >= 1, 30, "the follower")
        wait_for(lambda: queue_empty(oenv), 30, "the follower acked")
    (run,) = runs(oenv)
    assert run.task_id == follower.id
    assert run.missing == never
    assert (run.started - published).total_seconds() >= wait - 0.1
    with psycopg.connect(oenv.pg_url) as conn:
        told = conn.execute(
            sql.SQL("SELECT sender, queue, task_id, follows, pid FROM {}.ordering_signals").format(
                sql.Identifier(oenv.schema)
            )
        ).fetchall()
    assert told == [(STEP, "celery", follower.id, never, worker.proc.pid)]


# -- 5. a task's default key -----------------------------------------------------------

PUBLISH = """
import sys, threading, uuid
from pg_transport.message.ordering import OrderingError
from tests.acceptance.ordering_app import customer_step

def publish():
    for n in range(20):
        for customer in ("c1", "c2", "c3"):
            customer_step.delay(customer=customer, n=n)
    try:  # no usable key (a UUID object): refused, not published unordered
        customer_step.delay(customer=uuid.uuid4(), n=99)
    except OrderingError as exc:
        print("refused:", exc)
    else:
        sys.exit("a call with no usable key was published")

if sys.argv[1] == "thread":  # as a web server's request thread would
    t = threading.Thread(target=publish)
    t.start()
    t.join()
else:
    publish()
"""


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.sessions(13)  # the most of two runs, -n 0
def test_a_task_s_ordering_key_argument_keys_its_calls(shared: Env, where: str) -> None:
    oenv = shared
    # A separate service importing the app publishes with .delay(customer=...), no header.
    published = subprocess.run(
        [sys.executable, "-c", PUBLISH, where],
        cwd=ROOT,
        env=oenv.environ(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert published.returncode == 0, published.stdout + published.stderr
    assert "refused: header pgq-ordering-key=UUID(" in published.stdout
    wait_for(lambda: ended(oenv) >= 60, 30, "sixty runs")
    wait_for(lambda: queue_empty(oenv), 30, "every message acked")
    rows = runs(oenv)
    keys = by_key(rows)
    assert sorted(keys) == ["c1", "c2", "c3"]
    for key, key_rows in keys.items():
        assert all(r.header_key == key for r in key_rows), f"{key}: no ordering key header"
        assert [r.n for r in key_rows] == list(range(20)), key
        assert_one_at_a_time(key, key_rows)
