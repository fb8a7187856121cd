"""HA beat: replicas of ``celery beat -S pgq`` with the leader SIGKILLed every minute.

    python -m benchmarks.beat                                  # 3 replicas, 10 minutes
    python -m benchmarks.beat --seconds 120 --kill-every 20 --json

What happens:

* a fresh schema on the test Postgres (``--url``, default ``PGQ_TEST_URL``, the local
  server, or an embedded one) and ``--replicas`` real ``celery beat -S pgq`` processes
  (tick 1 s) with two entries, every 1 s and every 5 s, whose messages wait in the queue
  (no worker: the messages themselves are what is counted);
* every ``--kill-every`` seconds the leading beat's process group is SIGKILLed, the
  time until another beat holds the lease is measured (the database's clock: the kill
  is stamped right after it, the takeover is the new lease's acquired_at), and a
  replacement beat is started, so there are always ``--replicas``;
* after ``--seconds`` every beat is stopped and the messages are counted per entry and
  slot (their ``pgq_beat_entry`` and ``pgq_beat_due`` headers).

Then, for comparison in the same run, the same replicas of Celery's own beat (its file
scheduler, one schedule file each, the same pgq broker) run for ``--stock-seconds``
without kills: each replica sends every slot itself.

Reported per entry: slots sent, sends per slot (must be exactly 1), slots missing between
the first and the last (must be 0: slots missed during a takeover are sent late), the
longest gap between two consecutive sends and the latest send (send time minus due
time); the takeovers; and stock beat's sends per slot. Exit status 0 means every slot was
sent exactly once and none is missing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from tests.acceptance.beats import Beat, start_beat
from tests.acceptance.harness import Env, prepare, wait_for
from tests.pg import drop_schema, find_postgres, new_schema_name

ENTRIES = {
    "every-1s": {"every": 1, "task": "bench.every_1s"},
    "every-5s": {"every": 5, "task": "bench.every_5s"},
}
PERIODS = {"every-1s": 1.0, "every-5s": 5.0}


def rows(env: Env, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(env.pg_url) as conn:
        text = sql.SQL(query).format(schema=sql.Identifier(env.schema))
        return conn.execute(text, params).fetchall()


def leader(env: Env) -> tuple[str, int]:
    found = rows(env, "SELECT holder, term FROM {schema}.beat_leader")
    return (str(found[0][0]), int(found[0][1])) if found else ("", 0)


def run_pgq(env: Env, replicas: int, seconds: float, kill_every: float) -> dict[str, Any]:
    beats = [start_beat(env, ENTRIES) for _ in range(replicas)]
    takeovers: list[float] = []
    started = time.monotonic()
    try:
        wait_for(lambda: leader(env)[1] > 0, 30, "a leader")
        next_kill = started + kill_every
        while time.monotonic() < started + seconds:
            time.sleep(min(0.2, max(0.0, next_kill - time.monotonic())))
            if time.monotonic() < next_kill:
                continue
            next_kill += kill_every
            holder, term = leader(env)
            pid = int(holder.split(":")[-2])
            victims = [b for b in beats if b.proc.pid == pid]
            if not victims:
                continue
            victims[0].kill()
            [(killed_at,)] = rows(env, "SELECT clock_timestamp()")
            beats.remove(victims[0])
            wait_for(lambda term=term: leader(env)[1] > term, 60, "a new leader", step=0.02)
            [(acquired_at,)] = rows(env, "SELECT acquired_at FROM {schema}.beat_leader")
            takeovers.append((acquired_at - killed_at).total_seconds())
            beats.append(start_beat(env, ENTRIES))
    finally:
        for beat in beats:
            beat.kill(signal.SIGTERM)
    elapsed = time.monotonic() - started
    found = rows(
        env,
        "SELECT payload->'headers'->>'pgq_beat_entry', payload->'headers'->>'pgq_beat_due',"
        " enqueued_at FROM {schema}.message",
    )
    return {
        "seconds": round(elapsed, 1),
        "kills": len(takeovers),
        "takeover_s": {
            "max": round(max(takeovers), 3) if takeovers else None,
            "mean": round(sum(takeovers) / len(takeovers), 3) if takeovers else None,
            "all": [round(t, 3) for t in takeovers],
        },
        "entries": {name: per_entry(found, name) for name in ENTRIES},
    }


def per_entry(found: Sequence[tuple[Any, ...]], name: str) -> dict[str, Any]:
    sends = [(datetime.fromisoformat(str(due)), at) for entry, due, at in found if entry == name]
    per_slot = Counter(due for due, _ in sends)
    slots = sorted(per_slot)
    period = PERIODS[name]
    missing = sum(round((b - a).total_seconds() / period) - 1 for a, b in itertools.pairwise(slots))
    times = sorted(at for _, at in sends)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    late = [(at - due).total_seconds() for due, at in sends]
    return {
        "slots": len(slots),
        "sends": len(sends),
        "sends_per_slot": {
            "min": min(per_slot.values(), default=0),
            "max": max(per_slot.values(), default=0),
        },
        "slots_sent_more_than_once": sum(1 for n in per_slot.values() if n > 1),
        "slots_missing": missing,
        "longest_gap_s": round(max(gaps), 3) if gaps else None,
        "latest_send_s": round(max(late), 3) if late else None,
    }


def run_stock(env: Env, replicas: int, seconds: float) -> dict[str, Any]:
    beats: list[Beat] = [start_beat(env, ENTRIES, scheduler=None) for _ in range(replicas)]
    started = time.monotonic()
    try:
        time.sleep(seconds)
    finally:
        for beat in beats:
            beat.kill(signal.SIGTERM)
    elapsed = time.monotonic() - started
    counts = dict(
        rows(env, "SELECT payload->'headers'->>'task', count(*) FROM {schema}.message GROUP BY 1")
    )
    result: dict[str, Any] = {"seconds": round(elapsed, 1), "entries": {}}
    for name, spec in ENTRIES.items():
        sends = int(counts.get(str(spec["task"]), 0))
        slots = elapsed / PERIODS[name]
        result["entries"][name] = {"sends": sends, "sends_per_slot": round(sends / slots, 2)}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.beat", description=__doc__)
    parser.add_argument("--url", help="libpq URL of the test Postgres")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--stock-seconds", type=float, default=60.0)
    parser.add_argument("--json", action="store_true", help="JSON report on stdout")
    args = parser.parse_args(argv)

    pg_url = (args.url or find_postgres()).replace("pgq://", "postgresql://", 1)
    report: dict[str, Any] = {"replicas": args.replicas, "kill_every_s": args.kill_every}
    for phase in ("pgq", "stock"):
        if phase == "stock" and args.stock_seconds <= 0:
            continue
        schema = new_schema_name()
        env = prepare(pg_url, schema)
        try:
            if phase == "pgq":
                report["pgq"] = run_pgq(env, args.replicas, args.seconds, args.kill_every)
            else:
                report["stock"] = run_stock(env, args.replicas, args.stock_seconds)
        finally:
            drop_schema(pg_url, schema)
    passed = all(
        e["sends_per_slot"]["max"] == 1
        and e["sends_per_slot"]["min"] == 1
        and e["slots_missing"] == 0
        for e in report["pgq"]["entries"].values()
    )
    report["passed"] = passed
    if "stock" in report:
        report["stock_vs_pgq_sends_per_slot"] = {
            name: report["stock"]["entries"][name]["sends_per_slot"] for name in ENTRIES
        }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0 if passed else 1


def print_table(report: dict[str, Any]) -> None:
    pgq = report["pgq"]
    print(
        f"pgq beat: {report['replicas']} replicas, {pgq['seconds']} s, leader SIGKILLed "
        f"{pgq['kills']} times; takeover max {pgq['takeover_s']['max']} s, "
        f"mean {pgq['takeover_s']['mean']} s"
    )
    header = ("entry", "slots", "sends/slot", "missing", "longest gap s", "latest s")
    print(
        f"{header[0]:<10}{header[1]:>7}{header[2]:>12}{header[3]:>9}{header[4]:>15}{header[5]:>10}"
    )
    for name, e in pgq["entries"].items():
        per = e["sends_per_slot"]
        spread = str(per["min"]) if per["min"] == per["max"] else f"{per['min']}-{per['max']}"
        print(
            f"{name:<10}{e['slots']:>7}{spread:>12}{e['slots_missing']:>9}"
            f"{e['longest_gap_s']!s:>15}{e['latest_send_s']!s:>10}"
        )
    if "stock" in report:
        stock = report["stock"]
        print(f"celery's own beat, same replicas, {stock['seconds']} s, no kills:")
        for name, e in stock["entries"].items():
            print(f"{name:<10} sends per slot {e['sends_per_slot']} (pgq: 1)")
    print("PASSED" if report["passed"] else "FAILED")


if __name__ == "__main__":
    sys.exit(main())
