"""What an idle consumer waits for between a publish and its message, step by step.

``python -m benchmarks.wake`` publishes one message at a time to a queue an idle consumer
session listens on, durably (as ``durable_publish`` does by default) and then with
``durable_publish`` off, and times, per message, from the start of the publish call:

- ``returned``: the publish call returned (its commit, WAL flush included, is done);
- ``woken``: the consumer's session read the wake-up (a NOTIFY with no payload);
- ``claimed``: the answer of the claim the consumer sent at once came back.

``claimed`` is the floor of an idle worker's start latency on pgq: the rest is Celery's
own (the same on every broker). ``claimed`` minus ``woken`` is the claim's round trip,
which a wake-up that carries nothing cannot spare (docs/design/hot-path.md). Medians and
99th percentiles in µs; ``--json`` prints them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from statistics import median, quantiles

import psycopg
from psycopg import sql

from benchmarks.brokers import default_pg_url
from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.db.wire import Statement
from pg_transport.publish.publisher import Publisher
from pg_transport.sql import load_queries
from pg_transport.store import Store, claim_params, decode_claimed

__all__ = ["main", "measure"]

PAYLOAD = {
    "body": "[[], {}, {}]",
    "content-type": "application/json",
    "headers": {},
    "properties": {"delivery_info": {}},
}


def measure(pg_url: str, probes: int, *, durable: bool) -> dict[str, dict[str, float]]:
    schema = "pgq_wake_" + uuid.uuid4().hex[:8]
    setup = () if durable else ("SET synchronous_commit TO off",)
    connector = Connector(pg_url, setup=setup)
    ensure_schema(connector, schema, auto_migrate=True)
    store = Store(connector, schema)
    publisher = Publisher(connector, schema, flushes=durable)
    consumer = psycopg.connect(pg_url, autocommit=True)
    for name in ("relax_commit", "generic_plans", "no_jit"):  # as a consumer's session
        consumer.execute(load_queries(schema)[name])
    steps: dict[str, list[float]] = {"returned": [], "woken": [], "claimed": []}
    try:
        consumer.execute(sql.SQL("LISTEN {}").format(sql.Identifier(store.channel("q"))))
        claim = Statement("claim", load_queries(schema)["claim"])
        params = claim_params(["q"], [30.0], 4, [5], [])
        for n in range(probes + 5):
            started = time.perf_counter()
            publisher.publish("q", PAYLOAD)
            returned = time.perf_counter()
            if not list(consumer.notifies(timeout=5.0, stop_after=1)):
                raise AssertionError("no wake-up in 5 s")
            woken = time.perf_counter()
            rows = claim.execute(consumer, params, prepare=True)
            claimed = time.perf_counter()
            assert len(rows) == 1
            store.ack([decode_claimed(rows[0]).token])
            if n >= 5:  # (the first ones prepare statements)
                for name, at in (("returned", returned), ("woken", woken), ("claimed", claimed)):
                    steps[name].append((at - started) * 1e6)
            time.sleep(0.005)  # idle between probes, as a worker is
    finally:
        consumer.close()
        with connector.connection() as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        connector.close()
    return {
        name: {"p50": median(values), "p99": quantiles(values, n=100)[98]}
        for name, values in steps.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=default_pg_url())
    parser.add_argument("--probes", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    found = {
        "durable": measure(args.url, args.probes, durable=True),
        "async": measure(args.url, args.probes, durable=False),
    }
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print("µs from the start of a publish     p50      p99")
    for way, steps in found.items():
        for name, value in steps.items():
            print(f"{way:8} {name:24} {value['p50']:8.0f} {value['p99']:8.0f}")


if __name__ == "__main__":
    main()
