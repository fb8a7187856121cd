"""Backlog scaling: does claiming get slower as the queue gets deeper or busier?

    python -m benchmarks.backlog [--sizes 1000,10000,100000,1000000] [--json]

For each scenario, in a fresh schema: fill the queue in bulk, VACUUM ANALYZE, then time
``--rounds`` claim statements of a worker's window (4 messages) that each also ack the
previous window, as pgq's consumer does. The queue is topped up between rounds, outside
the timing, so its depth stays what the scenario says. Scenarios:

* depth N: N ready messages;
* in flight: 1,000 ready behind 100,000 claimed and not acked (leased);
* delayed: 1,000 ready behind 100,000 waiting for their ETA;
* in flight, higher priority: the 100,000 leased ones at a higher priority than the ready.

Ratios: each scenario's p50 to the shallowest queue's. JSON on stdout with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from benchmarks.scratch import Scratch, scratch

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
QUEUE = "backlog"
WINDOW = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.backlog", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--sizes", default="1000,10000,100000,1000000", help="queue depths (comma-separated)")
    add("--held", type=int, default=100_000, help="leased / delayed messages in the way")
    add("--rounds", type=int, default=2000, help="timed claims per scenario")
    add(
        "--pg-url",
        default=os.environ.get("PGQ_TEST_URL", DEFAULT_PG).replace("pgq://", "postgresql://", 1),
    )
    add("--json", action="store_true", help="JSON on stdout (table on stderr)")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(n) for n in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be whole numbers separated by commas, got {args.sizes!r}")
    if min(args.sizes) < WINDOW or args.rounds < 10 or args.held < 0:
        parser.error(f"sizes must be >= {WINDOW}, --rounds >= 10, --held >= 0")
    return args


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def timed_claims(s: Scratch, rounds: int) -> dict[str, float]:
    """Microseconds per claim(+ack) statement of a full window."""
    times: list[float] = []
    acks: list[tuple[int, int]] = []
    for _ in range(rounds):
        started = time.perf_counter()
        batch = s.store.claim([QUEUE], [30.0], WINDOW, [5], acks=acks)
        times.append((time.perf_counter() - started) * 1e6)
        if len(batch) != WINDOW:
            raise RuntimeError(f"a claim got {len(batch)} of {WINDOW}: the queue ran dry")
        acks = [c.token for c in batch]
        s.fill(QUEUE, WINDOW)  # keep the depth (not timed)
    s.store.ack(acks)
    return {
        "p50_us": percentile(times, 0.5),
        "p99_us": percentile(times, 0.99),
        "mean_us": sum(times) / len(times),
    }


def scenario(args: argparse.Namespace, name: str, setup: list[tuple[Any, ...]]) -> dict[str, Any]:
    print(f"[backlog] {name}", file=sys.stderr, flush=True)
    with scratch(args.pg_url) as s:
        started = time.monotonic()
        for fill in setup:
            count, kwargs = fill
            s.fill(QUEUE, count, **kwargs)
        s.sql("VACUUM ANALYZE {schema}.message")
        filled = time.monotonic() - started
        result = timed_claims(s, args.rounds)
        rows = s.sql("SELECT count(*) FROM {schema}.message")[0][0]
    return {"scenario": name, "rows": int(rows), "fill_seconds": filled, **result}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    leased = {"invisible": "1 hour", "read_ct": 1}
    runs = [scenario(args, f"depth {n:,}", [(n, {})]) for n in args.sizes]
    base = min(args.sizes)
    runs += [
        scenario(args, f"in flight {args.held:,}", [(args.held, leased), (base, {})]),
        scenario(
            args, f"delayed {args.held:,}", [(args.held, {"invisible": "1 hour"}), (base, {})]
        ),
        scenario(
            args,
            f"in flight {args.held:,}, higher priority",
            [(args.held, {**leased, "priority": 9}), (base, {})],
        ),
    ]
    reference = runs[0]["p50_us"]
    for run in runs:
        run["ratio_to_shallowest"] = run["p50_us"] / reference
    print(
        f"claim of {WINDOW} messages acking the previous {WINDOW}, {args.rounds} rounds; "
        f"ratio = p50 / p50 at depth {base:,}",
        file=out,
    )
    print(f"{'scenario':<40}{'rows':>10}{'p50 us':>10}{'p99 us':>10}{'ratio':>8}", file=out)
    for run in runs:
        print(
            f"{run['scenario']:<40}{run['rows']:>10}{run['p50_us']:>10.0f}"
            f"{run['p99_us']:>10.0f}{run['ratio_to_shallowest']:>8.2f}",
            file=out,
            flush=True,
        )
    if args.json:
        print(json.dumps({"window": WINDOW, "rounds": args.rounds, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
