"""Chaos soak: real workers drain many tasks while they are SIGKILLed and their sessions cut.

    python -m benchmarks.soak                        # 20,000 tasks, 2 workers, vt 5 s
    python -m benchmarks.soak --tasks 3000 --json    # smaller; JSON report on stdout

What happens:

* a fresh schema on the test Postgres (``--url``, default ``PGQ_TEST_URL``, the local
  server, or an embedded one; ``--throwaway-cluster`` starts one of its own) holds the
  queue and ``task_runs``, where every run of ``tests.acceptance.soak_app.mark``
  records its task id, worker node and server time, then works ``--task-ms``;
* publisher threads send ``--tasks`` tasks while ``--workers`` celery workers
  (``acks_late``, ``--pool``/``--concurrency``/``--prefetch``) drain them;
* a kill thread SIGKILLs a random worker's process group every ``--kill-every`` seconds
  (randomised 0.5x-1.5x) and starts a replacement under a new node name;
* a terminate thread runs ``pg_terminate_backend`` on every ``pgq:<pid>`` session of a
  random worker every ``--terminate-every`` seconds;
* every kill and termination is recorded in ``chaos_events`` with the server's time.

Chaos stops once every task has run at least once; then the run waits for the message
table to empty (a killed worker's messages come back only when their lease lapses, so
the default vt here is 5 s, ``PGQ_VISIBILITY_TIMEOUT=5`` in the workers, not 30 s).
The whole run is bounded by ``--max-seconds``.

The accounting: a run of a task beyond its first is a duplicate. It is *explained by
a kill* when an earlier run of the same task started on a worker incarnation that was
later SIGKILLed (before the duplicate started): the kill lost that run's ack. It is
*explained by a termination* (only when no kill explains it) when an earlier run's
worker had its sessions terminated between that run's start and the duplicate's start.
Anything else is unexplained and fails the run, as do a task that never ran, a message
left in the queue, or anything in dead_letter. Exit status 0 means the run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from tests.acceptance.cluster import throwaway_cluster
from tests.acceptance.harness import Env, Worker, prepare, start_worker
from tests.acceptance.soak_app import MARK, prepare_runs
from tests.pg import drop_schema, find_postgres

SOAK_APP = "tests.acceptance.soak_app"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo"])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=4, help="worker_prefetch_multiplier")
    parser.add_argument(
        "--task-ms",
        type=float,
        default=10.0,
        help="each task works this long after recording its run",
    )
    parser.add_argument("--vt", type=float, default=5.0, help="visibility timeout (s)")
    parser.add_argument("--kill-every", type=float, default=6.0, help="mean seconds")
    parser.add_argument("--terminate-every", type=float, default=4.0, help="mean seconds")
    parser.add_argument("--publishers", type=int, default=2, help="publisher threads")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="hard bound")
    parser.add_argument("--url", default=None, help="postgresql:// URL of the server")
    parser.add_argument(
        "--throwaway-cluster",
        action="store_true",
        help="run on a cluster of its own (initdb on a free port), not --url",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    parser.add_argument("--json", action="store_true", help="JSON report on stdout")
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()


class Recorder:
    """The script's own connection: chaos events and progress queries."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.lock = threading.Lock()
        self.conn = psycopg.connect(env.pg_url, autocommit=True, application_name="soak-chaos")

    def query(self, text: str, *params: Any) -> list[tuple[Any, ...]]:
        composed = sql.SQL(text).format(schema=sql.Identifier(self.env.schema))
        with self.lock:
            return self.conn.execute(composed, params).fetchall()

    def scalar(self, text: str, *params: Any) -> Any:
        rows = self.query(text, *params)
        return rows[0][0] if rows else None

    def event(self, kind: str, node: str, pid: int, detail: str = "") -> datetime:
        at: datetime = self.scalar(
            "INSERT INTO {schema}.chaos_events (kind, node, pid, detail)"
            " VALUES (%s, %s, %s, %s) RETURNING at",
            kind,
            node,
            pid,
            detail,
        )
        return at

    def close(self) -> None:
        self.conn.close()


@dataclass
class Slot:
    index: int
    generation: int = 0
    worker: Worker | None = None  # None while being replaced

    @property
    def name(self) -> str:
        return f"soak{self.index}g{self.generation}"


