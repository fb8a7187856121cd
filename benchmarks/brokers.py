"""One Celery workload on pgq, Redis, RabbitMQ and kombu's SQLAlchemy transport.

    python -m benchmarks.brokers [--tasks N] [--pool prefork --concurrency 2] [--json]

Every reachable broker publishes N no-op tasks from one producer, the brokers taking
turns 500 tasks at a time (publish rate); then, one broker after another, one worker
subprocess runs them all (drain rate, first to last completion); then a fresh worker
per broker, all idle at once, is probed one task at a time, the brokers taking turns
probe by probe (publish→task-start latency p50/p99). A broker that does not answer is
skipped with the reason. With ``--rounds`` the brokers take turns that many times (in
reverse order every other round), so a machine whose speed drifts during the run weighs
on every broker alike. pgq's ratios to the others follow; the whole result is JSON
(stdout with ``--json``; always saved under ``benchmarks/results/`` unless
``--no-save``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import celery
import kombu
from celery import Celery, Task

from benchmarks.app import DRAIN, TASK_NAME, Sink, make_app
from benchmarks.pgbench import run_pgbench, seconds
from benchmarks.phases import (
    PhaseError,
    drain,
    in_turn,
    latency_interleaved,
    probe,
    publish_interleaved,
    wait_ready,
)
from benchmarks.procstat import busy_loops, named, pgq_backends, sample
from benchmarks.report import RATIO_MEANING, combine, format_report, pgbench_ratios, ratios
from benchmarks.targets import (
    AmqpBroker,
    Broker,
    PgqBouncerBroker,
    PgqBroker,
    RedisBroker,
    RedisFsyncBroker,
    SqlaBroker,
    Target,
    mask_url,
)
from benchmarks.worker import ROOT, Worker, WorkerSpec, start_worker

RESULTS = ROOT / "benchmarks" / "results"
BROKERS = ("pgq", "pgq-async", "redis", "redis-fsync", "rabbitmq", "rabbitmq-confirm", "sqla")
# Chosen by name only: pgq behind a PgBouncer of its own, with a direct listening
# session (listen_url) or polling.
EXTRA_BROKERS = ("pgq-bouncer", "pgq-bouncer-poll")
LOCAL_PG = "postgresql://postgres@127.0.0.1:5432/test"
# Once the probe workers are up, let them block waiting for work, so that the latency
# probes meet really idle workers.
SETTLE_SECONDS = 0.5
# Probes per broker sent to a freshly started worker before the counted ones.
WARMUP_PROBES = 2
# Tasks a broker publishes in one turn of the publish phase.
PUBLISH_CHUNK = 500
LOG_TAIL_LINES = 40


def default_pg_url() -> str:
    url = os.environ.get("BENCH_PG_URL") or os.environ.get("PGQ_TEST_URL") or LOCAL_PG
    return url.replace("pgq://", "postgresql://", 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.brokers", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--tasks", type=int, default=10_000, help="tasks published and drained (default 10000)")
    add(
        "--latency-samples",
        type=int,
        default=100,
        help="idle latency probes per round (default 100)",
    )
    add(
        "--rounds",
        type=int,
        default=1,
        help="times every broker is measured, taking turns (default 1)",
    )
    add("--pool", choices=("threads", "prefork"), default="threads", help="worker pool")
    add("--concurrency", type=int, default=4, help="worker concurrency (default 4)")
    add("--prefetch-multiplier", type=int, default=4, help="worker_prefetch_multiplier")
    add(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="N busy-loop processes (nice 0) running through every broker's drain alike "
        "(default 0)",
    )
    add(
        "--brokers",
        default=",".join(BROKERS),
        help=f"subset of {','.join(BROKERS + EXTRA_BROKERS)} (default: {','.join(BROKERS)})",
    )
    add("--pg-url", default=default_pg_url(), help="Postgres for pgq and sqla (libpq URL)")
    add("--redis-url", default="redis://127.0.0.1:6379", help="Redis server (broker and sink)")
    add("--redis-db", type=int, default=14, help="Redis db of the Redis broker (flushed)")
    add("--sink-db", type=int, default=15, help="Redis db of the timing sink")
    add(
        "--redis-fsync-dir",
        type=Path,
        help="where redis-fsync keeps its data (default: the temporary directory; "
        "best on the disk of Postgres's WAL)",
    )
    add("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//", help="RabbitMQ")
    add("--phase-timeout", type=float, default=600.0, help="limit of publish and of drain, s")
    add("--probe-timeout", type=float, default=10.0, help="limit of one latency probe, s")
    add(
        "--probe-gap",
        type=float,
        default=1.0,
        help="longest random idle gap before a latency probe, s (default 1.0: one polling "
        "interval, so polling brokers are met at a random point of their rhythm)",
    )
    add("--log-dir", type=Path, help="worker logs (default benchmarks/results/<timestamp>-<id>/)")
    add("--json", action="store_true", help="print the JSON result on stdout (table on stderr)")
    add("--output", type=Path, help="JSON file (default benchmarks/results/<timestamp>.json)")
    add("--no-save", action="store_true", help="do not write the JSON file")
    add(
        "--pgbench-seconds",
        type=seconds,
        default=5.0,
        help="length of the pgbench single-row INSERT run (0: skip it)",
    )
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tasks < 2:
        parser.error(f"--tasks must be at least 2 (a rate needs two timestamps), got {args.tasks}")
    if min(args.latency_samples, args.concurrency, args.prefetch_multiplier, args.rounds) < 1:
        parser.error(
            "--latency-samples, --concurrency, --prefetch-multiplier and --rounds must be >= 1"
        )
    if args.background_load < 0:
        parser.error(f"--background-load must be >= 0, got {args.background_load}")
    if args.phase_timeout <= 0 or args.probe_timeout <= 0 or args.probe_gap < 0:
        parser.error("--phase-timeout and --probe-timeout must be > 0, --probe-gap >= 0")
    known = BROKERS + EXTRA_BROKERS
    unknown = set(args.brokers.split(",")) - set(known)
    if unknown:
        parser.error(f"unknown broker(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")


def make_brokers(args: argparse.Namespace) -> list[Broker]:
    every: dict[str, Broker] = {
        "pgq": PgqBroker(args.pg_url),
        "pgq-async": PgqBroker(args.pg_url, "pgq-async", {"durable_publish": False}),
        "redis": RedisBroker(args.redis_url, args.redis_db),
        "redis-fsync": RedisFsyncBroker(args.redis_fsync_dir),
        "rabbitmq": AmqpBroker(args.amqp_url),
        "rabbitmq-confirm": AmqpBroker(args.amqp_url, confirm=True),
        "sqla": SqlaBroker(args.pg_url),
        "pgq-bouncer": PgqBouncerBroker(args.pg_url, "pgq-bouncer", listen=True),
        "pgq-bouncer-poll": PgqBouncerBroker(args.pg_url, "pgq-bouncer-poll", listen=False),
    }
    return [every[name] for name in BROKERS + EXTRA_BROKERS if name in args.brokers.split(",")]


def sink_url(args: argparse.Namespace) -> str:
    return str(RedisBroker(args.redis_url, args.sink_db).url)


@contextlib.contextmanager
def patched_environ(extra: Mapping[str, str]) -> Iterator[None]:
    """The target's environment in this process too: pgq lets PGQ_* override options,
    so the publisher must see the same PGQ_SCHEMA as the worker."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Run:
    """One invocation: its id, options, output streams and result directory."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.id = uuid.uuid4().hex[:10]
        self.stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.log_dir: Path = args.log_dir or self._default_log_dir()
        self.spec = WorkerSpec(
            args.pool, args.concurrency, args.prefetch_multiplier, sink_url(args)
        )
        self.out: TextIO = sys.stderr if args.json else sys.stdout

    def _default_log_dir(self) -> Path:
        if self.args.no_save:
            return Path(tempfile.mkdtemp(prefix=f"pgq-bench-{self.id}-"))
        return RESULTS / f"{self.stamp}-{self.id}"

    def say(self, message: str) -> None:
        # Progress always goes to stderr: stdout carries the table or the JSON.
        print(message, file=sys.stderr, flush=True)

    def sink(self, broker: Broker) -> Sink:
        return Sink(self.spec.sink_url, f"bench:{self.id}:{broker.name}")


@dataclass
class Entry:
    """One broker in one round: where it publishes, its sink, its result so far."""

    broker: Broker
    target: Target
    app: Celery
    sink: Sink
    result: dict[str, Any]

    @property
    def task(self) -> Task:
        return self.app.tasks[TASK_NAME]

    @property
    def ok(self) -> bool:
        return bool(self.result["status"] == "ok")

    def publish(self, count: int) -> None:
        """``count`` drain tasks from this process, the broker's environment set."""
        task = self.task
        with patched_environ(self.target.env):
            for seq in range(count):
                task.apply_async(args=(DRAIN, seq, 0.0))


