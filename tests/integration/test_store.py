"""The delivery model on a real Postgres: claim, fencing, priority, concurrency."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from pg_transport.db.pool import Connector
from pg_transport.store import Lease, Store
from tests.integration.conftest import Peek


def body(n: int) -> dict[str, Any]:
    return {"body": f"m{n}", "properties": {"delivery_info": {}}, "headers": {}}


def claim_all(store: Store, queue: str, vt: float = 30.0, limit: int = 100) -> list[Any]:
    return store.claim([queue], [vt], limit)


def test_claim_marks_rows_invisible_and_counts_deliveries(store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1))
    [claimed] = claim_all(store, "q")
    assert claimed.read_ct == 1 and claimed.payload["body"] == "m1"
    assert claim_all(store, "q") == []  # invisible while leased
    ((in_future,),) = peek("SELECT visible_at > now() + interval '25 s' FROM {schema}.message")
    assert in_future


def test_expired_lease_is_redelivered_without_a_reaper(store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1))
    [first] = claim_all(store, "q")
    peek.expire_leases()
    [second] = claim_all(store, "q")
    assert (second.id, second.read_ct) == (first.id, 2)


def test_ack_is_fenced_by_the_lease(store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1))
    [first] = claim_all(store, "q")
    peek.expire_leases()
    [second] = claim_all(store, "q")
    # The first consumer's lease expired and the message went elsewhere: its late
    # ack and its late requeue must not touch the new delivery.
    assert store.ack([first.token]) == 0
    assert store.release([first.token]) == 0
    assert claim_all(store, "q") == []
    assert store.ack([second.token]) == 1
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_release_makes_visible_now(store: Store) -> None:
    store.publisher.publish("q", body(1))
    [first] = claim_all(store, "q")
    assert store.release([first.token]) == 1
    [again] = claim_all(store, "q")
    assert (again.id, again.read_ct) == (first.id, 2)


def test_a_release_ends_the_holder_s_lease(store: Store, peek: Peek) -> None:
    """Between a release and the next claim the message waits, visible: its releaser (or
    any earlier holder) can no more hide it by renewing, nor delete it unrun by acking."""
    store.publisher.publish("q", body(1))
    [held] = claim_all(store, "q")
    assert store.release([held.token]) == 1
    assert store.renew([(held.token, 600)]) == 0
    assert store.ack([held.token]) == 0
    assert store.release([held.token]) == 0
    assert store.dead_letter(held.token, "late") is None
    assert peek("SELECT visible_at <= now(), read_ct FROM {schema}.message") == [(True, 1)]
    [again] = claim_all(store, "q")
    assert (again.id, again.read_ct, again.lease) == (held.id, 2, held.lease + 2)


def test_a_token_of_another_queue_touches_nothing(store: Store, peek: Peek) -> None:
    """The fence matches the queue too: an id and lease that happen to match a message of
    another queue (ids are guessable) do not reach it."""
    store.publisher.publish("q", body(1))
    [held] = claim_all(store, "q")
    elsewhere = Lease(held.id, held.lease, "other")
    assert store.ack([elsewhere]) == 0
    assert store.release([elsewhere]) == 0
    assert store.renew([(elsewhere, 600)]) == 0
    assert store.dead_letter(elsewhere, "forged") is None
    assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]
    assert store.ack([held.token]) == 1


def test_renew_extends_only_current_lease(store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1))
    [c] = claim_all(store, "q", vt=1)
    assert store.renew([(Lease(c.id, c.lease + 1, c.queue), 600)]) == 0
    assert store.renew([(c.token, 600)]) == 1
    ((later,),) = peek("SELECT visible_at > now() + interval '500 s' FROM {schema}.message")
    assert later


def test_priority_then_fifo(store: Store) -> None:
    for n, prio in enumerate([0, 5, 255, 5, 0, 9]):
        store.publisher.publish("q", body(n), priority=prio)
    order = [c.payload["body"] for c in claim_all(store, "q")]
    assert order == ["m2", "m5", "m1", "m3", "m0", "m4"]


def test_batch_limit_and_several_queues(store: Store) -> None:
    for n in range(5):
        store.publisher.publish("a", body(n))
        store.publisher.publish("b", body(10 + n))
    store.publisher.publish("c", body(99))
    got = store.claim(["a", "b"], [30.0, 60.0], 7)
    assert len(got) == 7
    assert {c.queue for c in got} == {"a", "b"}
    assert [c.id for c in got] == sorted(c.id for c in got)
    rest = store.claim(["a", "b"], [30.0, 60.0], 100)
    assert len(rest) == 3
    assert store.size("c") == 1


def test_per_queue_visibility_timeout(store: Store, peek: Peek) -> None:
    store.publisher.publish("short", body(1))
    store.publisher.publish("long", body(2))
    store.claim(["short", "long"], [5.0, 500.0], 10)
    rows = peek(
        "SELECT queue, visible_at - now() > interval '100 s' FROM {schema}.message ORDER BY queue"
    )
    assert rows == [("long", True), ("short", False)]


def test_publish_key_makes_a_repeated_publish_a_no_op(store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1), publish_key="k1")
    store.publisher.publish("q", body(1), publish_key="k1")
    store.publisher.publish("q", body(2), publish_key="k2")
    assert peek("SELECT count(*) FROM {schema}.message") == [(2,)]


def test_size_counts_ready_purge_spares_in_flight(store: Store) -> None:
    for n in range(4):
        store.publisher.publish("q", body(n))
    store.publisher.publish("q", body(9), delay=3600)
    claim_all(store, "q", limit=1)
    assert store.size("q") == 3
    assert store.purge("q") == 4  # 3 ready + 1 delayed; the claimed one is running
    assert store.size("q") == 0


def test_declare_has_delete_queue(store: Store) -> None:
    assert not store.has_queue("q")
    store.declare_queue("q")
    store.declare_queue("q")
    assert store.has_queue("q")
    store.publisher.publish("q", body(1))
    store.delete_queue("q")
    assert not store.has_queue("q")
    assert store.size("q") == 0


def test_reject_without_requeue_dead_letters(store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1))
    [c] = claim_all(store, "q")
    dead_id = store.dead_letter(c.token, "rejected")
    assert dead_id is not None
    assert store.dead_letter(c.token, "again") is None
    store.identify_dead_letter(
        dead_id, task_id="t1", task_name="x.y", identity={"execution_id": 7}, reasons=["why"]
    )
    rows = peek(
        "SELECT message_id, queue, reason, task_id, task_name, identity FROM {schema}.dead_letter"
    )
    assert rows == [(c.id, "q", "rejected; why", "t1", "x.y", {"execution_id": 7})]
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_claim_past_max_attempts_dead_letters_in_the_same_statement(
    store: Store, peek: Peek
) -> None:
    store.publisher.publish("q", body(1))
    for attempt in (1, 2, 3):
        [c] = store.claim(["q"], [30.0], 10, [3])
        assert (c.read_ct, c.dead_letter_id) == (attempt, None)
        peek.expire_leases()
    [poisoned] = store.claim(["q"], [30.0], 10, [3])
    assert poisoned.dead_letter_id is not None and poisoned.read_ct == 3
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]
    assert peek("SELECT id, read_ct, reason FROM {schema}.dead_letter") == [
        (poisoned.dead_letter_id, 3, "delivered 3 times; max_attempts is 3")
    ]
    assert store.claim(["q"], [30.0], 10, [3]) == []


@pytest.mark.sessions(17)  # side by side, the run's meter: 15
def test_concurrent_claimers_never_share_a_message(pg_url: str, schema: str, store: Store) -> None:
    total, workers = 600, 6
    for n in range(total):
        store.publisher.publish("q", body(n))
    start = threading.Barrier(workers)
    seen: list[list[int]] = [[] for _ in range(workers)]

    def consume(slot: int) -> None:
        own = Store(Connector(pg_url), schema)
        start.wait()
        while batch := own.claim(["q"], [30.0], 7):
            seen[slot].extend(c.id for c in batch)
            own.ack([c.token for c in batch])
        own.connector.close()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ids = [i for s in seen for i in s]
    assert len(ids) == total and len(set(ids)) == total
    assert sum(1 for s in seen if s) > 1  # they really ran side by side


def test_ack_survives_a_terminated_backend(pg_url: str, store: Store, peek: Peek) -> None:
    store.publisher.publish("q", body(1))
    [c] = claim_all(store, "q")
    with store.connector.connection() as conn:
        pid = conn.info.backend_pid
    with psycopg.connect(pg_url, autocommit=True) as admin:
        # With a timeout, pg_terminate_backend returns once the backend is gone.
        admin.execute("SELECT pg_terminate_backend(%s, 10000)", [pid])
    # The pooled connection is dead now; the ack is retried once on a fresh one.
    assert store.ack([c.token]) == 1
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]
    with store.connector.connection() as conn:
        assert conn.info.backend_pid != pid
