"""Ordered delivery on real Celery workers: what ordering keys cost, how fast one key goes.

    python -m benchmarks.ordering [--tasks 10000] [--keys 1000] [--one-key 300]
        [--task-ms 0,5] [--rounds 3] [--concurrency 2] [--json]

One pgq schema for the run. Every measurement gets a queue of its own and a fresh Celery
worker (``benchmarks.ordering_app``: prefork, ``--concurrency``, prefetch multiplier 4,
acks late), started once all its tasks are published (``pg_transport.batch()``, 500 to
a transaction) and stopped once they have all run. A rate is tasks per second from the
first task's end to the last's (the worker's start-up left out).

1. Many keys: ``--tasks`` tasks published round-robin over ``--keys`` ordering keys, and
   the same tasks without keys (the two in turn, in reverse order every other round).
   Reported: both rates and ordered ÷ unordered, in each round and of the medians.
   The same two drains without Celery too, on pgq's store in a throwaway schema (claims
   of the workers' window, 8, with the previous window's acks riding on each, as the
   engine sends them): what the ordering SQL itself costs.
2. One key: ``--one-key`` tasks of a single key, for each task time of ``--task-ms``.
   A key runs one task at a time, so its rate is bounded by 1 / (task time + one round
   trip to Postgres): the round trip is measured in the same run (``SELECT 1`` on an
   open connection, the median of 200). Reported: the rate, the bound, rate ÷ bound,
   and the median hand-off (from a task's end to the start of the next of its key).
   A hand-off is two statements, not one round trip: the ack (whose DELETE promotes the
   key's next message) and the claim that takes it. Both are timed in the same run on
   pgq's store (200 messages of one key, claimed and acked one by one, sessions set up
   as a worker's), giving a second bound, 1 / (task time + claim + ack).
   For reference, the same tasks without a key through a worker of one process with a
   prefetch window of one (``serial``): one task at a time too, each claimed once the
   previous one is acked, with no ordering involved; one key ÷ serial is what ordering
   adds to that.

For every measurement: the worker engine's statement counts per task
(:class:`pg_transport.consume.source.Statements`: claims, rows held back by the claims,
acks riding on claims or sent alone, ``next_due``; sent to the sink when the worker
stops, so they include its few statements after the last task), and a check that every
key ran in publish order (``out_of_order``, which must be 0). Needs Redis on
``--redis-url`` (the timing sink).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any

import psycopg
from celery import Celery

import pg_transport
from benchmarks.app import Sink, make_app
from benchmarks.brokers import default_pg_url, patched_environ
from benchmarks.ordering_app import STEP, statements_key
from benchmarks.phases import PhaseError, in_turn, wait_ready
from benchmarks.scratch import CELERY_PAYLOAD, scratch
from benchmarks.targets import PgqBroker, RedisBroker, Target
from benchmarks.worker import WorkerSpec, start_worker
from pg_transport.message.ordering import ORDERING_KEY

__all__ = ["main", "measure", "parse_args", "round_trip_ms"]

PREFETCH = 4
PUBLISH_BATCH = 500
ROUND_TRIPS = 200
STATEMENT_KINDS = ("claim", "held", "acks_riding", "acks_alone", "ack", "next_due")
UNKEYED = "-"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ordering", description=(__doc__ or "").split("\n\n")[0]
    )
    add = parser.add_argument
    add("--tasks", type=int, default=10_000, help="tasks of the many-keys drains (10000)")
    add("--keys", type=int, default=1000, help="ordering keys of the ordered drain (1000)")
    add("--one-key", type=int, default=300, help="tasks of the one-key runs (300)")
    add("--task-ms", default="0,5", help="task times of the one-key runs, ms (0,5)")
    add("--drain-ms", type=float, default=0.0, help="task time of the many-keys drains (0)")
    add("--rounds", type=int, default=3, help="rounds of every measurement (3)")
    add("--concurrency", type=int, default=2, help="prefork processes of each worker (2)")
    add("--pg-url", default=default_pg_url(), help="Postgres for pgq (libpq URL)")
    add("--redis-url", default="redis://127.0.0.1:6379", help="Redis of the timing sink")
    add("--sink-db", type=int, default=12, help="Redis db of the timing sink")
    add("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        args.task_times = [float(t) for t in args.task_ms.split(",")]
    except ValueError:
        parser.error(f"--task-ms must be numbers separated by commas; got {args.task_ms!r}")
    if min(args.tasks, args.keys, args.one_key, args.rounds, args.concurrency) < 1:
        parser.error("--tasks, --keys, --one-key, --rounds and --concurrency must be >= 1")
    if args.keys > args.tasks or min(args.task_times) < 0 or args.drain_ms < 0:
        parser.error("--keys must not exceed --tasks; task times must not be negative")
    return args


@dataclass
class Run:
    """What every measurement of one run shares."""

    base: Target
    sink_url: str
    concurrency: int
    run_id: str
    made: int = 0

    def queue(self, label: str) -> Target:
        self.made += 1
        return dataclasses.replace(self.base, queue=f"{self.base.queue}_{label}_{self.made}")


def publish(target: Target, tasks: int, keys: int, sleep_ms: float) -> None:
    """``tasks`` step tasks to ``target``'s queue, task n of key ``n % keys`` (no key
    when ``keys`` is 0), in batches."""
    app: Celery = make_app(target.broker_url, target.queue, target.transport_options)
    try:
        for start in range(0, tasks, PUBLISH_BATCH):
            with pg_transport.batch():
                for seq in range(start, min(start + PUBLISH_BATCH, tasks)):
                    key = f"k{seq % keys}" if keys else UNKEYED
                    app.send_task(
                        STEP,
                        args=(key, seq, sleep_ms),
                        headers={ORDERING_KEY: key} if keys else None,
                    )
    finally:
        app.close()


def _wait_done(sink: Sink, worker: Any, count: int, timeout: float) -> None:
    client = sink.client()
    deadline = time.monotonic() + timeout
    while (done := int(client.llen(sink.done_key))) < count:
        if not worker.alive():
            raise PhaseError(f"worker exited (code {worker.proc.returncode}) after {done}")
        if time.monotonic() > deadline:
            raise PhaseError(f"only {done} of {count} tasks ran in {timeout:.0f}s")
        time.sleep(0.05)


def measure(
    run: Run, label: str, tasks: int, keys: int, sleep_ms: float, *, serial: bool = False
) -> dict[str, Any]:
    """Publish, then drain with a fresh worker: rate, order, hand-offs, statements.
    ``serial``: a worker of one process with a prefetch window of one."""
    target = run.queue(label)
    sink = Sink(run.sink_url, f"ordering:{run.run_id}:{target.queue}")
    concurrency, prefetch = (1, 1) if serial else (run.concurrency, PREFETCH)
    spec = WorkerSpec("prefork", concurrency, prefetch, run.sink_url, "benchmarks.ordering_app")
    log = Path(tempfile.mkstemp(prefix=f"pgq-ordering-{label}-", suffix=".log")[1])
    client = sink.client()
    try:
        with patched_environ(target.env):
            publish(target, tasks, keys, sleep_ms)
        worker = start_worker(target, spec, f"ordering-{label}", sink.prefix, log)
        try:
            wait_ready(worker, sink, 0, 60)
            _wait_done(sink, worker, tasks, 120 + tasks * (sleep_ms / 1000.0 + 0.01))
        except PhaseError as exc:
            raise PhaseError(f"{label}: {exc}; worker log: {worker.trouble()}") from exc
        finally:
            worker.stop()
        lines = [_text(raw).split() for raw in client.lrange(sink.done_key, 0, -1)]
        reported = client.lrange(statements_key(sink.prefix), 0, -1)
    finally:
        client.delete(*sink.keys(), statements_key(sink.prefix))
        log.unlink(missing_ok=True)
    done = [(float(s), float(e), key, int(seq)) for s, e, key, seq in lines]
    statements = json.loads(_text(reported[-1])) if reported else {}
    return summarize(done, tasks, statements, serial=serial)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def summarize(
    done: list[tuple[float, float, str, int]],
    tasks: int,
    statements: dict[str, int],
    *,
    serial: bool = False,
) -> dict[str, Any]:
    ends = sorted(e for _, e, _, _ in done)
    span = ends[-1] - ends[0]
    by_key: dict[str, list[tuple[float, float, int]]] = {}
    for started, ended, key, seq in done:
        # (A serial worker's unkeyed tasks: hand-offs from one task to the next.)
        if key != UNKEYED or serial:
            by_key.setdefault(key, []).append((started, ended, seq))
    out_of_order = 0
    handoffs: list[float] = []
    for key, runs in by_key.items():
        runs.sort()  # by start
        seqs = [seq for _, _, seq in runs]
        if key != UNKEYED:
            out_of_order += sum(1 for a, b in pairwise(seqs) if b < a)
        # A key's next task starts after the previous one ended: the hand-off.
        handoffs += [(nxt[0] - prev[1]) * 1000.0 for prev, nxt in pairwise(runs)]
    return {
        "tasks": len(done),
        "duplicates": len(done) - tasks,
        "seconds": span,
        "rate": (len(ends) - 1) / span if span > 0 else 0.0,
        "out_of_order": out_of_order,
        # Tasks of one key running at once (a hand-off below zero): must not happen.
        "overlaps": sum(1 for h in handoffs if h < 0),
        "handoff_p50_ms": median(handoffs) if handoffs else None,
        "statements": statements,
        "per_task": {k: statements.get(k, 0) / tasks for k in STATEMENT_KINDS},
    }


def statement_ms(pg_url: str, count: int = ROUND_TRIPS) -> dict[str, float]:
    """What a key's hand-off costs in statements, timed from here on pgq's own store
    (a throwaway schema, sessions set up as a worker's): ``count`` messages of one key,
    each claimed alone, then acked alone (its DELETE promoting the next by trigger):
    median ms of the claim and of the ack."""
    claims: list[float] = []
    acks: list[float] = []
    with scratch(pg_url) as s:
        s.sql(
            "INSERT INTO {schema}.message (queue, payload, okey)"
            " SELECT 'one', %s::json, 'k' FROM generate_series(1, %s)",
            json.dumps(CELERY_PAYLOAD),
            count,
        )
        for _ in range(count):
            start = time.perf_counter()
            [claimed] = s.store.claim(["one"], [30.0], 1, [5])
            middle = time.perf_counter()
            s.store.ack([claimed.token])
            claims.append((middle - start) * 1000.0)
            acks.append((time.perf_counter() - middle) * 1000.0)
    return {"claim_ms": median(claims), "ack_ms": median(acks)}


def store_drains(pg_url: str, tasks: int, keys: int, turn: int) -> dict[str, float]:
    """The many-keys drains without Celery: ``tasks`` messages, round-robin over
    ``keys`` ordering keys and without keys, consumed from pgq's store as a worker's
    engine does (claims of a prefetch window, the previous window's acks riding on
    each); messages per second of each, and ordered ÷ unordered."""
    rates: dict[str, float] = {}
    with scratch(pg_url) as s:
        for way in in_turn(["unordered", "ordered"], turn):
            s.sql(
                "INSERT INTO {schema}.message (queue, payload, okey)"
                " SELECT %s, %s::json, CASE WHEN %s THEN 'k' || n %% %s END"
                " FROM generate_series(0, %s - 1) AS n",
                way,
                json.dumps(CELERY_PAYLOAD),
                way == "ordered",
                keys,
                tasks,
            )
            s.sql("ANALYZE {schema}.message")
            start = time.perf_counter()
            done = s.consume(way, tasks, 2 * PREFETCH)
            rates[way] = done / (time.perf_counter() - start)
    return {**rates, "ratio": rates["ordered"] / rates["unordered"]}


def round_trip_ms(pg_url: str, count: int = ROUND_TRIPS) -> float:
    """Median ms of ``SELECT 1`` on an open connection (after a few not counted)."""
    times: list[float] = []
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for n in range(count + 10):
            start = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            if n >= 10:
                times.append((time.perf_counter() - start) * 1000.0)
    return median(times)


@contextlib.contextmanager
def pgq_run(args: argparse.Namespace) -> Iterator[Run]:
    broker = PgqBroker(args.pg_url)
    why = broker.check()
    if why is not None:
        raise SystemExit(why)
    sink_url = str(RedisBroker(args.redis_url, args.sink_db).url)
    run_id = uuid.uuid4().hex[:8]
    target = broker.setup(run_id)
    try:
        yield Run(target, sink_url, args.concurrency, run_id)
    finally:
        broker.teardown(target)


def run_rounds(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with pgq_run(args) as run:
        for n in range(args.rounds):
            found: dict[str, Any] = {}
            for way in in_turn(["unordered", "ordered"], n):
                keys = args.keys if way == "ordered" else 0
                found[way] = measure(run, way, args.tasks, keys, args.drain_ms)
            found["ratio"] = found["ordered"]["rate"] / found["unordered"]["rate"]
            found["store"] = store_drains(args.pg_url, args.tasks, args.keys, n)
            found["round_trip_ms"] = round_trip_ms(args.pg_url)
            found["statements_ms"] = statement_ms(args.pg_url)
            handoff = found["statements_ms"]["claim_ms"] + found["statements_ms"]["ack_ms"]
            for t in args.task_times:
                bound = 1000.0 / (t + found["round_trip_ms"])
                floor = 1000.0 / (t + handoff)
                one, serial = (
                    measure(run, f"{way}{t:g}ms", args.one_key, keys, t, serial=keys == 0)
                    for way, keys in (("one", 1), ("serial", 0))
                )
                found[f"one_key_{t:g}ms"] = {
                    **one,
                    "bound": bound,
                    "ratio": one["rate"] / bound,
                    # The bound with a hand-off of an ack and a claim, as timed here.
                    "statement_bound": floor,
                    "statement_ratio": one["rate"] / floor,
                    "serial": serial,
                    "to_serial": one["rate"] / serial["rate"],
                }
            rounds.append(found)
    return {"settings": settings(args), "rounds": rounds, "summary": summary(args, rounds)}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tasks": args.tasks,
        "keys": args.keys,
        "one_key_tasks": args.one_key,
        "task_ms": args.task_times,
        "drain_ms": args.drain_ms,
        "rounds": args.rounds,
        "pool": "prefork",
        "concurrency": args.concurrency,
        "prefetch_multiplier": PREFETCH,
    }


def summary(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(*path: str) -> float:
        values = []
        for found in rounds:
            value: Any = found
            for step in path:
                value = value[step]
            values.append(float(value))
        return median(values)

    result: dict[str, Any] = {
        "ordered_rate": med("ordered", "rate"),
        "unordered_rate": med("unordered", "rate"),
        "ratio": med("ratio"),
        "store_ordered_rate": med("store", "ordered"),
        "store_unordered_rate": med("store", "unordered"),
        "store_ratio": med("store", "ratio"),
        "round_trip_ms": med("round_trip_ms"),
        "claim_ms": med("statements_ms", "claim_ms"),
        "ack_ms": med("statements_ms", "ack_ms"),
        "out_of_order": sum(
            f[w]["out_of_order"] + f[w]["overlaps"]
            for f in rounds
            for w in ("ordered", *(f"one_key_{t:g}ms" for t in args.task_times))
        ),
    }
    for t in args.task_times:
        name = f"one_key_{t:g}ms"
        result[name] = {
            "rate": med(name, "rate"),
            "bound": med(name, "bound"),
            "ratio": med(name, "ratio"),
            "statement_bound": med(name, "statement_bound"),
            "statement_ratio": med(name, "statement_ratio"),
            "handoff_p50_ms": med(name, "handoff_p50_ms"),
            "serial_rate": med(name, "serial", "rate"),
            "serial_handoff_p50_ms": med(name, "serial", "handoff_p50_ms"),
            "to_serial": med(name, "to_serial"),
        }
    return result


def measurements(found: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], float | None]]:
    """A round's measurements as the table lists them: name, figures, ratio."""
    yield "unordered", found["unordered"], None
    yield "ordered", found["ordered"], found["ratio"]
    for name in (k for k in found if k.startswith("one_key_")):
        yield name, found[name], found[name]["ratio"]
        yield name.replace("one_key", "serial"), found[name]["serial"], None


def print_report(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(
        f"pgq ordering: prefork x{s['concurrency']}, prefetch {s['prefetch_multiplier']}, "
        f"{s['rounds']} round(s)"
    )
    print(f"{'round':<6} {'measurement':<16} {'tasks/s':>9} {'ratio':>7} {'hand-off ms':>12}  "
          "claims/task held/task acks alone/task")  # fmt: skip
    for n, found in enumerate(report["rounds"], 1):
        for name, m, ratio in measurements(found):
            handoff = m["handoff_p50_ms"]
            print(
                f"{n:<6} {name:<16} {m['rate']:9.0f} "
                f"{'' if ratio is None else f'{ratio:.2f}':>7} "
                f"{'' if handoff is None else f'{handoff:.2f}':>12}  "
                f"{m['per_task']['claim']:.2f} {m['per_task']['held']:.2f} "
                f"{m['per_task']['acks_alone']:.2f}"
            )
        store = found["store"]
        print(
            f"{n:<6} store alone (no Celery): ordered {store['ordered']:.0f}/s, unordered "
            f"{store['unordered']:.0f}/s, ratio {store['ratio']:.2f}"
        )
        timed = found["statements_ms"]
        print(
            f"{n:<6} round trip (SELECT 1): {found['round_trip_ms']:.3f} ms; one key's claim "
            f"{timed['claim_ms']:.3f} ms, ack {timed['ack_ms']:.3f} ms"
        )
    sm = report["summary"]
    print(
        f"medians: ordered {sm['ordered_rate']:.0f}/s, unordered {sm['unordered_rate']:.0f}/s, "
        f"ordered/unordered {sm['ratio']:.2f}; out of order: {sm['out_of_order']}; store "
        f"alone {sm['store_ordered_rate']:.0f}/s against {sm['store_unordered_rate']:.0f}/s: "
        f"{sm['store_ratio']:.2f}"
    )
    for t in s["task_ms"]:
        one = sm[f"one_key_{t:g}ms"]
        print(
            f"one key, {t:g} ms tasks: {one['rate']:.0f}/s of a bound {one['bound']:.0f}/s "
            f"(1 / ({t:g} ms + {sm['round_trip_ms']:.3f} ms)): {one['ratio']:.2f}; "
            f"of 1 / ({t:g} ms + claim + ack) = {one['statement_bound']:.0f}/s: "
            f"{one['statement_ratio']:.2f}; "
            f"hand-off p50 {one['handoff_p50_ms']:.2f} ms; unkeyed through a window of one "
            f"{one['serial_rate']:.0f}/s (hand-off {one['serial_handoff_p50_ms']:.2f} ms): "
            f"one key / that {one['to_serial']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_rounds(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