def fail(run: Run, name: str, result: dict[str, Any], exc: BaseException) -> None:
    """Record a failure in ``result``; the run goes on with the other brokers."""
    result.update(
        status="failed",
        reason=f"{type(exc).__name__}: {exc}",
        traceback=traceback.format_exception(exc)[-8:],
    )
    run.say(f"[{name}] FAILED: {result['reason']}")


def prepare(run: Run, broker: Broker, round_number: int) -> tuple[dict[str, Any], Entry | None]:
    """Check and set up one broker for a round: its result, and an entry to measure
    (None when it is skipped or its setup failed)."""
    reason = broker.check()
    if reason:
        run.say(f"[{broker.name}] skipped: {reason}")
        return {"status": "skipped", "reason": reason}, None
    result: dict[str, Any] = {"status": "ok", "loadavg": {}}
    try:
        # A queue (schema, database) of its own per round: a round never meets what
        # the last one left or deleted.
        target = broker.setup(run.id if round_number == 1 else f"{run.id}r{round_number}")
    except Exception as exc:  # e.g. no right to create the scratch database
        reason = f"setup failed: {type(exc).__name__}: {exc}"
        run.say(f"[{broker.name}] FAILED: {reason}")
        return {**result, "status": "failed", "reason": reason}, None
    result.update(url=target.display_url, queue=target.queue)
    app = make_app(
        target.broker_url, target.queue, target.transport_options, run.args.prefetch_multiplier
    )
    sink = run.sink(broker)
    sink.client().delete(*sink.keys())
    return result, Entry(broker, target, app, sink, result)


