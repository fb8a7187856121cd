"""Guard primitives on a real Postgres: atomic transitions, claims with leases and
tombstones, generations with head and tail checks, advisory keys across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from barrier.guards import Claim, Guards, lock_id, transition, try_lock_id
from pg_transport.db.locks import advisory_key
from pg_transport.db.pool import Connector
from pg_transport.fanin.errors import LockHeld
from pg_transport.store import Store
from tests.acceptance.harness import wait_for
from tests.integration.conftest import Peek
from tests.integration.squatter import squatter


@pytest.fixture
def guards(store: Store) -> Guards:  # `store` migrates the schema
    return Guards(store.schema)


@pytest.fixture
def connect(pg_url: str) -> Iterator[Callable[[], psycopg.Connection[Any]]]:
    opened: list[psycopg.Connection[Any]] = []

    def make() -> psycopg.Connection[Any]:
        opened.append(psycopg.connect(pg_url, autocommit=True))
        return opened[-1]

    yield make
    for conn in opened:
        conn.close()


def race(
    conns: list[psycopg.Connection[Any]], step: Callable[[psycopg.Connection[Any]], Any]
) -> list[Any]:
    """Run ``step`` on every connection at once (threads released together)."""
    start = threading.Barrier(len(conns))
    out: list[Any] = [None] * len(conns)

    def run(i: int) -> None:
        start.wait(10)
        out[i] = step(conns[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


# -- atomic transition ------------------------------------------------------------
def test_racing_transitions_have_one_winner(
    peek: Peek, schema: str, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    peek("CREATE TABLE {schema}.execution (exec_id bigint PRIMARY KEY, state text NOT NULL)")
    conns = [connect(), connect()]
    targets = ["COMPLETED", "ERROR"]  # the callback finishing vs a failure elsewhere
    for n in range(100):
        peek("INSERT INTO {schema}.execution VALUES (%s, 'RUNNING')", n)
        out = race(
            conns,
            lambda c, n=n: transition(
                c,
                (schema, "execution"),
                n,
                targets[conns.index(c)],
                ["RUNNING"],
                id_column="exec_id",
                status_column="state",
            ),
        )
        winners = [o for o in out if o is not None]
        assert len(winners) == 1, out
        assert peek("SELECT state FROM {schema}.execution WHERE exec_id = %s", n) == [
            (winners[0][1],)
        ]


def test_transition_from_an_illegal_status_returns_none(
    peek: Peek, schema: str, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    peek("CREATE TABLE {schema}.job (id text PRIMARY KEY, status text NOT NULL)")
    peek("INSERT INTO {schema}.job VALUES ('j', 'STOPPED')")
    conn = connect()
    assert transition(conn, (schema, "job"), "j", "RUNNING", ["QUEUED"]) is None
    assert transition(conn, (schema, "job"), "j", "QUEUED", ["STOPPED", "ERROR"]) == ("j", "QUEUED")


# -- claims with a lease ------------------------------------------------------------
@pytest.mark.sessions(11)
def test_two_workers_one_key_one_winner(
    guards: Guards, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    conns = [connect() for _ in range(4)]
    for n in range(50):
        out = race(conns, lambda c, n=n: guards.claim(c, f"k{n}", f"w{conns.index(c)}", 30))
        assert len([o for o in out if o is not None]) == 1, out


def test_fresh_lease_excludes_stale_lease_is_reclaimed(
    guards: Guards, peek: Peek, pg_url: str, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    conn = connect()
    first = guards.claim(conn, "k", "w1", 30)
    assert first == Claim("k", "w1", 1)
    assert guards.claim(conn, "k", "w2", 30) is None  # fresh: excluded
    assert guards.claim(conn, "k", "w1", 30) is None  # even for its holder: it renews
    assert guards.renew(conn, first, 30)
    # What the passing of the lease does, without waiting for it.
    peek("UPDATE {schema}.guard_claim SET lease_until = now() - interval '1 s'")
    second = guards.claim(conn, "k", "w2", 30)
    assert second == Claim("k", "w2", 2)
    # The first holder woke up late: fenced out of everything.
    assert not guards.renew(conn, first, 30)
    assert not guards.complete(conn, first)
    connector = Connector(pg_url)
    guards.release(connector, first)  # a late release does not free the new holder's claim
    connector.close()
    state = guards.state(conn, "k")
    assert state is not None and (state.holder, state.token, state.fresh) == ("w2", 2, True)


def test_completed_claim_is_a_tombstone(
    guards: Guards, peek: Peek, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    conn = connect()
    claim = guards.claim(conn, "k", "w1", 30)
    assert claim is not None and guards.complete(conn, claim)
    peek("UPDATE {schema}.guard_claim SET lease_until = now() - interval '1 day'")
    assert guards.claim(conn, "k", "w2", 30) is None  # redelivered finished work: refused
    state = guards.state(conn, "k")
    assert state is not None and state.tombstone


@pytest.mark.sessions(10)
def test_release_is_idempotent_and_survives_a_reaped_connection(
    guards: Guards, pg_url: str, peek: Peek, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    conn = connect()
    claim = guards.claim(conn, "k", "w1", 30)
    assert claim is not None
    connector = Connector(pg_url)
    try:
        with connector.connection() as pooled:
            pid = pooled.info.backend_pid
        # The idle pooled session is reaped (a pooler, a restart) before the release.
        peek("SELECT pg_terminate_backend(%s)", pid)
        wait_for(
            lambda: not peek("SELECT 1 FROM pg_stat_activity WHERE pid = %s", pid),
            10,
            "the backend to go",
        )
        guards.release(connector, claim)
        assert guards.state(conn, "k") is None
        guards.release(connector, claim)  # again: nothing left, no error
        assert guards.claim(conn, "k", "w2", 30) is not None
    finally:
        connector.close()


# -- generations --------------------------------------------------------------------
def schedule_successor(
    guards: Guards, conn: psycopg.Connection[Any], generation: int, interval: float
) -> bool:
    """A periodic task finishing: schedule its successor, unless it was superseded."""
    with conn.transaction():
        if not guards.hold_generation(conn, "job", generation):  # tail check
            return False
        conn.execute(
            "INSERT INTO schedule (key, generation, interval_s) VALUES ('job', %s, %s)"
            " ON CONFLICT (key) DO UPDATE SET generation = excluded.generation,"
            " interval_s = excluded.interval_s",
            [generation, interval],
        )
        return True


@pytest.fixture
def sched(
    guards: Guards, peek: Peek, schema: str, pg_url: str
) -> Iterator[Callable[[], psycopg.Connection[Any]]]:
    peek(
        "CREATE TABLE {schema}.schedule (key text PRIMARY KEY, generation bigint,"
        " interval_s float8)"
    )
    opened: list[psycopg.Connection[Any]] = []

    def make() -> psycopg.Connection[Any]:
        opened.append(psycopg.connect(pg_url, autocommit=True, options=f"-c search_path={schema}"))
        return opened[-1]

    yield make
    for conn in opened:
        conn.close()


def test_replaced_task_cannot_overwrite_its_replacements_successor(
    guards: Guards, peek: Peek, sched: Callable[[], psycopg.Connection[Any]]
) -> None:
    conn = sched()
    a = guards.bump(conn, "job")  # task A, every 2 s, starts running
    assert guards.is_current(conn, "job", a)  # A's head check passed
    b = guards.bump(conn, "job")  # A is replaced by B, every 0.5 s
    assert b == a + 1
    assert not guards.is_current(conn, "job", a)
    assert schedule_successor(guards, conn, b, 0.5)  # B finishes first
    assert not schedule_successor(guards, conn, a, 2.0)  # A's late completion
    assert peek("SELECT generation, interval_s FROM {schema}.schedule") == [(b, 0.5)]


@pytest.mark.sessions(10)
def test_a_replace_waits_for_a_holder_writing_under_its_tail_check(
    guards: Guards, peek: Peek, sched: Callable[[], psycopg.Connection[Any]]
) -> None:
    a_conn, b_conn = sched(), sched()
    a = guards.bump(a_conn, "job")
    bumped: list[int] = []
    with a_conn.transaction():
        assert guards.hold_generation(a_conn, "job", a)
        replace = threading.Thread(target=lambda: bumped.append(guards.bump(b_conn, "job")))
        replace.start()
        pid = b_conn.info.backend_pid
        wait_for(
            lambda: peek("SELECT 1 FROM pg_locks WHERE NOT granted AND pid = %s", pid),
            10,
            "the replace to wait for A's transaction",
        )
        assert bumped == []
        a_conn.execute("INSERT INTO schedule VALUES ('job', %s, 2.0)", [a])
    replace.join(10)
    assert bumped == [a + 1]
    # A wrote while it was current; B's successor now replaces it, never the reverse.
    assert schedule_successor(guards, b_conn, bumped[0], 0.5)
    assert not schedule_successor(guards, a_conn, a, 2.0)
    assert peek("SELECT generation, interval_s FROM {schema}.schedule") == [(a + 1, 0.5)]


def test_guard_checks_outside_a_transaction_are_refused(
    guards: Guards, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    conn = connect()
    with pytest.raises(RuntimeError, match="inside a transaction"):
        guards.hold_generation(conn, "job", 1)
    with pytest.raises(RuntimeError, match="inside a transaction"):
        lock_id(conn, "x")


# -- advisory keys ------------------------------------------------------------------
def test_advisory_key_is_the_same_in_another_process() -> None:
    ids = ["exec-42", "ünïcode-id", ""]
    code = (
        "import sys; from pg_transport.db.locks import advisory_key; "
        "print(*(advisory_key('pgq:barrier-callback', 'pgq', i) for i in sys.argv[1:]))"
    )
    keys = []
    for seed in ("1", "2"):  # different hash() randomisation in each child
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code, *ids], env=env, check=True, capture_output=True, text=True
        ).stdout
        keys.append([int(k) for k in out.split()])
    mine = [advisory_key("pgq:barrier-callback", "pgq", i) for i in ids]
    assert keys == [mine, mine]
    assert all(-(2**63) <= k < 2**63 for k in mine) and len(set(mine)) == len(ids)


def test_id_lock_excludes_a_second_session(connect: Callable[[], psycopg.Connection[Any]]) -> None:
    a, b = connect(), connect()
    with a.transaction():
        lock_id(a, "pgq:test", "exec-42")
        with b.transaction():
            assert not try_lock_id(b, "pgq:test", "exec-42")
            assert try_lock_id(b, "pgq:test", "exec-43")
    with b.transaction():
        assert try_lock_id(b, "pgq:test", "exec-42")  # released at A's commit


def test_an_id_lock_a_connect_only_role_holds_is_given_up_naming_it(
    pg_url: str, connect: Callable[[], psycopg.Connection[Any]]
) -> None:
    conn = connect()
    with squatter(pg_url) as squat:
        squat.hold(advisory_key("pgq:test", "exec-42"))
        with conn.transaction():
            with pytest.raises(LockHeld) as caught:
                squat.beside("lock_id", lambda: lock_id(conn, "pgq:test", "exec-42", wait=0.2))
            message = str(caught.value)
            assert f"pid {squat.pid} (role {squat.role!r}, application 'squatter')" in message
            assert "('pgq:test', 'exec-42')" in message and "0.2 s" in message
            assert caught.value.holders and caught.value.parts == ("pgq:test", "exec-42")
            lock_id(conn, "pgq:test", "exec-43")  # the transaction goes on
        squat.conn.execute("SELECT pg_advisory_unlock_all()")
        with conn.transaction():
            lock_id(conn, "pgq:test", "exec-42", wait=0.2)  # free again: taken at once


def test_an_id_lock_waits_for_a_holder_that_lets_go(
    connect: Callable[[], psycopg.Connection[Any]],
) -> None:
    a, b, watch = connect(), connect(), connect()
    taken = threading.Event()
    with a.transaction():
        lock_id(a, "pgq:test", "exec-42")

        def second() -> None:
            with b.transaction():
                lock_id(b, "pgq:test", "exec-42")
                taken.set()

        thread = threading.Thread(target=second)
        thread.start()
        wait_for(
            lambda: watch.execute(  # (outside a transaction: activity read afresh)
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND query LIKE %s",
                [b.info.backend_pid, "%pg_try_advisory_xact_lock%"],
            ).fetchone(),
            10,
            "B to try the lock",
        )
        assert not taken.is_set()  # B tried while A holds it
    thread.join(10)  # A committed: B, trying again, takes it
    assert taken.is_set()
