"""A key's order is its commit order, and never two messages of one key at once, however
inserts and commits interleave: a message published in an application's transaction
(or a batch) that commits after a later-inserted one of its key, retries and relaxed
requeues committed late, and two commits of a key at the same moment.

Each interleaving is stepped on real sessions: the late publish's transaction is held
open on a session of its own while the rest runs; where its commit must be caught
between its place being decided and its becoming visible, a test trigger makes that
commit wait for an advisory lock the test holds (seen waiting in pg_stat_activity).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pg_transport
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.integration.test_ordering import Q, bodies, claim, message, pid_of, raw_claim

PAUSE_LOCK = 4242


@pytest.fixture
def session(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url) as conn:  # not autocommit: the test holds transactions
        yield conn


def outside(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` outside any batch or transaction block open in this context."""
    return contextvars.Context().run(fn, *args)


def drain(store: Store) -> list[int]:
    """Claim and ack until nothing comes, one key at a time; the bodies in order."""
    order: list[int] = []
    while batch := claim(store):
        order += bodies(batch)
        store.ack([c.token for c in batch])
    return order


# -- a publish committed late ------------------------------------------------------------


def test_a_message_committed_while_a_later_one_of_its_key_runs_waits_for_it(
    store: Store, session: psycopg.Connection[Any]
) -> None:
    with session.transaction(), pg_transport.transaction(session):
        store.publisher.publish(Q, message(1, key="k"))  # B: inserted first, not committed
        outside(store.publisher.publish, Q, message(2, key="k"))  # A: committed
        [a] = claim(store)
        assert bodies([a]) == [2]
    assert claim(store) == [], "B was delivered while A, of its key, runs"
    store.ack([a.token])
    assert bodies(claim(store)) == [1]


def test_waiting_messages_of_a_key_run_in_commit_order_not_insert_order(
    store: Store, session: psycopg.Connection[Any]
) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    [first] = claim(store)
    with session.transaction(), pg_transport.transaction(session):
        store.publisher.publish(Q, message(1, key="k"))  # inserted before 2 ...
        outside(store.publisher.publish, Q, message(2, key="k"))
        assert claim(store) == []
    # ... committed after it.
    store.ack([first.token])
    assert drain(store) == [2, 1]


def test_a_batch_committed_late_waits_and_keeps_its_own_order(store: Store) -> None:
    with pg_transport.batch():
        store.publisher.publish(Q, message(1, key="k"))
        outside(store.publisher.publish, Q, message(0, key="k"))  # inserted between ...
        store.publisher.publish(Q, message(2, key="k"))
        store.publisher.publish(Q, message(3, key="k"))
        [a] = outside(claim, store)
        assert bodies([a]) == [0]
    assert claim(store) == [], "the batch's first was delivered beside 0"
    store.ack([a.token])
    assert drain(store) == [1, 2, 3]


def test_a_batch_of_one_key_larger_than_the_places_read_keeps_its_order(
    store: Store, peek: Peek
) -> None:
    with pg_transport.batch():
        for n in range(70):  # past the 64 later places the commit trigger reads
            store.publisher.publish(Q, message(n, key="k"))
        outside(store.publisher.publish, Q, message(100, key="k"))
    assert drain(store) == [100, *range(70)]


def test_a_strict_retry_committed_after_its_original_left_goes_behind_the_key(
    store: Store, session: psycopg.Connection[Any]
) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    store.publisher.publish(Q, message(1, key="k"))
    [m0] = claim(store)
    with session.transaction(), pg_transport.transaction(session):
        # The retry takes m0's place (strict) but commits only after m0 was acked and
        # m1, the key's next, is running.
        store.publisher.publish(Q, message(100, key="k", task_id="task-0"))
        store.ack([m0.token])
        [m1] = claim(store)
        assert bodies([m1]) == [1]
    assert claim(store) == [], "the retry was delivered while m1 runs"
    store.ack([m1.token])
    assert bodies(claim(store)) == [100]


def test_a_strict_retry_committed_before_the_ack_keeps_its_place(store: Store) -> None:
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    store.publisher.publish(Q, message(100, key="k", task_id="task-0"))  # Celery's retry()
    store.ack([m0.token])
    assert drain(store) == [100, 1, 2]


def test_a_relaxed_requeue_goes_behind_what_committed_before_it_only(
    store: Store, session: psycopg.Connection[Any]
) -> None:
    store.declare_queue(Q, ordering="relaxed")
    store.publisher.publish(Q, message(0, key="k"))
    [m0] = claim(store)
    with session.transaction(), pg_transport.transaction(session):
        store.publisher.publish(Q, message(1, key="k"))  # inserted before the requeue ...
        store.release([m0.token], failed=True)  # m0 to the back of its key: still first
        [again] = claim(store)
        assert bodies([again]) == [0]
    # ... committed after it, and after m0 was delivered again.
    assert claim(store) == [], "1 was delivered while m0, requeued, runs"
    store.ack([again.token])
    assert bodies(claim(store)) == [1]


def test_a_relaxed_requeue_before_a_late_commit_runs_before_it(
    store: Store, session: psycopg.Connection[Any]
) -> None:
    store.declare_queue(Q, ordering="relaxed")
    for n in range(2):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    with session.transaction(), pg_transport.transaction(session):
        store.publisher.publish(Q, message(2, key="k"))
        store.release([m0.token], failed=True)  # back of the key: behind 1, before 2
    assert drain(store) == [1, 0, 2]


