"""What one Postgres carries: CPU per task on the server, in the workers and in a producer.

    python -m benchmarks.scaling [--tasks 6000] [--workers 1,2,4] [--producers 4]
                                 [--fsync on|off] [--json]

Starts a throwaway Postgres of its own (tests/acceptance/cluster.py: initdb on a free
port, ``fsync`` on by default, so commits wait for the disk as in production), so that every
process of the server is this benchmark's: its CPU is read from ``/proc`` for the
postmaster and every child (backends, WAL writer, checkpointer, autovacuum; children
that exited are in the postmaster's ``cutime``/``cstime``), less the benchmark's own
monitoring session. For each number of worker processes:

1. **publish**: ``--producers`` threads of this process publish ``--tasks`` no-op tasks,
   one ``send_task`` each through Celery's producer pool (no worker running). Server CPU and the
   producers' CPU (``time.process_time``) per task, and the publish rate.
2. **drain**: that many Celery workers (threads pool, 4 threads, ``acks_late``, prefetch
   4, every pgq default) start on the backlog; from the moment all are ready until the
   queue is empty: server CPU and the workers' CPU (``/proc/<pid>/stat``) per task, the
   drain rate, and how many of the machine's cores the server and the workers used.

WAL bytes per task (publish and drain, from ``pg_current_wal_lsn``) are what every
standby receives: the replication bandwidth a rate needs.

Before the rounds, the server CPU of one empty statement (``SELECT 1``, autocommit) is
measured as a yardstick: a loaded machine inflates every CPU figure (cache and context
switches), and the ratio of a task's cost to the yardstick is what carries over to
another machine.

CPU per task depends much less than rates on what else the machine runs; the rates do (on a
shared machine they are the rates of whatever CPU was left). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from tests.acceptance.cluster import throwaway_cluster
from tests.acceptance.harness import Env, wait_for, workers

__all__ = ["Round", "main", "process_cpu", "server_cpu"]

SCHEMA = "pgq_scaling"
TASK = "benchmarks.scaling.noop"
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold spaces.
    return text[text.rindex(")") + 2 :].split()


def process_cpu(pid: int, *, children: bool = False) -> float:
    """CPU seconds (user + system) of ``pid``, all its threads; with ``children``, also
    of its children that exited and were waited for."""
    fields = _stat(pid)  # fields[0] is field 3 (state): utime is field 14
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def server_cpu(postmaster: int, exclude: set[int]) -> float:
    """CPU seconds of a Postgres server: the postmaster, its live children, and those that
    exited (the postmaster waits for each), less the processes in ``exclude``."""
    total = process_cpu(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            fields = _stat(int(entry.name))
        except (OSError, ValueError):
            continue  # exited meanwhile (then counted in the postmaster's cutime)
        if int(fields[1]) == postmaster:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


@dataclass
class Round:
    workers: int
    tasks: int
    publish_rate: float
    publish_server_us: float
    publish_producer_us: float
    drain_tasks: int
    drain_rate: float
    drain_server_us: float
    drain_worker_us: float
    server_cores: float
    worker_cores: float
    publish_wal_bytes: float
    drain_wal_bytes: float

    @property
    def server_us(self) -> float:
        return self.publish_server_us + self.drain_server_us


class Server:
    def __init__(self, url: str, postmaster: int) -> None:
        self.url = url
        self.postmaster = postmaster
        self.monitor = psycopg.connect(url, autocommit=True)
        row = self.monitor.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.exclude = {int(row[0])}

    def cpu(self) -> float:
        return server_cpu(self.postmaster, self.exclude)

    def wal(self) -> int:
        """Bytes of WAL written so far (what a standby must receive)."""
        row = self.monitor.execute(
            "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), '0/0')"
        ).fetchone()
        return int(row[0]) if row else 0

    def queued(self) -> int:
        query = sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(SCHEMA))
        row = self.monitor.execute(query).fetchone()
        return int(row[0]) if row else 0


def publish(app: Celery, tasks: int, producers: int) -> None:
    """``tasks`` publishes shared by ``producers`` threads (Celery's producer pool: a
    connection each)."""

    def run(share: range) -> None:
        for n in share:
            app.send_task(TASK, args=[n])

    threads = [
        threading.Thread(target=run, args=(range(i, tasks, producers),)) for i in range(producers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def one_round(server: Server, n_workers: int, tasks: int, producers: int) -> Round:
    app = Celery("producer", broker="pgq://" + server.url.split("://", 1)[1])
    app.conf.broker_transport_options = {"schema": SCHEMA}
    publish(app, producers, producers)  # connects every producer; not counted
    wal0 = server.wal()
    cpu0, own0, t0 = server.cpu(), time.process_time(), time.perf_counter()
    publish(app, tasks, producers)
    t1, own1, cpu1 = time.perf_counter(), time.process_time(), server.cpu()
    wal1 = server.wal()
    env = Env(server.url, SCHEMA)
    with workers(
        env,
        *(f"s{i}" for i in range(n_workers)),
        app="benchmarks.scaling_app",
        concurrency=4,
        environ={"PGQ_POLLING_INTERVAL": "0.2"},
    ) as started:
        pids = [w.proc.pid for w in started]
        backlog = server.queued()
        wal_drain0 = server.wal()
        wcpu0 = sum(process_cpu(pid) for pid in pids)
        scpu0, d0 = server.cpu(), time.perf_counter()
        wait_for(lambda: server.queued() == 0, 600, "the backlog to drain", step=0.02)
        d1 = time.perf_counter()
        scpu1 = server.cpu()
        wcpu1 = sum(process_cpu(pid) for pid in pids)
        wal2 = server.wal()
    drained = max(backlog, 1)
    return Round(
        workers=n_workers,
        tasks=tasks,
        publish_rate=tasks / (t1 - t0),
        publish_server_us=(cpu1 - cpu0) / tasks * 1e6,
        publish_producer_us=(own1 - own0) / tasks * 1e6,
        drain_tasks=backlog,
        drain_rate=backlog / (d1 - d0),
        drain_server_us=(scpu1 - scpu0) / drained * 1e6,
        drain_worker_us=(wcpu1 - wcpu0) / drained * 1e6,
        server_cores=(scpu1 - scpu0) / (d1 - d0),
        worker_cores=(wcpu1 - wcpu0) / (d1 - d0),
        publish_wal_bytes=(wal1 - wal0) / tasks,
        drain_wal_bytes=(wal2 - wal_drain0) / drained,
    )


def empty_statement_us(server: Server, statements: int = 3000) -> float:
    """Server CPU of one ``SELECT 1`` round trip (autocommit): the yardstick that says how
    dear this machine's CPU is right now (a loaded machine inflates every figure)."""
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("SELECT 1")
        cpu0 = server.cpu()
        for _ in range(statements):
            conn.execute("SELECT 1")
        return (server.cpu() - cpu0) / statements * 1e6


