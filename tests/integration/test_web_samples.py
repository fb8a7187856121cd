"""The console's samples: one tick per interval however many consoles take it, and the
figures are those of `pgq status` at that moment."""

from __future__ import annotations

import threading
from datetime import datetime

import pytest

from pg_transport.db.pool import Connector
from pg_transport.ops.status import collect
from pg_transport.store import Store
from pg_transport.web import sampler
from tests.integration.conftest import Peek


def test_two_consoles_taking_one_interval_store_one_tick(
    pg_url: str, store: Store, peek: Peek
) -> None:
    peek(
        "INSERT INTO {schema}.message (queue, payload)"
        " SELECT q, '{{}}' FROM unnest(ARRAY['a', 'a', 'a', 'b', 'b']) AS q"
    )
    consoles = [Connector(pg_url), Connector(pg_url)]
    start = threading.Barrier(2)
    taken: list[datetime | None] = []

    def take(connector: Connector) -> None:
        start.wait()
        # An hour-long interval: both are inside the same one.
        taken.append(sampler.take(connector, store.schema, 3600))

    try:
        threads = [threading.Thread(target=take, args=(c,)) for c in consoles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for c in consoles:
            c.close()
    assert len(taken) == 2 and taken.count(None) == 1
    assert peek("SELECT count(*) FROM {schema}.console_tick") == [(1,)]
    latest = sampler.latest(store.connector, store.schema)
    assert latest.at is not None
    counted = collect(store).queues
    figures = [(q.queue, q.ready, q.in_flight, q.delayed, q.dead) for q in latest.queues]
    assert figures == [(q.queue, q.ready, q.in_flight, q.delayed, q.dead) for q in counted]
    assert {q.queue: q.ready for q in latest.queues} == {"a": 3, "b": 2}


def test_a_queue_change_per_second_is_between_the_last_two_ticks(store: Store, peek: Peek) -> None:
    add = (
        "INSERT INTO {schema}.message (queue, payload)"
        " SELECT %s, '{{}}' FROM generate_series(1, %s)"
    )
    peek(add, "a", 2)
    # A millisecond interval: each take is a tick of its own.
    first = sampler.take(store.connector, store.schema, 0.001)
    peek(add, "a", 6)
    peek(add, "b", 3)
    second = sampler.take(store.connector, store.schema, 0.001)
    assert first is not None and second is not None and second > first
    ((span,),) = peek(
        "SELECT extract(epoch FROM max(taken_at) - min(taken_at))::float8"
        " FROM {schema}.console_tick"
    )
    got = sampler.changes(
        store.connector, store.schema, sampler.latest(store.connector, store.schema)
    )
    assert round(got["a"] * span, 6) == 6 and round(got["b"] * span, 6) == 3


def test_a_queue_rates_are_between_the_window_first_tick_and_the_latest(
    store: Store, peek: Peek
) -> None:
    # Ticks a minute apart, written as the sampler writes them; the one of 20 minutes
    # ago is outside a 5-minute window. Queue a drains 90 and gains 3 dead letters (4
    # dead-lettered, 1 requeued); b appears mid-window (none before: a tick samples every
    # queue with messages); c is gone by the latest tick (not listed: nor on the page).
    ((now,),) = peek("SELECT now()")
    peek(
        "INSERT INTO {schema}.console_tick (at, taken_at) SELECT %s - m * interval '1 minute',"
        " %s - m * interval '1 minute' FROM unnest(ARRAY[20, 3, 2, 1]) AS m",
        now,
        now,
    )
    peek(
        "INSERT INTO {schema}.console_sample (at, queue, ready, in_flight, delayed, dead)"
        " SELECT %s::timestamptz - m * interval '1 minute', q, r, i, d, x FROM (VALUES"
        " (20, 'a', 1000, 0, 0, 50), (3, 'a', 100, 10, 0, 0), (2, 'a', 40, 5, 0, 4),"
        " (1, 'a', 10, 5, 5, 3), (2, 'b', 10, 0, 0, 0), (1, 'b', 35, 5, 0, 0),"
        " (3, 'c', 7, 0, 0, 0), (2, 'c', 7, 0, 0, 0)) AS v (m, q, r, i, d, x)",
        now,
    )
    got = sampler.queue_rates(store.connector, store.schema, 300)
    assert set(got) == {"a", "b"}
    assert got["a"].span == pytest.approx(120)
    assert got["a"].change == pytest.approx(-90 / 120)
    assert got["a"].dead == pytest.approx(3 / 120)
    assert got["a"].empties_in(20) == pytest.approx(20 / (90 / 120))
    assert got["b"].change == pytest.approx(40 / 120) and got["b"].dead == 0
    assert got["b"].empties_in(40) is None  # growing: it does not empty
    # A window holding the latest tick only: no rate.
    one = sampler.queue_rates(store.connector, store.schema, 90)
    assert one["a"].change is None and one["a"].dead is None
