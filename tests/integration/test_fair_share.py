"""Fair share (docs/flow-control.md): a fair queue is claimed round-robin over its
messages' fair keys, so one key's backlog delays another key's lone message by at most
the claims that serve the keys before it, not by the backlog."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from pg_transport.db.pool import Connector
from pg_transport.fanin.backend import forget
from pg_transport.store import Store
from tests.integration.conftest import Peek, PublishingStore


def message(key: str | None, n: int = 0) -> dict[str, Any]:
    headers: dict[str, Any] = {} if key is None else {"pgq-fair-key": key}
    return {"body": f"{key}-{n}", "properties": {"delivery_info": {}}, "headers": headers}


def claim_keys(store: Store, limit: int, queue: str = "f") -> list[str]:
    """The fair keys of the messages one claim delivers, in claim order; acked."""
    claimed = store.claim([queue], [30.0], limit, fair=True)
    store.ack([c.token for c in claimed])
    return [str(c.payload["body"]).rsplit("-", 1)[0] for c in claimed if c.payload]


@pytest.fixture
def fair(store: PublishingStore) -> PublishingStore:
    store.declare_queue("f", fair=True)
    return store


def test_a_lone_key_behind_a_backlog_is_served_within_a_claim_per_key(
    fair: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """100,000 messages of key A, then one of key B: with two keys, B is delivered by
    the second claim of one message (ceil(K / limit) claims), and by the first claim of
    two; the same backlog in a queue that is not fair delivers B after all of A's."""
    for queue in ("f", "plain"):
        peek(
            "INSERT INTO {schema}.message (queue, payload, fkey)"
            " SELECT %s, json_build_object('body', 'A-' || i, 'headers', '{{}}'::json),"
            "        CASE WHEN %s = 'f' THEN 'A' END"
            " FROM generate_series(1, 100000) AS i",
            queue,
            queue,
        )
        fair.publisher.publish(queue, message("B"))
    assert claim_keys(fair, 1) + claim_keys(fair, 1) == ["A", "B"]
    fair.publisher.publish("f", message("B", 2))
    assert sorted(claim_keys(fair, 2)) == ["A", "B"]
    # Not fair: B waits behind the 100,000 (a claim of 1,000 brings A's only), and so
    # does a fair queue claimed by the plain statement (a consumer not configured fair).
    assert set(claim_keys(fair, 1000, "plain")) == {"A"}
    fair.publisher.publish("f", message("B", 3))
    plain = fair.claim(["f"], [30.0], 1000)
    assert {str(c.payload["body"])[0] for c in plain if c.payload} == {"A"}


def test_keys_are_served_round_robin(fair: PublishingStore) -> None:
    for n in range(3):
        for key in ("c", "a", "b"):
            fair.publisher.publish("f", message(key, n))
    assert [k for _ in range(9) for k in claim_keys(fair, 1)] == ["a", "b", "c"] * 3


def test_a_claim_of_more_than_the_keys_takes_a_share_of_each_oldest_first(
    fair: PublishingStore,
) -> None:
    for n in range(10):
        for key in ("x", "y"):
            fair.publisher.publish("f", message(key, n))
    claimed = fair.claim(["f"], [30.0], 6, fair=True)
    bodies = [c.payload["body"] for c in claimed if c.payload]
    assert sorted(bodies) == ["x-0", "x-1", "x-2", "y-0", "y-1", "y-2"]


def test_messages_without_a_key_or_from_before_the_mode_are_served(
    store: PublishingStore, peek: Peek
) -> None:
    """A message without a fair key is key ''; messages already queued when the queue
    is declared fair join that key, and are claimed."""
    store.publisher.publish("f", message(None, 1))
    store.declare_queue("f", fair=True)
    store.publisher.publish("f", message(None, 2))
    store.publisher.publish("f", message("k", 1))
    assert peek("SELECT fkey FROM {schema}.message ORDER BY id") == [("",), ("",), ("k",)]
    assert [k for _ in range(3) for k in claim_keys(store, 1)] == ["None", "k", "None"]
    # Declared again without the option: the mode stays (only a configured declarer
    # changes it).
    store.declare_queue("f")
    assert peek("SELECT fair FROM {schema}.queue WHERE name = 'f'") == [(True,)]


def test_a_claim_never_waits_for_the_cursor_and_two_claims_share_no_row(
    fair: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """With the queue's cursor row locked by another transaction, a claim still answers
    (its cursor move is skipped); two claims started together (a barrier) deliver
    disjoint rows."""
    for n in range(20):
        for key in ("a", "b", "c", "d"):
            fair.publisher.publish("f", message(key, n))
    claim_keys(fair, 1)  # the cursor row exists from here on
    with psycopg.connect(pg_url) as locker:
        locker.execute(
            sql.SQL("SELECT * FROM {}.fair_cursor FOR UPDATE").format(sql.Identifier(schema))
        )
        assert len(fair.claim(["f"], [30.0], 2, fair=True)) == 2
        locker.rollback()
    start = threading.Barrier(2)
    got: list[list[int]] = [[], []]

    def claim(i: int) -> None:
        connector = Connector(pg_url)
        try:
            store = Store(connector, schema)
            start.wait()
            got[i] = [c.id for c in store.claim(["f"], [30.0], 8, fair=True)]
        finally:
            connector.close()

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got[0]) == len(got[1]) == 8
    assert not set(got[0]) & set(got[1])


# -- Celery --------------------------------------------------------------------------------


@pytest.fixture
def celery_app(broker_url: str, schema: str, store: PublishingStore) -> Iterator[Celery]:
    app = Celery("fair-client", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema, "queue_fair_share": ["tenants"]}
    app.conf.task_default_queue = "tenants"
    yield app
    forget(app)
    app.close()


def test_celery_fair_key_default_and_option(celery_app: Celery, peek: Peek) -> None:
    @celery_app.task(name="t.report", fair_key="tenant")
    def report(tenant: str, n: int) -> None: ...

    report.delay("acme", 1)
    report.apply_async(("acme", 2), fair_key="override")
    report.delay(tenant="globex", n=3)
    assert peek("SELECT fkey FROM {schema}.message ORDER BY id") == [
        ("acme",),
        ("override",),
        ("globex",),
    ]
    assert peek("SELECT fair FROM {schema}.queue WHERE name = 'tenants'") == [(True,)]
