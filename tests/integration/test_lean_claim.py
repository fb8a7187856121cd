"""The lean claim: a plain queue's claim carries no gate, and never delivers what one judges.

``lean_claim`` is sent while the last answer did not say the claim met a featured message
(an ordering key, a follows link); it delivers plain candidates only, holds any other
(unparked) and ends its answer with the row ``featured``, and the caller sends ``claim``
next (docs/design/claim.md, "The lean claim"). Real sessions: a keyed publish racing lean
claims runs on its own threads and connections, started together by a barrier.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
from kombu import Connection, Producer

from pg_transport.db.wire import Statement
from pg_transport.message.rows import Lease
from pg_transport.store import Claimed, Store, claim_params
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_flow_limits import TASK
from tests.integration.test_flow_switch import Q as FQ
from tests.integration.test_flow_switch import Worker
from tests.integration.test_ordering import message

Q = "lean"


def sent_by(store: Store) -> list[str]:
    """Record the name of every claim statement ``store`` sends from now on."""
    sent: list[str] = []
    for statement in (store.lean_claim_statement, store.claim_statement):
        statement.execute = _spy(statement, sent)  # type: ignore[method-assign]
    return sent


def _spy(statement: Statement, sent: list[str]) -> Any:
    original = statement.execute

    def spy(conn: Any, params: Any, *, prepare: bool) -> Any:
        sent.append(statement.name)
        return original(conn, params, prepare=prepare)

    return spy


def bodies(batch: list[Claimed]) -> list[int]:
    return [int(c.payload["body"]) for c in batch if not c.held and c.payload is not None]


def test_a_plain_queue_is_claimed_by_the_lean_claim_alone(store: PublishingStore) -> None:
    for n in range(5):
        store.publisher.publish(Q, message(n))
    sent = sent_by(store)
    assert bodies(store.claim([Q], [30.0], 3)) == [0, 1, 2]
    batch = store.claim([Q], [30.0], 3)
    assert bodies(batch) == [3, 4] and store.featured is False
    store.ack([c.token for c in batch])
    assert sent == ["lean_claim", "lean_claim"]


def test_the_lean_claim_holds_a_keyed_message_unparked_and_claim_delivers_it(
    store: PublishingStore, peek: Peek, pg_url: str
) -> None:
    """The lean claim meets a keyed and a following message: it holds all it picked as
    they are (no park, no lease) and says featured; claim then judges them (the plain and
    the keyed one delivered, the follower parked), and the store goes back to the lean
    claim once an answer meets none."""
    store.publisher.publish(Q, message(0))
    store.publisher.publish(Q, message(1, key="k"))
    store.publisher.publish(Q, message(2, follows="task-none", wait=3600))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            store.q["lean_claim"], claim_params([Q], [30.0], 10, None, [])
        ).fetchall()
    assert [(r[5], r[8]) for r in rows] == [(None, "held")] * 3 + [(None, "featured")]
    untouched = peek(
        "SELECT payload->>'body', read_ct, visible_at <= now(), due_at IS NULL"
        " FROM {schema}.message ORDER BY id"
    )
    assert untouched == [("0", 0, True, True), ("1", 0, True, True), ("2", 0, True, True)]
    sent = sent_by(store)
    batch = store.claim([Q], [30.0], 10)
    # lean_claim held all three (featured); claim delivered 0 and 1 and parked the
    # follower (featured); claim again, behind the held row, found nothing (an empty
    # answer leaves the store on claim).
    assert bodies(batch) == [0, 1] and sent == ["lean_claim", "claim", "claim"]
    assert store.featured is True
    store.ack([c.token for c in batch])
    store.publisher.publish(Q, message(3))
    assert bodies(store.claim([Q], [30.0], 10)) == [3] and store.featured is False
    store.publisher.publish(Q, message(4))
    assert bodies(store.claim([Q], [30.0], 10)) == [4]
    assert sent[3:] == ["claim", "lean_claim"]


def test_the_lean_claim_delivers_nothing_of_a_pick_with_a_keyed_message(
    store: PublishingStore, pg_url: str
) -> None:
    """Claim order is kept: a pick holding a keyed message is held whole (the plain one
    of a higher priority, the plain one before and the one after it), and claim delivers
    all of it in claim order."""
    store.publisher.publish(Q, message(0))
    store.publisher.publish(Q, message(1, key="k"))
    store.publisher.publish(Q, message(2))
    store.publisher.publish(Q, message(3), priority=5)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            store.q["lean_claim"], claim_params([Q], [30.0], 10, None, [])
        ).fetchall()
    assert [(r[5], r[8]) for r in rows] == [(None, "held")] * 4 + [(None, "featured")]
    assert bodies(store.claim([Q], [30.0], 10)) == [3, 0, 1, 2]


def test_an_ack_of_a_keyed_message_hands_on_from_claim_not_from_the_lean_claim(
    store: PublishingStore, peek: Peek, pg_url: str
) -> None:
    """The lean claim lands an ack of a keyed message; the key's next is promoted by the
    trigger (visible again, never delivered by the lean claim itself) and the answer says
    featured."""
    store.publisher.publish(Q, message(0, key="k"))
    store.publisher.publish(Q, message(1, key="k"))
    (first,) = [c for c in store.claim([Q], [30.0], 10) if not c.held]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            store.q["lean_claim"], claim_params([Q], [30.0], 10, None, [first.token])
        ).fetchall()
    assert [r[8] for r in rows][-1] == "featured"
    assert all(r[8] in ("held", "featured") for r in rows)
    assert peek("SELECT payload->>'body', read_ct FROM {schema}.message") == [("1", 0)]


def test_keyed_publishes_racing_lean_claims_never_run_two_of_a_key_at_once(
    store: PublishingStore, pg_url: str, schema: str, peek: Peek
) -> None:
    """Publishers of keyed and plain messages and consumers claiming (lean or full, as
    their answers say) all start at one barrier, each on its own sessions. A consumer
    holds what it claimed until its next claim carries the acks; no key ever has two
    messages held at once, each key's messages arrive in publish order, and every
    message arrives exactly once."""
    keys, per_key, plain_count, consumers = 6, 12, 40, 3
    total = keys * per_key + plain_count
    start = threading.Barrier(2 + consumers)
    lock = threading.Lock()
    holding: dict[str, int] = {}
    seen: dict[str, list[int]] = defaultdict(list)
    plain_seen: list[int] = []
    overlaps: list[tuple[str, int, int]] = []
    statements: list[str] = []
    errors: list[BaseException] = []

    def publish_keyed() -> None:
        try:
            start.wait()
            for n in range(per_key):
                for k in range(keys):
                    store.publisher.publish(Q, message(1000 * (k + 1) + n, key=f"k{k}"))
        except BaseException as exc:
            errors.append(exc)

    def publish_plain() -> None:
        try:
            start.wait()
            for n in range(plain_count):
                store.publisher.publish(Q, message(n))
        except BaseException as exc:
            errors.append(exc)

    def consume() -> None:
        own = PublishingStore(store.connector, schema)
        sent = sent_by(own)
        acks: list[Lease] = []
        held: list[tuple[str, int]] = []
        try:
            start.wait()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                with lock:
                    if len(plain_seen) + sum(map(len, seen.values())) == total:
                        break
                with lock:  # what it held ends before the claim carrying its acks is sent
                    for key, _ in held:
                        del holding[key]
                held = []
                batch = own.claim([Q], [30.0], 4, acks=acks)
                acks = [c.token for c in batch]
                with lock:
                    for c in batch:
                        body = int(c.payload["body"])
                        if body < 1000:
                            plain_seen.append(body)
                            continue
                        key = f"k{body // 1000 - 1}"
                        if key in holding:
                            overlaps.append((key, holding[key], body))
                        holding[key] = body
                        held.append((key, body))
                        seen[key].append(body)
            own.ack(acks)
            with lock:
                for key, _ in held:
                    del holding[key]
                statements.extend(sent)
        except BaseException as exc:
            errors.append(exc)

    publishers = [threading.Thread(target=publish_keyed), threading.Thread(target=publish_plain)]
    workers = [threading.Thread(target=consume) for _ in range(consumers)]
    for t in publishers + workers:
        t.start()
    for t in publishers:
        t.join(120)
    for t in workers:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in publishers + workers)
    assert overlaps == []
    assert sorted(plain_seen) == list(range(plain_count))
    for k in range(keys):
        assert seen[f"k{k}"] == [1000 * (k + 1) + n for n in range(per_key)], k
    assert peek("SELECT count(*) FROM {schema}.message") == [(0,)]
    # Both statements ran: the race was between the lean claim and keyed publishes.
    assert "lean_claim" in statements and "claim" in statements


def test_a_worker_claims_a_keyed_message_its_lean_claim_held_at_once(
    broker_url: str, schema: str
) -> None:
    """A consumer that polls every 30 s (only notifications and its own answers move it):
    its lean claim meets a keyed message and holds it; the queue is not taken for empty,
    and claim delivers it well before the next poll."""
    options = {"schema": schema, "polling_interval": 30}
    with Connection(broker_url, transport_options=options) as conn:
        conn.connect()
        worker = Worker(conn)
        producer = Producer(conn)

        def publish(n: int, **headers: Any) -> None:
            producer.publish(
                {"n": n}, routing_key=FQ, headers={"id": f"t{n}", "task": TASK, **headers},
                serializer="json",
            )  # fmt: skip

        publish(0)
        worker.until(lambda: worker.got == [0], "the plain message")
        worker.spy()
        publish(1, **{"pgq-ordering-key": "k"})
        worker.until(lambda: worker.got == [0, 1], "the keyed message, before the poll")
        claims = [s for s in worker.sent if s.endswith("claim")]
        assert claims[:2] == ["lean_claim", "claim"], claims
        assert worker.engine.statements.lean >= 2