@contextlib.contextmanager
def load_during(phase: str, entries: list[Entry]) -> Iterator[None]:
    """The machine's load average when ``phase`` began and when it ended (and those
    times), in each entry's result under ``loadavg``: the drain's is its broker's alone
    (the brokers drain one after another); publish and latency, where the brokers take
    turns, share their figures."""
    began, before = time.time(), os.getloadavg()
    try:
        yield
    finally:
        found = {"before": before, "after": os.getloadavg(), "from": began, "to": time.time()}
        for entry in entries:
            entry.result["loadavg"][phase] = found


def publish_all(run: Run, entries: list[Entry]) -> None:
    """The publish rates, every broker taking turns (see :func:`publish_interleaved`)."""
    args = run.args
    names = ", ".join(e.broker.name for e in entries)
    run.say(f"[publish] {args.tasks} tasks each, {PUBLISH_CHUNK} at a time in turn: {names}")
    timeout = args.phase_timeout * max(len(entries), 1)
    with load_during("publish", entries):
        outcome = publish_interleaved(
            {e.broker.name: e.publish for e in entries}, args.tasks, PUBLISH_CHUNK, timeout
        )
    for entry in entries:
        found = outcome[entry.broker.name]
        if isinstance(found, PhaseError):
            fail(run, entry.broker.name, entry.result, found)
        else:
            entry.result["publish"] = found


def launch(run: Run, entry: Entry, purpose: str) -> tuple[Worker, float]:
    """Start one worker on the entry's queue; it and when it was spawned."""
    target = entry.target
    spawned_at = time.time()
    worker = start_worker(
        target,
        run.spec,
        f"bench-{entry.broker.name}-{purpose}-{target.queue}",
        entry.sink.prefix,
        run.log_dir / f"{entry.broker.name}-{target.queue}-{purpose}.log",
    )
    return worker, spawned_at


def drain_one(run: Run, entry: Entry) -> None:
    """Drain the published tasks with one worker, started for it and stopped after."""
    args, result = run.args, entry.result
    loaded = f", {args.background_load} busy loops beside it" if args.background_load else ""
    run.say(
        f"[{entry.broker.name}] draining with one worker ({args.pool} x{args.concurrency}){loaded}"
    )
    # The busy loops first: the load average recorded for the drain includes them.
    with busy_loops(args.background_load), load_during("drain", [entry]):
        worker, spawned_at = launch(run, entry, "drain")
        try:
            result["drain"] = drain(
                worker,
                entry.sink,
                args.tasks,
                args.phase_timeout,
                spawned_at,
                sample=_sampler(run, entry, worker),
            )
            result["drain"]["background_load"] = args.background_load
        finally:
            result["worker"] = describe_worker(worker, entry.sink, spawned_at, ready=0)