# -- two commits of a key at the same moment -------------------------------------------------


@pytest.fixture
def paused_commit(peek: Peek) -> Iterator[Peek]:
    """A commit of a transaction that set ``pgq_test.pause`` waits, after pgq's own
    commit-time trigger ran, until the test releases the advisory lock PAUSE_LOCK it
    holds (``peek.conn``): the moment between a message's place being decided and its
    commit becoming visible, held open."""
    peek(
        "CREATE FUNCTION {schema}.test_pause() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF current_setting('pgq_test.pause', true) = 'on' THEN"
        f" PERFORM pg_advisory_xact_lock({PAUSE_LOCK}); END IF; RETURN NULL; END $$"
    )
    # Constraint triggers of one event fire in name order: after message_commit_place.
    peek(
        "CREATE CONSTRAINT TRIGGER zz_test_pause AFTER INSERT ON {schema}.message"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.test_pause()"
    )
    peek(f"SELECT pg_advisory_lock({PAUSE_LOCK})")
    try:
        yield peek
    finally:
        peek("SELECT pg_advisory_unlock_all()")


def commit_paused(
    store: Store, session: psycopg.Connection[Any], peek: Peek, payload: dict[str, Any]
) -> threading.Thread:
    """Publish ``payload`` on ``session`` and start its commit in a thread; return once
    the commit waits at the pause (its place decided, not visible yet)."""
    session.execute("SET LOCAL pgq_test.pause = 'on'")
    with pg_transport.transaction(session):
        store.publisher.publish(Q, payload)
    thread = threading.Thread(target=session.commit)
    thread.start()
    peek.wait_for_lock(pid_of(session), "the commit did not wait at the pause")
    return thread


def test_a_message_placed_first_but_visible_after_one_delivered_waits_for_it(
    store: Store, session: psycopg.Connection[Any], paused_commit: Peek
) -> None:
    peek = paused_commit
    late = commit_paused(store, session, peek, message(1, key="k"))  # B: place decided
    store.publisher.publish(Q, message(2, key="k"))  # A: after B's place, visible first
    [a] = claim(store)
    assert bodies([a]) == [2]
    peek(f"SELECT pg_advisory_unlock({PAUSE_LOCK})")
    late.join(10)
    assert not late.is_alive()
    # B kept its earlier place (its commit could not see A): the claim finds A in flight.
    assert claim(store) == [], "B was delivered while A, of its key, runs"
    assert peek(
        "SELECT visible_at = (SELECT visible_at FROM {schema}.message WHERE id = %s)"
        " FROM {schema}.message WHERE payload->>'body' = '1'",
        a.id,
    ) == [(True,)]  # parked until A's lease ends: a dead worker's A cannot wedge it
    store.ack([a.token])  # the ack's trigger promotes B
    assert bodies(claim(store)) == [1]


def test_a_message_placed_first_waits_for_one_being_claimed_right_now(
    store: Store, session: psycopg.Connection[Any], paused_commit: Peek, pg_url: str
) -> None:
    peek = paused_commit
    late = commit_paused(store, session, peek, message(1, key="k"))
    store.publisher.publish(Q, message(2, key="k"))
    with psycopg.connect(pg_url) as claimer, claimer.transaction():
        rows = raw_claim(store, claimer)  # A claimed, not committed: A looks ready
        assert [r[5]["body"] for r in rows if r[8] is None] == ["2"]
        peek(f"SELECT pg_advisory_unlock({PAUSE_LOCK})")
        late.join(10)
        assert not late.is_alive()
        assert claim(store) == [], "B was delivered while A is being claimed"
    assert claim(store) == []  # A's claim committed: A in flight
    [a_id] = [r[0] for r in rows if r[8] is None]
    peek("DELETE FROM {schema}.message WHERE id = %s", a_id)  # A acked
    assert bodies(claim(store)) == [1]


def test_a_key_with_nothing_in_flight_still_delivers_at_once(store: Store, peek: Peek) -> None:
    # Its later messages ready and beyond the claim's limit (no claim met them yet):
    # the head goes at once.
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    assert bodies(claim(store, limit=1)) == [0]
    assert peek("SELECT count(*) FROM {schema}.message WHERE visible_at = 'infinity'") == [(0,)]
    assert claim(store) == []  # then met, and parked behind it


def test_a_message_waiting_for_one_whose_worker_died_is_not_wedged(
    store: Store, session: psycopg.Connection[Any], paused_commit: Peek
) -> None:
    peek = paused_commit
    late = commit_paused(store, session, peek, message(1, key="k"))
    store.publisher.publish(Q, message(2, key="k"))
    [a] = claim(store)
    peek(f"SELECT pg_advisory_unlock({PAUSE_LOCK})")
    late.join(10)
    assert claim(store) == []  # B waits for A's lease
    # A's worker dies: its lease, and with it B's wait, runs out. B has the earlier
    # place: it goes, and A, ready again, waits behind it (not the two parked for good
    # behind each other).
    peek.expire_leases()
    [b] = claim(store)
    assert bodies([b]) == [1]
    assert claim(store) == []  # A parked behind B
    store.ack([b.token])
    [again] = claim(store)
    assert bodies([again]) == [2] and again.read_ct == 2
    assert again.id == a.id
