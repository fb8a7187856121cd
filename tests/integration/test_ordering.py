"""Ordered delivery per key and follows, at the store: what the claim hands out, what the
triggers promote, and the races between claimers, acks, parks and publishes.

Races are stepped on real sessions: one side's statement runs inside a transaction held
open (its locks held) while the other side runs; a side that must wait for a lock is seen
waiting in pg_stat_activity before the first one commits.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pg_transport.db.pool import Connector
from pg_transport.message.rows import FOLLOWS_MISSING
from pg_transport.store import Claimed, Store, claim_params
from tests.integration.conftest import Peek

Q = "ordered"


def message(
    n: int,
    *,
    key: str | None = None,
    task_id: str | None = None,
    follows: str | None = None,
    wait: float | None = None,
    followable: bool = False,
) -> dict[str, Any]:
    headers: dict[str, Any] = {"id": task_id or f"task-{n}", "task": "t"}
    if key is not None:
        headers["pgq-ordering-key"] = key
    if follows is not None:
        headers["pgq-follows"] = follows
    if wait is not None:
        headers["pgq-follows-timeout"] = wait
    if followable:
        headers["pgq-followable"] = True
    return {"body": str(n), "headers": headers, "properties": {}, "content-type": "text/plain"}


def bodies(batch: list[Claimed]) -> list[int]:
    return [int(c.payload["body"]) for c in batch if c.payload is not None]


def claim(store: Store, limit: int = 100, queue: str = Q) -> list[Claimed]:
    return store.claim([queue], [30.0], limit)


@pytest.fixture
def session(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url) as conn:  # not autocommit: the test holds transactions
        yield conn


def raw_claim(store: Store, conn: psycopg.Connection[Any], limit: int = 100) -> list[Any]:
    """The claim statement on ``conn``, in whatever transaction ``conn`` has open."""
    return conn.execute(store.q["claim"], claim_params([Q], [30.0], limit, None, [])).fetchall()


def pid_of(conn: psycopg.Connection[Any]) -> int:
    return int(conn.info.backend_pid)


# -- order within a key ----------------------------------------------------------------------


def test_one_message_of_a_key_at_a_time_in_publish_order(store: Store) -> None:
    for n in range(6):
        store.publisher.publish(Q, message(n, key="a" if n % 2 == 0 else "b"))
    store.publisher.publish(Q, message(99))  # unordered: never held back
    order: list[int] = []
    while batch := claim(store):
        keys = [c.payload["headers"].get("pgq-ordering-key") for c in batch if c.payload]
        keyed = [k for k in keys if k is not None]
        assert len(keyed) == len(set(keyed)), "two of one key delivered together"
        assert claim(store) == [], "a key's next was delivered while its head is held"
        order += bodies(batch)
        store.ack([c.token for c in batch])
    assert sorted(order) == [0, 1, 2, 3, 4, 5, 99]
    assert [n for n in order if n in (0, 2, 4)] == [0, 2, 4]
    assert [n for n in order if n in (1, 3, 5)] == [1, 3, 5]


def test_parked_rows_are_not_read_again_and_the_ack_promotes_the_next(
    store: Store, peek: Peek
) -> None:
    for n in range(50):
        store.publisher.publish(Q, message(n, key="k"))
    [head] = claim(store)
    assert bodies([head]) == [0]
    parked = peek("SELECT count(*) FROM {schema}.message WHERE visible_at = 'infinity'")
    assert parked == [(49,)]
    assert claim(store) == [] and store.size(Q) == 49  # waiting, counted, not delivered
    store.ack([head.token])
    # The trigger made exactly the next one visible, at the time it would have been.
    visible = peek(
        "SELECT payload->>'body' FROM {schema}.message WHERE visible_at <= now() AND okey = 'k'"
    )
    assert visible == [("1",)]
    assert bodies(claim(store)) == [1]


def test_a_crashed_holders_message_comes_back_first_in_its_key(store: Store, peek: Peek) -> None:
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    [first] = claim(store)
    peek.expire_leases()  # its worker died: the lease lapses
    [again] = claim(store)
    assert bodies([again]) == [0] and again.read_ct == 2
    store.ack([first.token])  # the dead holder's late ack is fenced off
    assert claim(store) == []
    store.ack([again.token])
    assert bodies(claim(store)) == [1]


def test_strict_keeps_a_released_message_and_a_retry_first(store: Store) -> None:
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    store.release([m0.token])
    [m0_again] = claim(store)
    assert bodies([m0_again]) == [0]
    # Celery's retry: a new message with the same task id, published before the ack.
    store.publisher.publish(Q, message(100, key="k", task_id="task-0"))
    store.ack([m0_again.token])
    assert bodies(claim(store)) == [100]


def test_relaxed_sends_a_released_message_and_a_retry_to_the_back(store: Store) -> None:
    store.declare_queue(Q, ordering="relaxed")
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    store.release([m0.token])  # handed back unstarted (a worker stopping): keeps its place
    [m0] = claim(store)
    assert bodies([m0]) == [0]
    store.release([m0.token], failed=True)  # rejected: the trigger promotes the new head
    order = []
    while batch := claim(store):
        order += bodies(batch)
        store.ack([c.token for c in batch])
    assert order == [1, 2, 0]
    [m3] = (store.publisher.publish(Q, message(3, key="k")), claim(store))[1]
    store.publisher.publish(Q, message(4, key="k"))
    store.publisher.publish(Q, message(103, key="k", task_id="task-3"))  # a retry of 3
    store.ack([m3.token])
    order = []
    while batch := claim(store):
        order += bodies(batch)
        store.ack([c.token for c in batch])
    assert order == [4, 103]


def test_declaring_without_a_mode_keeps_the_recorded_one(store: Store, peek: Peek) -> None:
    store.declare_queue(Q, ordering="relaxed")
    store.declare_queue(Q)  # a publisher configured with nothing
    assert peek("SELECT ordering FROM {schema}.queue WHERE name = %s", Q) == [("relaxed",)]
    with pytest.raises(psycopg.errors.CheckViolation):
        store.declare_queue(Q, ordering="sloppy")


def test_dead_lettering_expiry_and_purge_release_the_key(store: Store, peek: Peek) -> None:
    for n in range(4):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    assert store.dead_letter(m0.token, "poison") is not None
    [m1] = claim(store)
    assert bodies([m1]) == [1]
    # m2 parked behind m1; m1 expires (its TTL) while in flight and its lease lapses.
    assert claim(store) == []
    peek("UPDATE {schema}.message SET expires_at = now() - interval '1 s' WHERE id = %s", m1.id)
    peek.expire_leases()
    store.maintain([Q])
    assert bodies(claim(store)) == [2]
    assert store.purge(Q) == 1  # m3, parked: waiting, so purged
    assert peek("SELECT count(*) FROM {schema}.message WHERE visible_at = 'infinity'") == [(0,)]


def test_purge_takes_a_message_delivered_before_and_parked_until_a_time(
    store: Store, peek: Peek
) -> None:
    """A message delivered once, handed back, then parked by a gate until a time (not
    'infinity') is waiting, not in flight: purge takes it, and no claim delivers it later."""
    store.publisher.publish(Q, message(0, followable=True))
    [p] = claim(store)
    store.ack([p.token])  # the predecessor's end is recorded
    store.publisher.publish(Q, message(1, follows="task-0", wait=3600))
    [f] = claim(store)
    assert bodies([f]) == [1] and f.read_ct == 1
    store.release([f.token])  # handed back unstarted (a worker stopping)
    store.follows_retention = 0.0
    store.maintain([Q])  # the recorded end is forgotten past follows_retention
    assert peek("SELECT count(*) FROM {schema}.follow_done") == [(0,)]
    assert claim(store) == []  # parked until its wait ends: a finite time
    [(read_ct, parked, due)] = peek(
        "SELECT read_ct, visible_at > now() AND visible_at < 'infinity', due_at IS NOT NULL"
        " FROM {schema}.message"
    )
    assert (read_ct, parked, due) == (1, True, True)
    assert store.purge(Q) == 1
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_an_expired_message_is_not_handed_over_by_its_predecessors_ack(
    store: Store, peek: Peek
) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    store.publisher.publish(Q, message(1, key="k"), ttl=3600)
    store.publisher.publish(Q, message(2, key="k"))
    [m0] = claim(store)
    assert claim(store) == []  # m1 and m2 parked behind m0
    # m1's TTL runs out while it is parked (before housekeeping has looked).
    peek(
        "UPDATE {schema}.message SET expires_at = now() - interval '1 s'"
        " WHERE payload->>'body' = '1'"
    )
    assert store.claim([Q], [30.0], 10, acks=[m0.token]) == []  # not delivered expired
    store.maintain([Q])  # expires it, and its removal releases the key
    assert bodies(claim(store)) == [2]


def test_housekeeping_expires_a_parked_message_delivered_before(store: Store, peek: Peek) -> None:
    store.declare_queue(Q, ordering="relaxed")
    store.publisher.publish(Q, message(0, key="k"), ttl=3600)
    store.publisher.publish(Q, message(1, key="k"))
    [m0] = claim(store)
    store.release([m0.token], failed=True)  # rejected: to the back of its key
    [m1] = claim(store)
    assert bodies([m1]) == [1]
    assert claim(store) == []  # m0, delivered once, parked behind m1
    peek("UPDATE {schema}.message SET expires_at = now() - interval '1 s' WHERE id = %s", m0.id)
    assert store.maintain([Q]) == (0, 1)  # (no queue deleted, one message expired)
    assert peek("SELECT count(*) FROM {schema}.message WHERE id = %s", m0.id) == [(0,)]
    store.ack([m1.token])
    assert claim(store) == []


def test_max_attempts_dead_letters_in_the_claim_and_releases_the_key(
    store: Store, peek: Peek
) -> None:
    for n in range(2):
        store.publisher.publish(Q, message(n, key="k"))
    store.claim([Q], [30.0], 10, [1])
    peek.expire_leases()
    [doomed] = store.claim([Q], [30.0], 10, [1])
    assert doomed.dead_letter_id is not None
    assert bodies(claim(store)) == [1]


def test_requeued_dead_letter_goes_to_the_back_of_its_key(store: Store, peek: Peek) -> None:
    from pg_transport.ops.dead import DeadLetters

    for n in range(2):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    dead = store.dead_letter(m0.token, "poison")
    assert dead is not None
    [m1] = claim(store)
    DeadLetters(store).requeue(ids=[dead])
    assert claim(store) == []  # behind m1, which is still in flight
    store.ack([m1.token])
    assert bodies(claim(store)) == [0]


# -- races -------------------------------------------------------------------------------


def test_two_claimers_of_one_key_never_both_get_one(
    store: Store, session: psycopg.Connection[Any], pg_url: str, schema: str
) -> None:
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    # A claims inside a transaction held open: its head is locked, not yet claimed.
    with session.transaction():
        held = raw_claim(store, session)
        assert [r[5]["body"] for r in held if r[8] is None] == ["0"]
        # B claims meanwhile: it must not take the next one of the key.
        other = Store(Connector(pg_url), schema)
        try:
            assert claim(other) == []
        finally:
            other.connector.close()
    assert claim(store) == []  # after A's commit, still one at a time


def test_many_claimers_of_few_keys_never_overlap(pg_url: str, schema: str, store: Store) -> None:
    keys, per_key, workers = 4, 30, 6
    for n in range(per_key):
        for k in range(keys):
            store.publisher.publish(Q, message(n * keys + k, key=f"k{k}"))
    start = threading.Barrier(workers)
    lock = threading.Lock()
    in_flight: dict[str, int] = {}
    seen: dict[str, list[int]] = {f"k{k}": [] for k in range(keys)}
    overlaps: list[str] = []

    def consume() -> None:
        own = Store(Connector(pg_url), schema)
        start.wait()
        idle = 0
        while idle < 50:
            batch = own.claim([Q], [30.0], 2)
            if not batch:
                idle += 1
                continue
            idle = 0
            with lock:
                for c in batch:
                    key = c.payload["headers"]["pgq-ordering-key"]
                    if in_flight.get(key):
                        overlaps.append(key)
                    in_flight[key] = in_flight.get(key, 0) + 1
                    seen[key].append(int(c.payload["body"]))
            with lock:
                for c in batch:
                    in_flight[c.payload["headers"]["pgq-ordering-key"]] -= 1
            own.ack([c.token for c in batch])
        own.connector.close()

    threads = [threading.Thread(target=consume) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not overlaps
    for k in range(keys):
        assert seen[f"k{k}"] == [n * keys + k for n in range(per_key)]


def test_an_ack_waits_for_a_park_behind_it_and_then_promotes(
    store: Store, session: psycopg.Connection[Any], peek: Peek
) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    [m0] = claim(store)
    store.publisher.publish(Q, message(1, key="k"))  # ready: nothing parked it yet
    done = threading.Event()
    failures: list[BaseException] = []
    with session.transaction():
        rows = raw_claim(store, session)
        # Parked, under a lock on m0; the answer's last row: the claim met a keyed message.
        assert [r[8] for r in rows] == ["held", "featured"]
        with store.connector.connection() as acker:
            acker_pid = int(acker.info.backend_pid)

        def ack() -> None:
            try:
                store.ack([m0.token])
            except BaseException as exc:
                failures.append(exc)
            done.set()

        thread = threading.Thread(target=ack)
        thread.start()
        peek.wait_for_lock(acker_pid, "the ack did not wait for the park's lock")
        assert not done.is_set()
    thread.join(10)
    assert done.is_set() and not failures
    # The ack's trigger saw the committed park and promoted m1: no wedge.
    assert bodies(claim(store)) == [1]


def test_a_claim_meeting_an_ack_in_progress_neither_parks_nor_delivers(
    store: Store, session: psycopg.Connection[Any], peek: Peek
) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    [m0] = claim(store)
    store.publisher.publish(Q, message(1, key="k"))
    with session.transaction():
        session.execute(
            store.q["ack"], {"ids": [m0.id], "leases": [m0.lease], "queues": [Q]}
        )  # m0 deleted, not committed: its row is locked
        assert claim(store) == []  # m1 is behind m0 still: held, not parked
        assert peek(
            "SELECT visible_at < 'infinity' FROM {schema}.message WHERE payload->>'body' = '1'"
        ) == [(True,)]
    assert bodies(claim(store)) == [1]


def test_a_publish_committing_after_the_ack_is_delivered(
    store: Store, session: psycopg.Connection[Any]
) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    [m0] = claim(store)
    with session.transaction():
        params = store.publisher._publish_params(Q, message(1, key="k"), 0, 0.0, None, None)
        session.execute(store.q["enqueue"], params)
        store.ack([m0.token])  # the ack's trigger cannot see the uncommitted message
    assert bodies(claim(store)) == [1]


# -- follows -------------------------------------------------------------------------------


def test_a_follower_published_first_waits_for_its_predecessor(store: Store, peek: Peek) -> None:
    store.publisher.publish(Q, message(1, follows="task-0", wait=300))
    assert claim(store) == []  # parked until its wait ends, or its predecessor does
    store.publisher.publish(Q, message(0, key="p"))
    [p] = claim(store)
    assert bodies([p]) == [0]
    store.ack([p.token])
    [f] = claim(store)  # woken by the predecessor's end, long before its wait
    assert bodies([f]) == [1] and f.note is None
    assert peek("SELECT task_id FROM {schema}.follow_done") == [("task-0",)]


def test_a_follower_of_a_finished_followable_task_runs_at_once(store: Store) -> None:
    store.publisher.publish(Q, message(0, followable=True))
    [p] = claim(store)
    store.ack([p.token])
    store.publisher.publish(Q, message(1, follows="task-0", wait=300))
    [f] = claim(store)
    assert bodies([f]) == [1] and f.note is None


def test_a_follower_whose_predecessor_never_comes_runs_after_its_wait(
    store: Store, peek: Peek
) -> None:
    store.publisher.publish(Q, message(1, follows="never", wait=300))
    assert claim(store) == []
    peek("UPDATE {schema}.message SET visible_at = now(), follow_until = now()")  # time passes
    [f] = claim(store)
    assert bodies([f]) == [1] and f.note == FOLLOWS_MISSING


def test_a_cycle_of_followers_cannot_wedge_the_queue(store: Store, peek: Peek) -> None:
    store.publisher.publish(Q, message(0, follows="task-1", wait=300))
    store.publisher.publish(Q, message(1, follows="task-0", wait=300))
    assert claim(store) == []
    peek("UPDATE {schema}.message SET visible_at = now(), follow_until = now()")
    got = claim(store)
    assert sorted(bodies(got)) == [0, 1]
    assert {c.note for c in got} == {FOLLOWS_MISSING}


def test_a_follower_delivered_past_its_wait_is_told_and_signalled(
    broker_url: str, schema: str, peek: Peek
) -> None:
    from kombu import Connection, Consumer, Producer, Queue

    from pg_transport.signals import follows_missing

    heard: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        heard.append({"sender": sender, **kwargs})

    follows_missing.connect(receiver)
    try:
        with Connection(
            broker_url, transport_options={"schema": schema, "follows_timeout": 0}
        ) as conn:
            queue = Queue(Q)
            Producer(conn.channel()).publish(
                {"n": 1},
                routing_key=Q,
                declare=[queue],
                follows="gone",
                headers={"task": "t", "id": "follower-1"},
            )
            got: list[Any] = []
            with Consumer(conn, [queue], callbacks=[lambda body, m: got.append(m)]):
                conn.drain_events(timeout=10)
            [delivered] = got
            delivered.ack()
    finally:
        follows_missing.disconnect(receiver)
    assert delivered.headers["pgq-follows-missing"] == "gone"
    assert delivered.headers["pgq-follows"] == "gone"  # the option became the header
    [signal] = heard
    assert signal["sender"] == "t" and signal["follows"] == "gone" and signal["queue"] == Q


def test_bad_ordering_headers_are_refused_naming_the_header(store: Store, peek: Peek) -> None:
    from pg_transport.message.ordering import OrderingError

    bad = [
        ({"pgq-ordering-key": ""}, "pgq-ordering-key"),
        ({"pgq-ordering-key": "x" * 2000}, "pgq-ordering-key"),
        ({"pgq-ordering-key": ["a"]}, "pgq-ordering-key"),
        ({"pgq-follows": "a", "pgq-follows-timeout": -1}, "pgq-follows-timeout"),
        ({"pgq-follows": "a", "pgq-follows-timeout": "soon"}, "pgq-follows-timeout"),
        ({"pgq-followable": "perhaps"}, "pgq-followable"),
        ({"pgq-ordering-key": uuid.uuid4()}, "pgq-ordering-key"),  # (not JSON either)
    ]
    for headers, named in bad:
        with pytest.raises(OrderingError, match=named):
            store.publisher.publish(Q, {"body": "x", "headers": {"id": "i", **headers}})
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]


# -- the ack's claim takes the key's next message --------------------------------------------


def test_a_claim_carrying_the_ack_takes_the_keys_next_message(store: Store, peek: Peek) -> None:
    for n in range(3):
        store.publisher.publish(Q, message(n, key="k"))
    [m0] = claim(store)
    assert claim(store) == []  # m1 and m2 parked now
    [m1] = store.claim([Q], [30.0], 10, acks=[m0.token])  # one statement: ack + next
    assert bodies([m1]) == [1] and m1.read_ct == 1
    assert peek("SELECT count(*) FROM {schema}.message WHERE due_at IS NOT NULL") == [(1,)]
    [m2] = store.claim([Q], [30.0], 1, acks=[m1.token])
    assert bodies([m2]) == [2]


def test_the_next_message_is_not_handed_over_before_it_is_due(store: Store, peek: Peek) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    store.publisher.publish(Q, message(1, key="k"), delay=60)  # a countdown
    store.publisher.publish(Q, message(9))
    [m0, other] = claim(store)
    assert bodies([m0, other]) == [0, 9]
    # m1 falls due, and a claim parks it behind m0 (keeping when it was due) ...
    peek("UPDATE {schema}.message SET visible_at = now() WHERE okey = 'k' AND read_ct = 0")
    assert claim(store) == []
    # ... as if it were due in a minute (a retry's countdown, parked behind its key).
    peek("UPDATE {schema}.message SET due_at = now() + interval '60 s' WHERE due_at IS NOT NULL")
    assert store.claim([Q], [30.0], 10, acks=[m0.token]) == []  # not before it is due
    assert peek(
        "SELECT visible_at > now() + interval '50 s' FROM {schema}.message WHERE okey = 'k'"
    ) == [(True,)]  # promoted by the trigger to its due time, not to now


def test_the_handed_message_counts_against_the_limit(store: Store) -> None:
    store.publisher.publish(Q, message(0, key="k"))
    store.publisher.publish(Q, message(1, key="k"))
    [m0] = claim(store, limit=1)
    assert claim(store, limit=1) == []  # parks m1
    store.publisher.publish(Q, message(9))
    got = store.claim([Q], [30.0], 1, acks=[m0.token])
    assert bodies(got) == [1]  # published before 9: first, and alone
    assert bodies(claim(store)) == [9]


def test_a_follower_delivered_past_its_wait_is_not_woken_again_by_its_predecessor(
    store: Store, peek: Peek
) -> None:
    store.publisher.publish(Q, message(0, key="p"))
    [p] = claim(store)  # the predecessor runs long
    store.publisher.publish(Q, message(1, follows="task-0", wait=300))
    assert claim(store) == []  # parked until its wait ends
    peek(
        "UPDATE {schema}.message SET visible_at = now(), follow_until = now() WHERE id <> %s", p.id
    )
    [f] = claim(store)
    assert f.note == FOLLOWS_MISSING
    store.ack([p.token])  # the predecessor ends while the follower is in flight
    assert claim(store) == []  # the follower's end is its own: it is not made visible again


def test_a_consumer_acking_a_key_gets_its_next_message_on_the_ack_claim(
    broker_url: str, schema: str
) -> None:
    from kombu import Connection, Consumer, Producer, Queue

    total = 20
    with Connection(broker_url, transport_options={"schema": schema}) as conn:
        queue = Queue(Q)
        producer = Producer(conn.channel())
        for n in range(total):
            producer.publish({"n": n}, routing_key=Q, declare=[queue], ordering_key="k")
        got: list[int] = []

        def on_message(body: Any, msg: Any) -> None:
            got.append(body["n"])
            msg.ack()  # inside drain_events: it rides on the engine's next statement

        with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=1):
            conn.drain_events(timeout=10)
            before = dataclasses.replace(conn.transport.engine.statements)
            while len(got) < total:
                conn.drain_events(timeout=10)
        after = conn.transport.engine.statements
    assert got == list(range(total))
    # Each message after the first came with the claim that carried its predecessor's
    # ack: no ack sent alone, no wake-up round trip in between.
    assert after.acks_alone == before.acks_alone
    assert after.claim - before.claim <= total


def test_a_stale_ack_riding_on_a_claim_does_not_release_the_key(store: Store, peek: Peek) -> None:
    for n in range(2):
        store.publisher.publish(Q, message(n, key="k"))
    [stale] = claim(store, limit=1)
    peek.expire_leases()
    [again] = claim(store, limit=1)  # redelivered: the first holder's lease is void
    assert again.id == stale.id
    peek("UPDATE {schema}.message SET visible_at = now() WHERE visible_at = 'infinity'")
    # m1 is ready, m0 is held anew: the stale ack deletes nothing, so m1 must wait.
    assert store.claim([Q], [30.0], 10, acks=[stale.token]) == []
    assert bodies(store.claim([Q], [30.0], 10, acks=[again.token])) == [1]
