"""Issue 47 part (d): a lone key's message behind another key's backlog, fair mode off and on.

    python -m benchmarks.fair_share [--backlog 100000] [--window 8] [--rounds 3] [--json]

In a throwaway schema (``benchmarks.scratch``), per round and mode: ``--backlog``
Celery-sized messages of key A are queued (in bulk), then one message of key B is
published; a consumer then claims windows of ``--window`` with the previous window's
acks riding on each, as a worker's engine does, until B is delivered. Reported per mode:
the claims and messages delivered before B, the ms from B's publish to its delivery, and
the median ms of the next 300 claims of the backlog (the fair claim's cost against the
plain one on the same queue shape). ``off`` is a plain queue claimed by the plain
statement; ``on`` a queue declared fair claimed by ``fair_claim``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median
from typing import Any

from benchmarks.brokers import default_pg_url
from benchmarks.scratch import CELERY_PAYLOAD, scratch
from pg_transport.publish.publisher import Publisher
from pg_transport.store import Lease

__all__ = ["main", "measure"]

#: Claims timed after B's delivery, for the median cost of one.
DRAIN_CLAIMS = 300


def lone_key(s: Any, fair: bool, backlog: int, window: int, round_: int) -> dict[str, Any]:
    queue = f"{'fair' if fair else 'plain'}_{round_}"
    s.store.declare_queue(queue, fair=fair)
    s.sql(
        "INSERT INTO {schema}.message (queue, payload, fkey)"
        " SELECT %s, %s::json, CASE WHEN %s THEN 'A' END FROM generate_series(1, %s)",
        queue,
        json.dumps(CELERY_PAYLOAD),
        fair,
        backlog,
    )
    s.sql("ANALYZE {schema}.message")
    publisher = Publisher(s.store.connector, s.schema)
    lone = {**CELERY_PAYLOAD, "headers": {**CELERY_PAYLOAD["headers"], "pgq-fair-key": "B"}}
    start = time.perf_counter()
    publisher.publish(queue, lone)
    acks: list[Lease] = []
    claims, before, claim_ms = 0, 0, []
    while True:
        t0 = time.perf_counter()
        batch = s.store.claim([queue], [30.0], window, [5], acks=acks, fair=fair)
        claim_ms.append((time.perf_counter() - t0) * 1000.0)
        claims += 1
        if not batch:
            raise RuntimeError("the queue ran dry before B was delivered")
        acks = [c.token for c in batch]
        keys = [(c.payload or {}).get("headers", {}).get("pgq-fair-key") for c in batch]
        if "B" in keys:
            before += keys.index("B")
            break
        before += len(batch)
    latency = (time.perf_counter() - start) * 1000.0
    # The steady cost of a claim on this queue shape: DRAIN_CLAIMS more, acks riding.
    claim_ms = []
    for _ in range(DRAIN_CLAIMS):
        t0 = time.perf_counter()
        batch = s.store.claim([queue], [30.0], window, [5], acks=acks, fair=fair)
        claim_ms.append((time.perf_counter() - t0) * 1000.0)
        acks = [c.token for c in batch]
    s.store.ack(acks)
    s.sql("DELETE FROM {schema}.message WHERE queue = %s", queue)
    return {
        "mode": "on" if fair else "off",
        "round": round_,
        "claims_until_b": claims,
        "delivered_before_b": before,
        "b_latency_ms": round(latency, 1),
        "median_claim_ms": round(median(claim_ms), 3),
    }


def measure(pg_url: str, backlog: int, window: int, rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with scratch(pg_url) as s:
        for r in range(1, rounds + 1):
            modes = [False, True] if r % 2 else [True, False]
            rows += [lone_key(s, fair, backlog, window, r) for fair in modes]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pg-url", default=None)
    args = parser.parse_args(argv)
    rows = measure(args.pg_url or default_pg_url(), args.backlog, args.window, args.rounds)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(f"a lone key B behind {args.backlog} messages of key A, claims of {args.window}")
    print("mode  round  claims until B  delivered before B  B latency ms  median claim ms")
    for row in rows:
        print(
            f"{row['mode']:>4}  {row['round']:>5}  {row['claims_until_b']:>14}"
            f"  {row['delivered_before_b']:>18}  {row['b_latency_ms']:>12}"
            f"  {row['median_claim_ms']:>15}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
