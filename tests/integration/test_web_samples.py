"""The console's samples: one tick per interval however many consoles take it, and the
figures are those of `pgq status` at that moment."""

from __future__ import annotations

import threading
from datetime import datetime

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