def table(rounds: list[Round]) -> str:
    head = (
        "| workers | publish/s | server us/publish | producer us/publish | drain tasks/s "
        "| server us/task (claim+ack) | worker us/task | server cores | worker cores "
        "| WAL bytes/task |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rounds:
        lines.append(
            f"| {r.workers} | {r.publish_rate:,.0f} | {r.publish_server_us:.0f} "
            f"| {r.publish_producer_us:.0f} | {r.drain_rate:,.0f} | {r.drain_server_us:.0f} "
            f"| {r.drain_worker_us:.0f} | {r.server_cores:.2f} | {r.worker_cores:.2f} "
            f"| {r.publish_wal_bytes + r.drain_wal_bytes:,.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--tasks", type=int, default=6000, help="tasks published and drained per round")
    add("--workers", default="1,2,4", help="worker process counts, one round each")
    add("--producers", type=int, default=4, help="publishing threads (default 4)")
    add("--fsync", choices=("on", "off"), default="on", help="the server's fsync (default on)")
    add("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    rounds: list[Round] = []
    settings = {"fsync": args.fsync, "max_connections": "100"}
    with throwaway_cluster(settings) as cluster:
        postmaster = int((cluster.data / "postmaster.pid").read_text().split("\n", 1)[0])
        connector = Connector(cluster.url())
        ensure_schema(connector, SCHEMA, auto_migrate=True)
        connector.close()
        server = Server(cluster.url(), postmaster)
        yardstick = empty_statement_us(server)
        print(f"server CPU per empty statement (SELECT 1): {yardstick:.0f} us", file=sys.stderr)
        for n in counts:
            rounds.append(one_round(server, n, args.tasks, args.producers))
            print(table(rounds[-1:]).splitlines()[-1], file=sys.stderr)
        server.monitor.close()
    report: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "fsync": args.fsync,
        "producers": args.producers,
        "empty_statement_us": yardstick,
        "loadavg_at_end": os.getloadavg(),
        "rounds": [{**asdict(r), "server_us": r.server_us} for r in rounds],
    }
    print(table(rounds), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"server CPU per empty statement (SELECT 1): {yardstick:.0f} us")
        print(f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
