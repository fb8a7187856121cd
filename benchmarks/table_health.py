"""Table health: a million messages through the queue, and what the table looks like.

    python -m benchmarks.table_health [--messages 1000000] [--json]

Messages go through in rounds (a bulk publish of ``--round`` messages, then a worker-
style drain: claims of a prefetch window carrying the previous window's acks). The run
is made twice in fresh schemas: with pgq's own vacuuming (what a consuming worker does,
``vacuum_threshold``) and without any (autovacuum off, as on this project's CI machine).
For each: heap and index sizes and dead rows after the first round (baseline), at the
peak, at the end, and after one final VACUUM; the drain rate of the first and of the
last rounds; the WAL the server wrote per message, over the whole run and while
draining. ``--fillfactor`` sets the message table's fill factor first (pgq's schema
gives 50). JSON on stdout with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks.scratch import Scratch, scratch
from pg_transport.consume.vacuum import Vacuumer

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
QUEUE = "health"


def fillfactor(text: str) -> int:
    """A fill factor as Postgres takes it for a table: a whole percentage, 10 to 100."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 10 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be between 10 and 100, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.table_health", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--messages", type=int, default=1_000_000, help="messages through the queue")
    add("--round", type=int, default=10_000, help="messages published per round")
    add("--window", type=int, default=16, help="prefetch window of the draining worker")
    add(
        "--vacuum-threshold",
        type=int,
        default=None,
        help="dead rows before pgq vacuums (default: the transport's default)",
    )
    add(
        "--fillfactor",
        type=fillfactor,
        default=None,
        help="the message table's fill factor, 10-100 (default: pgq's, 50)",
    )
    add(
        "--pg-url",
        default=os.environ.get("PGQ_TEST_URL", DEFAULT_PG).replace("pgq://", "postgresql://", 1),
    )
    add("--json", action="store_true", help="JSON on stdout (table on stderr)")
    args = parser.parse_args(argv)
    if args.messages < args.round or args.round < args.window or args.window < 1:
        parser.error("need --messages >= --round >= --window >= 1")
    return args


def snapshot(s: Scratch) -> dict[str, Any]:
    sizes = s.sizes()
    return {"bytes": sizes, "total_bytes": sum(sizes.values()), **s.stats()}


def run(args: argparse.Namespace, vacuum: bool) -> dict[str, Any]:
    from pg_transport.config import Options

    threshold = args.vacuum_threshold or Options().vacuum_threshold
    rounds = args.messages // args.round
    messages = rounds * args.round
    with scratch(args.pg_url) as s:
        if args.fillfactor is not None:
            s.sql(f"ALTER TABLE {{schema}}.message SET (fillfactor = {args.fillfactor:d})")
        vacuumer = Vacuumer(s.store.connector, s.schema, threshold) if vacuum else None
        if vacuumer is not None:
            vacuumer.start()
        rates: list[float] = []
        peak: dict[str, Any] = {"total_bytes": 0}
        baseline: dict[str, Any] = {}
        started = time.monotonic()
        run_wal = s.wal_position()
        drain_wal = 0
        try:
            for n in range(rounds):
                s.fill(QUEUE, args.round, keyed=True)
                drain_from = s.wal_position()
                t0 = time.perf_counter()
                got = s.consume(QUEUE, args.round, args.window)
                rates.append(got / (time.perf_counter() - t0))
                drain_wal += s.wal_since(drain_from)
                if got != args.round:
                    raise RuntimeError(f"round {n} drained {got} of {args.round}")
                if n == 0:
                    s.sql("VACUUM {schema}.message")
                    time.sleep(1.1)  # sessions report their statistics when idle
                    baseline = snapshot(s)
                elif n % 10 == 0 or n == rounds - 1:
                    now = snapshot(s)
                    if now["total_bytes"] > peak["total_bytes"]:
                        peak = now
        finally:
            if vacuumer is not None:
                vacuumer.stop()
        elapsed = time.monotonic() - started
        wal = s.wal_since(run_wal)
        time.sleep(1.1)
        end = snapshot(s)
        left = s.sql("SELECT count(*) FROM {schema}.message")[0][0]
        s.sql("VACUUM {schema}.message")
        time.sleep(1.1)
        after = snapshot(s)
        tail = max(1, rounds // 10)
        return {
            "vacuum": f"pgq, threshold {threshold} dead rows" if vacuum else "none",
            "vacuums_run": vacuumer.vacuums if vacuumer is not None else 0,
            "messages": messages,
            "messages_left": int(left),
            "seconds": elapsed,
            "drain_rate_first_rounds": sum(rates[:tail]) / tail,
            "drain_rate_last_rounds": sum(rates[-tail:]) / tail,
            # By every session of the server while this ran: its own, pgq's vacuuming.
            "wal_bytes_per_message": wal / messages,
            "drain_wal_bytes_per_message": drain_wal / messages,
            "baseline": baseline,
            "peak": peak,
            "end": end,
            "after_vacuum": after,
        }


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def format_report(result: dict[str, Any]) -> str:
    factor = result["fillfactor"] or "pgq's"
    lines = [
        f"{result['messages_each']:,} messages per run, drained in windows of "
        f"{result['window']}, fill factor {factor}; sizes in "
        "MiB (heap + indexes); WAL in bytes per message (all, while draining)",
        "",
    ]
    lines.append(
        f"{'vacuum':<34}{'baseline':>9}{'peak':>9}{'end':>9}{'after':>9}"
        f"{'dead@end':>10}{'rate first':>12}{'rate last':>11}{'WAL':>7}{'drain':>7}"
    )
    for r in result["runs"]:
        lines.append(
            f"{r['vacuum']:<34}{mib(r['baseline']['total_bytes'])} {mib(r['peak']['total_bytes'])}"
            f" {mib(r['end']['total_bytes'])} {mib(r['after_vacuum']['total_bytes'])}"
            f"{r['end']['dead_rows']:>10}{r['drain_rate_first_rounds']:>12.0f}"
            f"{r['drain_rate_last_rounds']:>11.0f}{r['wal_bytes_per_message']:>7.0f}"
            f"{r['drain_wal_bytes_per_message']:>7.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    runs = []
    for vacuum in (True, False):
        print(
            f"[table health] {args.messages:,} messages, vacuum {'on' if vacuum else 'off'}",
            file=sys.stderr,
            flush=True,
        )
        runs.append(run(args, vacuum))
    result = {
        "messages_each": args.messages,
        "round": args.round,
        "window": args.window,
        "fillfactor": args.fillfactor,
        "runs": runs,
    }
    print(format_report(result), file=out, flush=True)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
