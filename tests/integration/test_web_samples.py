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
