"""What migration 0018's whole-queue concurrency costs a queue that does not use it.

    python -m benchmarks.queue_slot_cost [--messages 4000] [--window 8] [--rounds 4] [--json]

0018 adds to the message table a column (``qslot``), two partial indexes that hold only
the messages of a queue with a concurrency limit of its own, and an ``AFTER DELETE``
trigger whose ``WHEN (OLD.qslot)`` is false for every other row. The plain claim is not
changed. So a plain queue pays, if anything, on its inserts and claims (the indexes'
predicates) and its acks (the trigger's condition). Two throwaway schemas in one
database: *after* as 0018 leaves it, *before* the same with the two indexes and the
trigger dropped. Each round fills both (bulk, timed, which goes first alternating),
then drains them claim by claim in turn (claims of ``--window`` with the previous
claim's acks riding on each, as a worker's engine sends them), which goes first
alternating by round, so a busy machine's load falls on both alike. Reported: the
median ms of a claim (with its acks) per side, the fill's ms per side, after ÷ before,
and the load average sampled at each claim, per side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from statistics import mean, median
from typing import Any

from benchmarks.brokers import default_pg_url
from benchmarks.scratch import Scratch, scratch
from pg_transport.store import Claimed, Lease

__all__ = ["main", "measure"]

BEFORE = (
    "DROP INDEX {schema}.message_queue_slot_live_idx;"
    " DROP INDEX {schema}.message_queue_slot_wait_idx;"
    " DROP TRIGGER message_leave_queue_slot ON {schema}.message"
)


def measure(pg_url: str, messages: int, window: int, rounds: int) -> dict[str, Any]:
    with ExitStack() as stack:
        sides = {"after": stack.enter_context(scratch(pg_url))}
        sides["before"] = stack.enter_context(scratch(pg_url))
        sides["before"].sql(BEFORE)
        claims: dict[str, list[float]] = {"after": [], "before": []}
        fills: dict[str, list[float]] = {"after": [], "before": []}
        loads: dict[str, list[float]] = {"after": [], "before": []}
        for r in range(rounds):
            order = ["after", "before"] if r % 2 == 0 else ["before", "after"]
            queue = f"plain{r}"
            for name in order:
                start = time.perf_counter()
                sides[name].fill(queue, messages, keyed=True)
                fills[name].append((time.perf_counter() - start) * 1000.0)
            for name in order:
                sides[name].sql("ANALYZE {schema}.message")
            acks: dict[str, list[Lease]] = {"after": [], "before": []}
            done = {"after": 0, "before": 0}
            while min(done.values()) < messages:
                for name in order:
                    if done[name] >= messages:
                        continue
                    s: Scratch = sides[name]
                    loads[name].append(os.getloadavg()[0])
                    start = time.perf_counter()
                    batch: list[Claimed] = s.store.claim(
                        [queue], [30.0], window, [5], acks=acks[name]
                    )
                    claims[name].append((time.perf_counter() - start) * 1000.0)
                    if not batch:
                        raise RuntimeError(f"{name}: drained {done[name]} of {messages}")
                    acks[name] = [c.token for c in batch]
                    done[name] += len(batch)
            for name in order:
                sides[name].store.ack(acks[name])
    claim_ms = {k: median(v) for k, v in claims.items()}
    fill_ms = {k: median(v) for k, v in fills.items()}
    return {
        "messages": messages,
        "window": window,
        "rounds": rounds,
        "claims_per_side": len(claims["after"]),
        "claim_ms_median": claim_ms,
        "claim_ratio_after_over_before": claim_ms["after"] / claim_ms["before"],
        "fill_ms_median": fill_ms,
        "fill_ratio_after_over_before": fill_ms["after"] / fill_ms["before"],
        "load_average": {k: round(mean(v), 2) for k, v in loads.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = measure(default_pg_url(), args.messages, args.window, args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