class Fleet:
    """The workers, each slot replaced under a new node name after a kill."""

    def __init__(self, env: Env, args: argparse.Namespace, recorder: Recorder) -> None:
        self.env = env
        self.args = args
        self.recorder = recorder
        self.slots = [Slot(i) for i in range(args.workers)]
        self.lock = threading.Lock()
        self.logs: list[str] = []
        self.starts = 0

    def start(self, slot: Slot) -> None:
        worker = start_worker(
            self.env,
            slot.name,
            app=SOAK_APP,
            pool=self.args.pool,
            concurrency=self.args.concurrency,
            environ={
                "PGQ_VISIBILITY_TIMEOUT": str(self.args.vt),
                "TEST_PREFETCH": str(self.args.prefetch),
                "TEST_ACKS_LATE": "1",
            },
        )
        self.recorder.event("start", slot.name, worker.proc.pid)
        with self.lock:
            slot.worker = worker
            self.logs.append(str(worker.log))
            self.starts += 1

    def ready(self) -> list[Slot]:
        with self.lock:
            return [s for s in self.slots if s.worker is not None]

    def kill_and_replace(self, slot: Slot) -> None:
        with self.lock:
            worker, slot.worker = slot.worker, None
        if worker is None:
            return
        worker.kill()
        worker.proc.wait(30)
        self.recorder.event("kill", slot.name, worker.proc.pid)
        slot.generation += 1
        self.start(slot)

    def terminate(self, slot: Slot) -> int:
        with self.lock:
            worker = slot.worker
        if worker is None:
            return 0
        with psycopg.connect(self.env.pg_url, autocommit=True) as admin:
            row = admin.execute(
                "WITH victims AS MATERIALIZED (SELECT pid FROM pg_stat_activity"
                " WHERE application_name = %s OR application_name LIKE %s)"
                " SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000))"
                " FROM victims",
                [f"pgq:{worker.proc.pid}", f"pgq:{worker.proc.pid}:%"],
            ).fetchone()
        count = int(row[0]) if row else 0
        self.recorder.event("terminate", slot.name, worker.proc.pid, str(count))
        return count

    def workers(self) -> list[Worker]:
        with self.lock:
            return [s.worker for s in self.slots if s.worker is not None]

    def stop(self) -> None:
        for worker in self.workers():
            worker.stop()


@dataclass
class Chaos:
    kills: int = 0
    terminations: int = 0
    sessions_terminated: int = 0
    errors: list[str] = field(default_factory=list)


def chaos_loop(
    action: str,
    fleet: Fleet,
    every: float,
    stop: threading.Event,
    rng: random.Random,
    chaos: Chaos,
) -> None:
    while not stop.wait(every * rng.uniform(0.5, 1.5)):
        slots = fleet.ready()
        if not slots:
            continue
        slot = rng.choice(slots)
        try:
            if action == "kill":
                fleet.kill_and_replace(slot)
                chaos.kills += 1
            else:
                chaos.sessions_terminated += fleet.terminate(slot)
                chaos.terminations += 1
        except Exception as exc:  # reported, and the run fails: chaos must not die quietly
            chaos.errors.append(f"{action} {slot.name}: {exc!r}")
            log(f"chaos {action} failed: {exc!r}")


