"""What ``durable_acks`` costs a consumer: drain rate with acks that wait, against relaxed.

    python -m benchmarks.durable_acks [--messages 2000] [--rounds 3] [--json]

Publishes ``--messages`` messages (one batch), then one kombu consumer (prefetch 16,
pgq's consumer engine, acks riding on its claims) drains them, first message to last,
with ``durable_acks`` on and off in turn, ``--rounds`` times each, on:

- ``local``: the server of ``--url`` (no standby): on waits for the WAL flush (its
  ``fsync`` setting is reported);
- ``synchronous``: a throwaway primary with a synchronous standby on this machine
  (tests/acceptance/replication.py; fsync off on both): on waits for the standby.

A plain kombu consumer has no Celery overhead around each message: the ratio is the
worst case of what a Celery worker sees. Rates in messages/s; the ratio is on ÷ off
(< 1: on is slower).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from statistics import median
from typing import Any

import psycopg
from kombu import Connection, Consumer, Queue

import pg_transport
from benchmarks.brokers import default_pg_url
from tests.acceptance.replication import replicated_pair
from tests.pg import to_broker_url

__all__ = ["drain_rate", "main"]


def drain_rate(pg_url: str, durable_acks: str, messages: int) -> float:
    schema = "pgq_acks_" + uuid.uuid4().hex[:8]
    options = {"schema": schema, "durable_acks": durable_acks}
    url = to_broker_url(pg_url)
    try:
        with Connection(url, transport_options=options) as conn:
            queue = conn.SimpleQueue("drain")
            with pg_transport.batch():
                for n in range(messages):
                    queue.put({"n": n})
            queue.close()
            times: list[float] = []
            consumer = Consumer(
                conn,
                [Queue("drain")],
                accept=["json"],
                prefetch_count=16,
                callbacks=[lambda body, msg: (times.append(time.perf_counter()), msg.ack())],
            )
            consumer.consume()
            deadline = time.monotonic() + 300
            while len(times) < messages and time.monotonic() < deadline:
                conn.drain_events(timeout=5)
            consumer.cancel()  # type: ignore[no-untyped-call]
        if len(times) != messages:
            raise RuntimeError(f"{len(times)} of {messages} messages drained")
        return (len(times) - 1) / (times[-1] - times[0])
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    psycopg.sql.Identifier(schema)
                )
            )


def compare(pg_url: str, messages: int, rounds: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for n in range(rounds):
        for mode in ("on", "off") if n % 2 == 0 else ("off", "on"):
            rates[mode].append(drain_rate(pg_url, mode, messages))
    on, off = median(rates["on"]), median(rates["off"])
    return {"on": on, "off": off, "ratio": on / off, "rounds": rates}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=default_pg_url())
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with psycopg.connect(args.url) as conn:
        fsync = conn.execute("SHOW fsync").fetchone()
    found = {"local": {**compare(args.url, args.messages, args.rounds), "fsync": fsync}}
    with replicated_pair(synchronous=True) as pair:
        found["synchronous"] = compare(pair.primary.url(), args.messages, args.rounds)
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"{args.messages} messages, {args.rounds} rounds (medians), messages/s")
    print(f"{'server':12} {'on':>8} {'off':>8} {'on/off':>7}")
    for name, result in found.items():
        print(f"{name:12} {result['on']:8.0f} {result['off']:8.0f} {result['ratio']:7.2f}")


if __name__ == "__main__":
    main()
