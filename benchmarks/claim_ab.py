"""Two versions of the claim statement, claim by claim in turn: what a change to it costs.

    python -m benchmarks.claim_ab --against OTHER.sql [--messages 8000] [--keys 0,1000]
        [--window 8] [--rounds 3] [--this claim|lean_claim] [--json]

``OTHER.sql`` is another ``queries.sql`` (say main's: ``git show
main:pg_transport/sql/queries.sql > /tmp/main.sql``); its ``claim`` is the *other*
statement, this tree's is *this*. In a throwaway schema (``benchmarks.scratch``), for
each ``--keys`` (0: no ordering key; n: round-robin over n keys) and each round,
``--messages`` Celery-sized messages are drained by claims of ``--window`` with the
previous claim's acks riding on each, as a worker's engine sends them, the two
statements taking turns claim by claim (which goes first alternates by round). Both
share one pool of sessions, one table and the same moments, so the load of a busy
machine falls on both alike; whole runs timed one after the other do not (they differ
by a factor of two on a loaded machine). Reported: the median ms of a claim under each
statement and this ÷ other, per round and of all claims.

``--this`` names the statement of this tree (``claim``; ``lean_claim``, which delivers
no keyed message, with ``--keys 0`` only). ``--cpu``: the server's CPU per claim
instead, each statement on a session of its own (a consumer's settings: generic plan,
no JIT, asynchronous commit) and its backend's CPU read from ``/proc`` around each claim
(Postgres on this host), over a plain queue; the mean µs per claim and this ÷ other.
A claim's CPU is read in clock ticks (10 ms): the mean over hundreds of claims is what
resolves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import fmean, median
from typing import Any

import psycopg

from benchmarks.brokers import default_pg_url
from benchmarks.procstat import sample
from benchmarks.scratch import CELERY_PAYLOAD, scratch
from pg_transport.db.wire import Statement
from pg_transport.sql.loader import compose, parse_named
from pg_transport.store import Claimed, Lease, claim_params, read_claim

__all__ = ["drain", "drain_cpu", "main", "measure", "measure_cpu"]


def drain(
    s: Any, queue: str, messages: int, window: int, statements: list[Statement]
) -> dict[str, list[float]]:
    """Claim and ack every message of ``queue``, the statements taking turns; the ms of
    each claim, per statement name."""
    times: dict[str, list[float]] = {st.name: [] for st in statements}
    acks: list[Lease] = []
    done, turn = 0, 0
    while done < messages:
        statement = statements[turn % len(statements)]
        turn += 1
        # The store sends lean_claim or claim as answers say: both are the one timed.
        s.store.claim_statement = s.store.lean_claim_statement = statement
        start = time.perf_counter()
        batch: list[Claimed] = s.store.claim([queue], [30.0], window, [5], acks=acks)
        times[statement.name].append((time.perf_counter() - start) * 1000.0)
        if not batch:
            break
        acks = [c.token for c in batch]
        done += len(batch)
    s.store.ack(acks)
    if done != messages:
        raise RuntimeError(f"drained {done} of {messages}")
    return times


def drain_cpu(
    s: Any, queue: str, messages: int, window: int, sessions: list[tuple[Any, Statement, int]]
) -> dict[str, list[float]]:
    """As :func:`drain`, but each statement on its own session (as a consumer's: generic
    plan, no JIT, asynchronous commit): the server CPU (µs, that backend's ``/proc``) of
    each claim, per statement name."""
    cpu: dict[str, list[float]] = {st.name: [] for _, st, _ in sessions}
    acks: dict[str, list[Lease]] = {st.name: [] for _, st, _ in sessions}
    done = turn = empty = 0
    while empty < len(sessions):
        conn, statement, pid = sessions[turn % len(sessions)]
        turn += 1
        params = claim_params([queue], [30.0], window, [5], acks[statement.name])
        before = _backend_cpu(pid)
        rows = statement.execute(conn, params, prepare=True)
        cpu[statement.name].append((_backend_cpu(pid) - before) * 1e6)
        batch = read_claim(acks[statement.name], rows)
        if any(c.held for c in batch):
            raise RuntimeError(f"{statement.name} held messages back: plain queues only")
        acks[statement.name] = [c.token for c in batch]
        done += len(batch)
        empty = empty + 1 if not batch else 0
    for _, statement, _ in sessions:
        s.store.ack(acks[statement.name])
    if done != messages:
        raise RuntimeError(f"drained {done} of {messages}")
    return cpu


def _backend_cpu(pid: int) -> float:
    found = sample(pid)
    return float(found["main"]["cpu_s"]) if found is not None else 0.0


@contextlib.contextmanager
def _sessions(s: Any, statements: list[Statement]) -> Iterator[list[tuple[Any, Statement, int]]]:
    opened: list[tuple[Any, Statement, int]] = []
    try:
        for statement in statements:
            conn = psycopg.connect(s.store.connector.conninfo, autocommit=True)
            for setting in ("generic_plans", "no_jit"):
                conn.execute(s.store.q[setting])
            conn.execute("SET synchronous_commit TO off")
            opened.append((conn, statement, int(conn.info.backend_pid)))
        yield opened
    finally:
        for conn, _, _ in opened:
            conn.close()


def measure_cpu(
    pg_url: str, other: str, messages: int, window: int, rounds: int, name: str
) -> list[dict[str, Any]]:
    """Server CPU per claim of this tree's ``name`` and the other's claim, taking turns
    claim by claim over one drain of a plain queue (which goes first alternates)."""
    rows: list[dict[str, Any]] = []
    with scratch(pg_url) as s:
        this = Statement("this", s.store.q[name])
        that = Statement("other", compose(parse_named(other)["claim"], s.schema).as_string(None))
        every: dict[str, list[float]] = {"this": [], "other": []}
        with _sessions(s, [this, that]) as sessions:
            for r in range(rounds):
                queue = f"cpu_{r}"
                s.fill(queue, messages)
                s.sql("ANALYZE {schema}.message")
                order = sessions if r % 2 == 0 else sessions[::-1]
                cpu = drain_cpu(s, queue, messages, window, order)
                for key, us in cpu.items():
                    every[key] += us
                rows.append(_cpu_row(str(r + 1), cpu))
        rows.append(_cpu_row("all", every))
    return rows


def _cpu_row(round_: str, cpu: dict[str, list[float]]) -> dict[str, Any]:
    this, other = fmean(cpu["this"]), fmean(cpu["other"])
    return {
        "keys": 0,
        "round": round_,
        "claims": len(cpu["this"]) + len(cpu["other"]),
        "this_us": this,
        "other_us": other,
        "ratio": this / other,
    }


def measure(
    pg_url: str,
    other: str,
    messages: int,
    keys: list[int],
    window: int,
    rounds: int,
    name: str = "claim",
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with scratch(pg_url) as s:
        this_text = s.store.q[name]
        other_text = compose(parse_named(other)["claim"], s.schema).as_string(None)
        this, that = Statement("this", this_text), Statement("other", other_text)
        for n in keys:
            every: dict[str, list[float]] = {"this": [], "other": []}
            for r in range(rounds):
                queue = f"q{n}_{r}"
                s.sql(
                    "INSERT INTO {schema}.message (queue, payload, okey)"
                    " SELECT %s, %s::json, CASE WHEN %s THEN 'k' || n %% %s END"
                    " FROM generate_series(0, %s - 1) AS n",
                    queue,
                    json.dumps(CELERY_PAYLOAD),
                    n > 0,
                    max(n, 1),
                    messages,
                )
                s.sql("ANALYZE {schema}.message")
                order = [this, that] if r % 2 == 0 else [that, this]
                times = drain(s, queue, messages, window, order)
                for name, ms in times.items():
                    every[name] += ms
                rows.append(_row(n, str(r + 1), times))
            rows.append(_row(n, "all", every))
    return rows


def _row(keys: int, round_: str, times: dict[str, list[float]]) -> dict[str, Any]:
    this, other = median(times["this"]), median(times["other"])
    return {
        "keys": keys,
        "round": round_,
        "claims": len(times["this"]) + len(times["other"]),
        "this_ms": this,
        "other_ms": other,
        "ratio": this / other,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.claim_ab", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--against", required=True, help="another queries.sql")
    parser.add_argument("--pg-url", default=default_pg_url(), help="libpq URL of the server")
    parser.add_argument("--messages", type=int, default=8000, help="per drain (8000)")
    parser.add_argument("--keys", default="0,1000", help="ordering keys per drain (0,1000)")
    parser.add_argument("--window", type=int, default=8, help="messages per claim (8)")
    parser.add_argument("--rounds", type=int, default=3, help="drains per --keys (3)")
    parser.add_argument(
        "--this",
        default="claim",
        help="this tree's statement timed against the other's claim (claim; lean_claim"
        " delivers no keyed message: with --keys 0 only)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="server CPU per claim instead of wall time: each statement on its own session,"
        " its backend's CPU read from /proc (Postgres on this host; a plain queue, --keys"
        " ignored)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    other = Path(args.against).read_text(encoding="utf-8")
    keys = [int(k) for k in args.keys.split(",")]
    if args.cpu:
        rows = measure_cpu(
            args.pg_url, other, args.messages, args.window, args.rounds, name=args.this
        )
    else:
        rows = measure(
            args.pg_url, other, args.messages, keys, args.window, args.rounds, name=args.this
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if args.cpu:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        print(f"{args.messages} messages a drain, claims of {args.window}, acks riding;"
              f" load average {load}")  # fmt: skip
        print("round  claims  this us  other us  this ÷ other   (server CPU per claim, mean)")
        for row in rows:
            print(
                f"{row['round']:>5}  {row['claims']:>6}  {row['this_us']:>7.0f}"
                f"  {row['other_us']:>8.0f}  {row['ratio']:>12.3f}"
            )
        return 0
    print(f"{args.messages} messages a drain, claims of {args.window}, acks riding")
    print("keys   round  claims  this ms  other ms  this ÷ other")
    for row in rows:
        print(
            f"{row['keys']:>5}  {row['round']:>5}  {row['claims']:>6}  {row['this_ms']:>7.3f}"
            f"  {row['other_ms']:>8.3f}  {row['ratio']:>12.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