def publish(env: Env, names: range, threads: int, seconds: float) -> list[str]:
    """Send one task per number in ``names`` from ``threads`` publishers; their ids."""
    client = env.client()
    ids: list[list[str]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def part(k: int) -> None:
        try:
            with (
                client.connection_for_write() as conn,
                client.producer_or_acquire(client.amqp.Producer(conn)) as producer,
            ):
                for n in names[k::threads]:
                    sent = client.send_task(MARK, args=[f"s{n}", seconds], producer=producer)
                    ids[k].append(sent.id)
        except BaseException as exc:
            errors.append(exc)
            raise

    pubs = [threading.Thread(target=part, args=(k,), name=f"publisher-{k}") for k in range(threads)]
    for thread in pubs:
        thread.start()
    for thread in pubs:
        thread.join()
    if errors:
        raise errors[0]
    return [i for chunk in ids for i in chunk]


@dataclass
class Accounting:
    tasks: int
    published: int
    ran: int
    never_ran: int
    runs: int
    duplicates: int
    explained_by_kills: int
    explained_by_terminations: int
    unexplained: int
    kills: int
    terminations: int
    sessions_terminated: int
    worker_starts: int
    failed_acks_logged: int
    messages_left: int
    dead_letters: int
    publish_seconds: float
    wall_seconds: float
    errors: list[str]
    unexplained_examples: list[dict[str, Any]]
    settings: dict[str, Any]
    passed: bool = False


Run = tuple[str, str, datetime]  # task id, worker node (name before '@'), start time
Event = tuple[str, str, datetime]  # kind ("kill", "terminate", "start"), node, time


def classify(
    runs: Sequence[Run], events: Sequence[Event], ids: Sequence[str]
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Classify every run beyond a task's first: explained by a kill, a termination, or not.

    ``runs`` in the order they were recorded. A duplicate is explained by a kill when an
    earlier run of its task was on a worker killed at or after that run's start and at
    or before the duplicate's start; by a termination likewise (checked only when no
    kill explains it). Returns the counts and the unexplained duplicates.
    """
    kills: dict[str, list[datetime]] = defaultdict(list)
    terms: dict[str, list[datetime]] = defaultdict(list)
    for kind, node, at in events:
        if kind == "kill":
            kills[node].append(at)
        elif kind == "terminate":
            terms[node].append(at)
    by_task: dict[str, list[tuple[str, datetime]]] = defaultdict(list)
    for task_id, node, at in runs:
        by_task[task_id].append((node, at))
    by_kill = by_term = 0
    unexplained: list[dict[str, Any]] = []
    for task_id, task_runs in by_task.items():
        for k in range(1, len(task_runs)):
            _, dup_at = task_runs[k]
            earlier = task_runs[:k]
            if any(at <= t <= dup_at for node, at in earlier for t in kills[node]):
                by_kill += 1
            elif any(at <= t <= dup_at for node, at in earlier for t in terms[node]):
                by_term += 1
            else:
                unexplained.append(
                    {
                        "task_id": task_id,
                        "runs": [{"node": n, "at": a.isoformat()} for n, a in task_runs],
                    }
                )
    per_id = Counter(r[0] for r in runs)
    counts = {
        "published": len(ids),
        "ran": len(set(per_id) & set(ids)),
        "never_ran": len(set(ids) - set(per_id)),
        "runs": len(runs),
        "duplicates": sum(n - 1 for n in per_id.values()),
        "explained_by_kills": by_kill,
        "explained_by_terminations": by_term,
        "unexplained": len(unexplained),
    }
    return counts, unexplained


def account(recorder: Recorder, ids: Sequence[str]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """:func:`classify` what the run recorded."""
    runs = recorder.query(
        "SELECT task_id, split_part(node, '@', 1), at FROM {schema}.task_runs ORDER BY seq"
    )
    events = recorder.query("SELECT kind, node, at FROM {schema}.chaos_events ORDER BY seq")
    return classify(
        [(str(r[0]), str(r[1]), r[2]) for r in runs],
        [(str(e[0]), str(e[1]), e[2]) for e in events],
        ids,
    )


def wait_until(predicate: Any, deadline: Deadline, step: float = 0.5) -> bool:
    """Poll an outcome until it holds or the run's deadline passes."""
    while not predicate():
        if deadline.left() <= 0:
            return False
        time.sleep(step)
    return True


def run(args: argparse.Namespace) -> Accounting:
    if not args.throwaway_cluster:
        return run_on(args, args.url or find_postgres())
    with throwaway_cluster() as cluster:
        log(f"throwaway cluster on port {cluster.port} in {cluster.root}")
        return run_on(args, cluster.url())


def run_on(args: argparse.Namespace, url: str) -> Accounting:
    rng = random.Random(args.seed)
    started = time.monotonic()
    deadline = Deadline(args.max_seconds)
    schema = "pgq_soak_" + uuid.uuid4().hex[:10]
    env = prepare(url, schema)
    prepare_runs(url, schema)
    recorder = Recorder(env)
    fleet = Fleet(env, args, recorder)
    chaos = Chaos()
    stop = threading.Event()
    published: list[str] = []
    publish_seconds = 0.0
    threads: list[threading.Thread] = []
    try:
        log(f"schema {schema} on {env.broker_url}; publishing {args.tasks} tasks")
        # The first task alone, before anything else runs: it declares the exchange and
        # the queue, which the publishers and the workers then find (see the report on
        # concurrent declare_exchange).
        seconds = args.task_ms / 1000
        published.append(env.client().send_task(MARK, args=["s0", seconds]).id)
        result: dict[str, Any] = {}

        def publisher() -> None:
            t0 = time.monotonic()
            try:
                published.extend(publish(env, range(1, args.tasks), args.publishers, seconds))
            except Exception as exc:
                result["error"] = exc
            result["seconds"] = time.monotonic() - t0

        pub = threading.Thread(target=publisher, name="publish")
        pub.start()
        for slot in fleet.slots:
            fleet.start(slot)
        log(
            f"{args.workers} workers ready; chaos on (kill ~{args.kill_every}s, "
            f"terminate ~{args.terminate_every}s, vt {args.vt}s)"
        )
        threads += [
            threading.Thread(
                target=chaos_loop,
                name=f"chaos-{action}",
                args=(action, fleet, every, stop, rng, chaos),
            )
            for action, every in (("kill", args.kill_every), ("terminate", args.terminate_every))
        ]
        for thread in threads:
            thread.start()

        def all_ran() -> bool:
            if "error" in result:
                return True  # nothing more is coming: account for what there is
            done = recorder.scalar("SELECT count(DISTINCT task_id) FROM {schema}.task_runs")
            return bool(done >= args.tasks)

        if not wait_until(all_ran, deadline):
            chaos.errors.append(f"not every task ran within --max-seconds {args.max_seconds}")
        stop.set()
        for thread in threads:
            thread.join()
        pub.join(max(deadline.left(), 1))
        publish_seconds = result.get("seconds", 0.0)
        if "error" in result:
            chaos.errors.append(f"publishing failed: {result['error']!r}")
        log(
            f"chaos off after {chaos.kills} kills and "
            f"{chaos.terminations} terminations; waiting for the queue to empty"
        )
        if not wait_until(
            lambda: recorder.scalar("SELECT count(*) FROM {schema}.message") == 0, deadline
        ):
            chaos.errors.append(f"the queue did not empty within --max-seconds {args.max_seconds}")
        failed_acks = sum(
            Path(p).read_text(errors="replace").count("Couldn't ack") for p in fleet.logs
        )
        counts, unexplained = account(recorder, published)
        report = Accounting(
            tasks=args.tasks,
            kills=chaos.kills,
            terminations=chaos.terminations,
            sessions_terminated=chaos.sessions_terminated,
            worker_starts=fleet.starts,
            failed_acks_logged=failed_acks,
            messages_left=int(recorder.scalar("SELECT count(*) FROM {schema}.message")),
            dead_letters=int(recorder.scalar("SELECT count(*) FROM {schema}.dead_letter")),
            publish_seconds=round(publish_seconds, 1),
            wall_seconds=0.0,
            errors=chaos.errors,
            unexplained_examples=unexplained[:5],
            settings={
                "workers": args.workers,
                "pool": args.pool,
                "concurrency": args.concurrency,
                "prefetch_multiplier": args.prefetch,
                "acks_late": True,
                "visibility_timeout": args.vt,
                "task_ms": args.task_ms,
                "kill_every": args.kill_every,
                "terminate_every": args.terminate_every,
                "seed": args.seed,
                "schema": schema,
                "worker_logs": fleet.logs,
            },
            published=counts["published"],
            ran=counts["ran"],
            never_ran=counts["never_ran"],
            runs=counts["runs"],
            duplicates=counts["duplicates"],
            explained_by_kills=counts["explained_by_kills"],
            explained_by_terminations=counts["explained_by_terminations"],
            unexplained=counts["unexplained"],
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join()  # a kill in progress finishes its replacement first
        fleet.stop()
        recorder.close()
        if not args.keep:
            drop_schema(url, schema)
    report.wall_seconds = round(time.monotonic() - started, 1)
    report.passed = (
        report.published == report.tasks
        and report.never_ran == 0
        and report.unexplained == 0
        and report.messages_left == 0
        and report.dead_letters == 0
        and not report.errors
    )
    return report


def format_report(r: Accounting) -> str:
    rows = [
        ("total tasks", r.tasks),
        ("published", r.published),
        ("tasks that ran", f"{r.ran} (never ran: {r.never_ran})"),
        ("total runs", r.runs),
        ("duplicates (runs beyond the first)", r.duplicates),
        ("  explained by kills", r.explained_by_kills),
        ("  explained by terminations", r.explained_by_terminations),
        ("  unexplained (must be 0)", r.unexplained),
        ("kills (SIGKILL + restart)", r.kills),
        (
            "terminations (pg_terminate_backend)",
            f"{r.terminations} ({r.sessions_terminated} sessions)",
        ),
        ("worker starts", r.worker_starts),
        ("failed acks logged by workers", r.failed_acks_logged),
        ("messages left in the queue", r.messages_left),
        ("dead letters", r.dead_letters),
        ("publish time", f"{r.publish_seconds} s"),
        ("wall time", f"{r.wall_seconds} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    s = r.settings
    lines.append(
        f"settings: {s['workers']} workers, pool {s['pool']} x{s['concurrency']}, prefetch "
        f"x{s['prefetch_multiplier']}, task {s['task_ms']} ms, acks_late, "
        f"vt {s['visibility_timeout']} s (PGQ_VISIBILITY_TIMEOUT), "
        f"kill ~{s['kill_every']} s, terminate ~{s['terminate_every']} s"
    )
    for error in r.errors:
        lines.append(f"error: {error}")
    for example in r.unexplained_examples:
        lines.append(f"unexplained: {example}")
    lines.append("PASS" if r.passed else "FAIL")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    report = run(args)
    text = format_report(report)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(asdict(report), indent=2, default=str))
    else:
        print(text)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