def _sampler(run: Run, entry: Entry, worker: Worker) -> Callable[[], dict[str, Any] | None]:
    """A reading of the drain worker's CPU and context switches, and its broker's
    server processes on this host: pgq's backends (found at the first reading, once the
    worker has connected), RabbitMQ's beam.smp."""
    server: list[int] | None = None

    def read() -> dict[str, Any] | None:
        nonlocal server
        if server is None:
            server = []
            name = entry.broker.name
            try:
                if name.startswith("pgq") and "bouncer" not in name:
                    server = pgq_backends(run.args.pg_url, worker.proc.pid)
                elif name.startswith("rabbitmq"):
                    server = named("beam.smp")
            except Exception as exc:  # a figure left out, never a failed drain
                run.say(f"[{name}] server processes not found: {exc}")
        return sample(worker.proc.pid, server)

    return read


def probe_all(run: Run, entries: list[Entry]) -> None:
    """Idle latency: a fresh worker per broker, all of them idle at once, probed in
    turn (see :func:`latency_interleaved`)."""
    if not entries:
        return
    args = run.args
    names = ", ".join(e.broker.name for e in entries)
    run.say(f"[latency] {args.latency_samples} idle probes each, in turn: {names}")
    workers: dict[str, tuple[Worker, float]] = {}
    probes: dict[str, Callable[[int], tuple[float, float]]] = {}
    try:
        for entry in entries:
            name = entry.broker.name
            try:
                seen = int(entry.sink.client().llen(entry.sink.ready_key))
                worker, _ = workers[name] = launch(run, entry, "probe")
                wait_ready(worker, entry.sink, seen, args.phase_timeout)
            except Exception as exc:  # any failure is reported, never fatal to others
                fail(run, name, entry.result, exc)
                continue
            probes[name] = _prober(run, entry, worker)
        # Let every worker settle into waiting for work before the first probe.
        time.sleep(SETTLE_SECONDS)
        with load_during("latency", [e for e in entries if e.broker.name in probes]):
            outcome = latency_interleaved(
                probes, args.latency_samples, args.probe_gap, warmup=WARMUP_PROBES
            )
        for entry in entries:
            found = outcome.get(entry.broker.name)
            if isinstance(found, PhaseError):
                fail(run, entry.broker.name, entry.result, found)
            elif found is not None:
                entry.result["latency"] = found
    finally:
        for entry in entries:
            if entry.broker.name in workers:
                worker, spawned_at = workers[entry.broker.name]
                entry.result["probe_worker"] = describe_worker(
                    worker, entry.sink, spawned_at, ready=-1
                )


def _prober(run: Run, entry: Entry, worker: Worker) -> Callable[[int], tuple[float, float]]:
    def one(seq: int) -> tuple[float, float]:
        with patched_environ(entry.target.env):
            return probe(entry.task, worker, entry.sink, seq, run.args.probe_timeout)

    return one


def describe_worker(worker: Worker, sink: Sink, spawned_at: float, *, ready: int) -> dict[str, Any]:
    """Stop the worker; its exit, start-up time (its entry ``ready`` of the sink's ready
    list) and the trouble in its log."""
    stamp = sink.client().lindex(sink.ready_key, ready)
    code = worker.stop()
    # pgq's worker reports its consumer's statements as it shuts down (benchmarks.app).
    counts = sink.client().lpop(sink.engine_key)
    return {
        **({"statements": json.loads(counts)} if isinstance(counts, (bytes, str)) else {}),
        "log": str(worker.log),
        "exit_code": code,
        "ready_seconds": float(stamp) - spawned_at if stamp is not None else None,
        "trouble": worker.trouble(),
        "log_tail": worker.output().splitlines()[-LOG_TAIL_LINES:],
    }


def finish(entry: Entry) -> None:
    """Close the publisher, clear the sink, tear the broker's scratch state down."""
    result = entry.result
    try:
        entry.app.close()
        entry.sink.client().delete(*entry.sink.keys())
    finally:
        try:
            entry.broker.teardown(entry.target)
        except Exception as exc:  # report and go on: the next broker still runs
            result["teardown_error"] = f"{type(exc).__name__}: {exc}"
    if entry.ok:
        # A success keeps the workers' trouble lines; only a failure needs a log tail.
        for key in ("worker", "probe_worker"):
            if key in result:
                result[key].pop("log_tail", None)


def run_round(run: Run, brokers: list[Broker], round_number: int) -> dict[str, dict[str, Any]]:
    """Every broker once: publish (in turn), drain one after another, probe (in turn)."""
    results: dict[str, dict[str, Any]] = {}
    entries: list[Entry] = []
    try:
        for broker in brokers:
            results[broker.name], entry = prepare(run, broker, round_number)
            if entry is not None:
                entries.append(entry)
        publish_all(run, entries)
        for entry in entries:
            if not entry.ok:
                continue
            try:
                drain_one(run, entry)  # publishes nothing: the worker gets target.env
            except Exception as exc:  # any failure is reported, never fatal to others
                fail(run, entry.broker.name, entry.result, exc)
        probe_all(run, [entry for entry in entries if entry.ok])
    finally:
        for entry in entries:
            finish(entry)
    return results


