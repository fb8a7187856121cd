"""Barrier races with real concurrent connections, started together by a
threading.Barrier or stepped through their transactions: never-firing,
double-firing, a part redelivered while it is being counted, sweep against the
last part. No worker: the completion functions are called directly."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from pg_transport.fanin import state as st
from pg_transport.fanin.backend import Backend, backend_for, forget
from pg_transport.fanin.messages import Outgoing
from tests.acceptance.harness import wait_for
from tests.integration.conftest import Peek

REPEAT = 200


@pytest.fixture
def db(broker_url: str, schema: str) -> Iterator[Backend]:
    app = Celery("barrier-races", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    yield backend_for(app)
    forget(app)


class Sessions:
    """One connection per thread, kept across repetitions, each step started at once."""

    def __init__(self, pg_url: str, n: int) -> None:
        self.conns = [psycopg.connect(pg_url, autocommit=True) for _ in range(n)]
        self.n = n

    def race(self, step: Callable[[int, psycopg.Connection[Any]], Any]) -> list[Any]:
        start = threading.Barrier(self.n)
        out: list[Any] = [None] * self.n
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                start.wait(10)
                out[i] = step(i, self.conns[i])
            except BaseException as exc:  # reported below, failing the test
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        return out

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


@pytest.fixture
def sessions(pg_url: str, db: Backend) -> Iterator[Callable[[int], Sessions]]:
    made: list[Sessions] = []

    def make(n: int) -> Sessions:
        made.append(Sessions(pg_url, n))
        return made[-1]

    yield make
    for s in made:
        s.close()


def arm(db: Backend, conn: psycopg.Connection[Any], bid: str, parts: int) -> None:
    # The part messages themselves do not matter here; arming with stand-ins is faster.
    outgoing = [Outgoing("parts", 0, {"body": "", "headers": {}}, f"p{i}") for i in range(parts)]
    st.arm(
        db,
        conn,
        bid,
        outgoing,
        db.app.signature("t.collect"),
        db.app.signature("t.err"),
        ttl=3600,
        stuck_timeout=3600,
        metadata={},
    )


def result(index: int) -> str:
    return json.dumps({"part": index})


def callbacks(peek: Peek) -> Counter[str]:
    rows = peek(
        "SELECT payload->'headers'->>'pgq_barrier' FROM {schema}.message"
        " WHERE payload->'headers'->>'task' = 't.collect'"
    )
    return Counter(r[0] for r in rows)


@pytest.mark.sessions(13)  # side by side, the run's meter
def test_parts_finishing_together_always_fire(
    db: Backend, sessions: Callable[[int], Sessions], peek: Peek, pg_url: str
) -> None:
    """Never-firing: N parts in N concurrent transactions; one must see 0."""
    n = 6
    racers = sessions(n)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for rep in range(REPEAT):
            arm(db, conn, f"b{rep}", n)
    for rep in range(REPEAT):
        bid = f"b{rep}"
        outcomes = racers.race(lambda i, c, bid=bid: st.part_succeeded(db, c, bid, i, result(i)))
        assert sorted(outcomes) == [st.COUNTED] * (n - 1) + [st.FIRED], (rep, outcomes)
    assert peek("SELECT status, count(*) FROM {schema}.barrier GROUP BY 1") == [("fired", REPEAT)]
    assert callbacks(peek) == {f"b{rep}": 1 for rep in range(REPEAT)}
    # Each callback got every result, in part order.
    bodies = peek(
        "SELECT payload->>'body' FROM {schema}.message"
        " WHERE payload->'headers'->>'task' = 't.collect'"
    )
    for (body,) in bodies:
        assert json.loads(body)[0][0] == [{"part": i} for i in range(n)]


@pytest.mark.sessions(9)  # side by side, the run's meter
def test_last_two_parts_at_the_same_instant_fire_once(
    db: Backend, sessions: Callable[[int], Sessions], peek: Peek, pg_url: str
) -> None:
    """Double-firing: the last two parts race; exactly one fires."""
    n = 4
    racers = sessions(2)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for rep in range(REPEAT):
            bid = f"b{rep}"
            arm(db, conn, bid, n)
            for i in range(n - 2):
                assert st.part_succeeded(db, conn, bid, i, result(i)) == st.COUNTED
    for rep in range(REPEAT):
        bid = f"b{rep}"
        outcomes = racers.race(
            lambda i, c, bid=bid: st.part_succeeded(db, c, bid, n - 2 + i, result(n - 2 + i))
        )
        assert sorted(outcomes) == [st.COUNTED, st.FIRED], (rep, outcomes)
    assert callbacks(peek) == {f"b{rep}": 1 for rep in range(REPEAT)}


@pytest.mark.sessions(9)  # side by side, the run's meter
def test_same_part_redelivered_concurrently_counts_once(
    db: Backend, sessions: Callable[[int], Sessions], peek: Peek, pg_url: str
) -> None:
    racers = sessions(3)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for rep in range(50):
            arm(db, conn, f"b{rep}", 2)
    for rep in range(50):
        bid = f"b{rep}"
        outcomes = racers.race(lambda i, c, bid=bid: st.part_succeeded(db, c, bid, 0, result(0)))
        assert sorted(outcomes) == [st.COUNTED, st.DUPLICATE, st.DUPLICATE]
    assert peek("SELECT DISTINCT remaining FROM {schema}.barrier") == [(1,)]


def waiting_on_lock(peek: Peek, conn: psycopg.Connection[Any]) -> bool:
    pid = conn.info.backend_pid
    return bool(peek("SELECT 1 FROM pg_locks WHERE NOT granted AND pid = %s", pid))


@pytest.mark.parametrize("first_commits", [True, False])
def test_stepped_parts_second_waits_for_first(
    db: Backend, peek: Peek, pg_url: str, first_commits: bool
) -> None:
    """Two sessions stepped through their transactions: part 0 counts and holds its
    transaction open; part 1 waits on the row; then part 0 commits (part 1 fires,
    with part 0's result) or rolls back (part 1 only counts: a part that did not
    commit was never counted)."""
    with (
        psycopg.connect(pg_url, autocommit=True) as a,
        psycopg.connect(pg_url, autocommit=True) as b,
    ):
        arm(db, a, "b", 2)
        outcome: list[str] = []
        tx = a.transaction()
        tx.__enter__()
        assert st.part_succeeded(db, a, "b", 0, result(0)) == st.COUNTED
        second = threading.Thread(
            target=lambda: outcome.append(st.part_succeeded(db, b, "b", 1, result(1)))
        )
        second.start()
        wait_for(lambda: waiting_on_lock(peek, b), 10, "part 1 to wait for part 0")
        if first_commits:
            tx.__exit__(None, None, None)
        else:
            tx.__exit__(RuntimeError, RuntimeError("worker died"), None)
        second.join(10)
        if first_commits:
            assert outcome == [st.FIRED]
            assert callbacks(peek) == {"b": 1}
        else:
            assert outcome == [st.COUNTED]
            assert callbacks(peek) == {}
            assert st.part_succeeded(db, a, "b", 0, result(0)) == st.FIRED  # redelivered


def test_sweep_against_the_last_part_has_one_winner(
    db: Backend, sessions: Callable[[int], Sessions], peek: Peek, pg_url: str
) -> None:
    reps = 100
    racers = sessions(2)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for rep in range(reps):
            arm(db, conn, f"b{rep}", 1)

    def step(i: int, c: psycopg.Connection[Any], bid: str) -> Any:
        if i == 0:
            return st.part_succeeded(db, c, bid, 0, result(0))
        return st.sweep_due(db, c, 1000)

    for rep in range(reps):
        bid = f"b{rep}"
        peek("UPDATE {schema}.barrier SET expires_at = now() - interval '1 s' WHERE id = %s", bid)
        racers.race(lambda i, c, bid=bid: step(i, c, bid))
    rows = peek("SELECT status, count(*) FROM {schema}.barrier GROUP BY 1")
    assert sum(n for _, n in rows) == reps
    errbacks = peek(
        "SELECT payload->'headers'->>'pgq_barrier' FROM {schema}.message"
        " WHERE payload->'headers'->>'task' = 't.err'"
    )
    expired = {r[0] for r in peek("SELECT id FROM {schema}.barrier WHERE status = 'expired'")}
    fired = {r[0] for r in peek("SELECT id FROM {schema}.barrier WHERE status = 'fired'")}
    assert expired | fired == {f"b{rep}" for rep in range(reps)}
    assert Counter(r[0] for r in errbacks) == dict.fromkeys(expired, 1)
    assert callbacks(peek) == dict.fromkeys(fired, 1)
