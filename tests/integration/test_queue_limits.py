"""A queue's own limits (docs/flow-control.md): the transport option queue_rate_limits,
written at worker start as `pgq limit set queue:<name>` would write them, and a queue's
own concurrency (at most N of the queue in flight across the fleet), on real sessions.

Races are stepped as in test_flow_limits.py: one claim's transaction is held open (its
row locks held) while the other claims; every gate lock is SKIP LOCKED."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner

from pg_transport.errors import LimitError
from pg_transport.fanin.backend import forget
from pg_transport.kombu import hooks
from pg_transport.message.rows import Lease
from pg_transport.ops.cli import main
from pg_transport.ops.limits import Limits
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_flow_limits import Q, delivered, keyed, message, raw_claim
from tests.pg import to_broker_url


@pytest.fixture
def app(broker_url: str, schema: str, store: PublishingStore) -> Iterator[Celery]:
    made = Celery("queue-limits", broker=broker_url, set_as_current=False)
    made.conf.broker_transport_options = {
        "schema": schema,
        "queue_rate_limits": {Q: {"rate": "2/h", "burst": 2}, "other": "10/s"},
    }
    yield made
    forget(made)
    made.close()


def limits(peek: Peek) -> list[tuple[object, ...]]:
    """The queues' limits. (A worker's start writes its tasks' too: every shared task
    another test module of this process defined is one of this app's.)"""
    return peek(
        "SELECT name, rate_count, rate_period, burst, concurrency, origin"
        " FROM {schema}.flow_limit WHERE name LIKE 'queue:%%' ORDER BY name"
    )


def test_queue_rate_limits_are_written_at_worker_start_and_enforced(
    app: Celery, store: PublishingStore, peek: Peek
) -> None:
    """What a worker's start writes (the hook its worker_init runs): each queue's limit,
    origin config; the claim then starts at most its burst, and what it parked waits for
    the next token."""
    hooks._define_limits(app)
    assert limits(peek) == [
        (f"queue:{Q}", 2, 3600.0, 2, None, "config"),
        ("queue:other", 10, 1.0, 1, None, "config"),
    ]
    for n in range(4):
        store.publisher.publish(Q, message(n))
    assert delivered(store.claim([Q], [30.0], 10)) == [0, 1]
    assert delivered(store.claim([Q], [30.0], 10)) == []


def test_a_limit_the_command_set_is_kept_over_the_option(
    app: Celery, store: PublishingStore, peek: Peek
) -> None:
    """As for task limits: `pgq limit set` (origin command) is kept at the next worker
    start; after `pgq limit reset` the option's is written again."""
    hooks._define_limits(app)
    Limits(store).set(f"queue:{Q}", burst=5)
    hooks._define_limits(app)
    assert limits(peek)[0] == (f"queue:{Q}", 2, 3600.0, 5, None, "command")
    assert Limits(store).reset(f"queue:{Q}") == "command"
    hooks._define_limits(app)
    assert limits(peek)[0] == (f"queue:{Q}", 2, 3600.0, 2, None, "config")


def test_a_bad_queue_rate_limit_stops_the_worker_start_naming_the_option(
    app: Celery, peek: Peek
) -> None:
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "queue_rate_limits": {Q: "ten per second"},
    }
    with pytest.raises(LimitError, match=r"queue_rate_limits\['limited'\]='ten per second'"):
        hooks._define_limits(app)
    assert limits(peek) == []


# -- a queue's own concurrency ----------------------------------------------------------


def define_queue(peek: Peek, concurrency: int) -> None:
    peek(
        "INSERT INTO {schema}.flow_limit (name, concurrency, origin) VALUES (%s, %s, 'command')",
        f"queue:{Q}",
        concurrency,
    )