def in_rounds(
    run: Run,
    brokers: list[Broker],
    one_round: Callable[[Run, list[Broker], int], dict[str, dict[str, Any]]],
) -> list[dict[str, dict[str, Any]]]:
    """``one_round(run, brokers, number)`` for each of ``--rounds`` rounds, the brokers
    in reverse order every other round: its results, round by round."""
    rounds = []
    for number in range(run.args.rounds):
        if run.args.rounds > 1:
            run.say(f"round {number + 1} of {run.args.rounds}")
        rounds.append(one_round(run, list(in_turn(brokers, number)), number + 1))
    return rounds


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    # Read-only queries; --no-optional-locks keeps git from refreshing the index.
    return subprocess.run(
        ["git", "--no-optional-locks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )


def code_version() -> dict[str, Any]:
    """Which pgq was measured: the commit, and whether the transport had local edits."""
    try:
        head = _git("rev-parse", "HEAD").stdout.strip() or None
        dirty = _git("diff", "--quiet", "HEAD", "--", "pg_transport").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "pg_transport_modified": None}
    return {"commit": head, "pg_transport_modified": dirty}


def host_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "loadavg": os.getloadavg(),
    }


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tasks": args.tasks,
        "rounds": args.rounds,
        "latency_samples": args.latency_samples,
        "pool": args.pool,
        "concurrency": args.concurrency,
        "prefetch_multiplier": args.prefetch_multiplier,
        "background_load": args.background_load,
        "acks_late": True,
        "probe_gap_max_s": args.probe_gap,
        "sink": f"{mask_url(sink_url(args))} (Redis RPUSH per task)",
        "pgq_environment": {k: v for k, v in os.environ.items() if k.startswith("PGQ_")},
    }


def save(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def show(run: Run, report: dict[str, Any], table: str, default_path: Path) -> None:
    """Save the report (``--output``, else ``default_path``; not with ``--no-save``),
    print the table, and the JSON too with ``--json``."""
    args = run.args
    if not args.no_save:
        path = args.output or default_path
        save(report, path)
        run.say(f"saved {path}")
    print(table, file=run.out, flush=True)
    if args.json:
        print(json.dumps(report, indent=2), flush=True)


def sink_unreachable(args: argparse.Namespace) -> str | None:
    return RedisBroker(args.redis_url, args.sink_db).check()


def begin(argv: list[str] | None) -> Run | None:
    """The run the arguments ask for; None (the reason printed) where the timing sink
    does not answer."""
    args = parse_args(argv)
    reason = sink_unreachable(args)
    if reason:
        print(f"cannot run: the timing sink needs Redis. {reason}", file=sys.stderr)
        return None
    return Run(args)


def main(argv: list[str] | None = None) -> int:
    run = begin(argv)
    if run is None:
        return 2
    args = run.args
    started = dt.datetime.now(dt.timezone.utc)
    # Before the run: the load other work puts on the machine, not the benchmark's own.
    config = {**build_config(args), **host_info(), **code_version()}
    brokers_in_order = make_brokers(args)
    rounds = in_rounds(run, brokers_in_order, run_round)
    brokers = combine(rounds, [broker.name for broker in brokers_in_order])
    pgbench: dict[str, Any] = {"status": "skipped", "reason": "--pgbench-seconds 0"}
    if args.pgbench_seconds > 0:
        run.say(f"[pgbench] single-row INSERT, 1 client, {args.pgbench_seconds:.0f} s")
        pgbench = run_pgbench(args.pg_url, args.pgbench_seconds)
    report: dict[str, Any] = {
        "run_id": run.id,
        "started_at": started.isoformat(),
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": [sys.executable, "-m", "benchmarks.brokers", *(argv or sys.argv[1:])],
        "config": config,
        "brokers": brokers,
        "pgbench": pgbench,
        "ratios": ratios(brokers),
        "ratios_async": ratios(brokers, reference="pgq-async"),
        "round_ratios": [ratios(r) for r in rounds] if args.rounds > 1 else [],
        "ratios_to_pgbench": pgbench_ratios(brokers, pgbench),
        "ratio_meaning": RATIO_MEANING,
    }
    show(run, report, format_report(report), RESULTS / f"{run.stamp}.json")
    return 1 if any(b["status"] == "failed" for b in brokers.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