def test_at_most_n_of_a_queue_in_flight_and_a_holder_leaving_wakes_the_next(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """queue:<name> with concurrency 2: two of five start; the others are parked until a
    holder's lease end, and an ack makes the earliest waiting one visible at once (in its
    place). Another queue is not held back."""
    define_queue(peek, 2)
    for n in range(5):
        store.publisher.publish(Q, message(n))
        store.publisher.publish("other", message(10 + n))
    batch = store.claim([Q, "other"], [30.0, 30.0], 20)
    assert sorted(delivered(batch)) == [0, 1, 10, 11, 12, 13, 14]
    assert delivered(store.claim([Q], [30.0], 10)) == []
    assert peek(
        "SELECT count(*) FROM {schema}.message WHERE queue = %s AND qslot AND due_at IS NOT NULL",
        Q,
    ) == [(3,)]
    holders = [c for c in batch if c.queue == Q and not c.held]
    assert store.ack([Lease(holders[0].id, holders[0].lease, Q)]) == 1
    assert peek(
        "SELECT payload->>'body' FROM {schema}.message"
        " WHERE queue = %s AND visible_at <= now() ORDER BY id",
        Q,
    ) == [("2",)]
    assert delivered(store.claim([Q], [30.0], 10)) == [2]
    assert delivered(store.claim([Q], [30.0], 10)) == []
    url = to_broker_url(pg_url)
    done = CliRunner().invoke(main, ["status", "--json", "--url", url, "--schema", schema])
    assert done.exit_code == 0, done.output
    [line] = json.loads(done.stdout)["limits"]
    assert (line["name"], line["in_flight"], line["waiting"]) == (f"queue:{Q}", 2, 2)


def test_two_claims_of_a_queue_at_n1_deliver_one(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """Stepped: one claim holds the queue's row (its transaction open, its delivery not
    committed); another claim meanwhile is told busy at once (its messages held, not
    parked, nothing leased); after the first commits, the second counts its holder and
    leases nothing."""
    define_queue(peek, 1)
    for n in range(3):
        store.publisher.publish(Q, message(n))
    with (
        psycopg.connect(pg_url) as first,
        psycopg.connect(pg_url, autocommit=True, options="-c lock_timeout=5000") as second,
    ):
        assert [r[8] for r in raw_claim(store, first, limit=1)] == [None]
        assert {r[8] for r in raw_claim(store, second)} == {"held"}
        assert peek("SELECT count(*) FROM {schema}.message WHERE read_ct > 0") == [(0,)]
        first.commit()
        assert [r for r in raw_claim(store, second) if r[8] is None] == []
    assert peek("SELECT count(*) FROM {schema}.message WHERE read_ct > 0 AND due_at IS NULL") == [
        (1,)
    ]


def test_a_lapsed_queue_slot_comes_back_and_is_not_renewed(
    store: PublishingStore, peek: Peek
) -> None:
    define_queue(peek, 1)
    store.publisher.publish(Q, message(1))
    store.publisher.publish(Q, message(2))
    [holder] = [c for c in store.claim([Q], [30.0], 10) if not c.held]
    peek.expire_leases()
    assert store.renew([(Lease(holder.id, holder.lease, Q), 30.0)]) == 0
    assert delivered(store.claim([Q], [30.0], 10)) == [1]
    assert delivered(store.claim([Q], [30.0], 10)) == []


def test_a_queue_s_and_a_key_s_concurrency_both_hold(store: PublishingStore, peek: Peek) -> None:
    """Key slots first (one per key), then the queue's (two): of a, a, b, c the second a
    waits for its key and c for the queue."""
    define_queue(peek, 2)
    peek("INSERT INTO {schema}.flow_limit (name, concurrency, origin) VALUES ('erp', 1, 'command')")
    for n, key in enumerate(["a", "a", "b", "c"]):
        store.publisher.publish(Q, keyed(n, key))
    assert delivered(store.claim([Q], [30.0], 10)) == [0, 2]
    assert peek(
        "SELECT payload->>'body', climit, qslot FROM {schema}.message"
        " WHERE due_at IS NOT NULL ORDER BY id"
    ) == [("1", "erp", False), ("3", "erp", True)]


def test_a_queue_s_concurrency_is_set_by_the_command(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    done = CliRunner().invoke(
        main,
        ["limit", "set", f"queue:{Q}", "--concurrency", "3", "--url", to_broker_url(pg_url),
         "--schema", schema],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert limits(peek) == [(f"queue:{Q}", None, None, 1, 3, "command")]


def test_a_claimer_killed_holding_the_queue_s_row_takes_no_slot(
    store: PublishingStore, peek: Peek, pg_url: str
) -> None:
    """A claim's session terminated while it holds the queue's row and its grant (not
    committed): nothing it did stands, and the next claim gets the one slot."""
    define_queue(peek, 1)
    for n in range(2):
        store.publisher.publish(Q, message(n))
    doomed = psycopg.connect(pg_url)
    try:
        assert [r[8] for r in raw_claim(store, doomed, limit=1)] == [None]
        [(pid,)] = doomed.execute("SELECT pg_backend_pid()").fetchall()
        assert peek("SELECT pg_terminate_backend(%s)", pid) == [(True,)]
        peek.wait_until(
            "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)",
            pid,
            failure="the terminated claimer's backend did not go away",
        )
    finally:
        doomed.close()
    assert peek("SELECT count(*) FROM {schema}.message WHERE read_ct > 0") == [(0,)]
    assert delivered(store.claim([Q], [30.0], 10)) == [0]
