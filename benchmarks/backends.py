"""Result backends compared on one pgq broker: pgq's own, Redis, Celery's db+postgresql.

``python -m benchmarks.backends`` runs one real worker per backend (threads pool) and
measures, in the same run:

- ``round_trip``: apply_async -> get() returning, one task at a time on an idle worker
  (p50/p99, ms; the median over ``--rounds``);
- ``chord``: a chord of ``--chord-parts`` header tasks: seconds from the header's last
  task's end to the body's start (the median of ``--chord-rounds`` chords a round);

With ``--rounds`` above 1 the backends take turns at the round trips and chords, so that
the machine's other load is shared out among them.
- ``waiting``: ``--waiters`` callers (threads of one process) each blocked in get() on a
  slow task: Postgres transactions a second in the benchmark's database
  (``pg_stat_database.xact_commit``) while they wait, minus the same with nobody waiting
  (each over ``--window`` seconds, after letting the sessions' statistics settle); also
  with a tenth of the waiters, to see whether it grows with their number. The tasks nap
  ``--nap`` seconds: none of the waited-for tasks finishes inside the windows.

Backends: ``pgq`` (push-woken), ``pgq-poll`` (``use_notify`` off, one batched poll per
0.5 s), ``redis``, ``db`` (SQLAlchemy, psycopg 3). Ratios are against Redis. ``--json``
prints the figures as JSON. Everything runs in a database of its own
(``pgq_bench_backends``), so other sessions of the server do not count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from statistics import median, quantiles
from typing import Any

import psycopg
from celery import Celery, chord
from psycopg import sql

from benchmarks.brokers import default_pg_url

__all__ = ["main", "measure"]

DATABASE = "pgq_bench_backends"
ROOT = Path(__file__).resolve().parents[1]
REDIS = "redis://127.0.0.1:6379/14"
BACKENDS = ("pgq", "pgq-poll", "redis", "db")
# Seconds for a session's statistics to reach pg_stat_database (PGSTAT_IDLE_INTERVAL: 10).
SETTLE = 12.0


def _db_url(pg_url: str, database: str) -> str:
    base, _, _ = pg_url.rpartition("/")
    return f"{base}/{database}"


def ensure_database(pg_url: str) -> str:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    return _db_url(pg_url, DATABASE)


def backend_url(kind: str, pg_url: str) -> tuple[str, dict[str, Any]]:
    if kind in ("pgq", "pgq-poll"):
        url = "pgq://" + pg_url.split("://", 1)[1]
        options = {"use_notify": False, "polling_interval": 0.5} if kind == "pgq-poll" else {}
        return url, options
    if kind == "redis":
        return REDIS, {}
    return "db+postgresql+psycopg://" + pg_url.split("://", 1)[1], {}


def xacts(pg_url: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            [DATABASE],
        ).fetchone()
    return int(row[0]) if row else 0


def xacts_per_second(pg_url: str, seconds: float) -> float:
    # The statistics collector reports a session's counts when it goes idle, at most
    # every ~second: measure over several seconds, from one snapshot to the next.
    before = xacts(pg_url)
    time.sleep(seconds)
    return (xacts(pg_url) - before) / seconds


class Run:
    """A worker and a client for one backend, in a schema of their own."""

    def __init__(self, kind: str, pg_url: str, concurrency: int) -> None:
        self.kind, self.pg_url = kind, pg_url
        self.schema = "bench_" + uuid.uuid4().hex[:10]
        self.url, self.options = backend_url(kind, pg_url)
        broker = "pgq://" + pg_url.split("://", 1)[1]
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PGQ_")},
            "BENCH_BROKER_URL": broker,
            "BENCH_RESULT_BACKEND": self.url,
            "BENCH_RESULT_OPTIONS": json.dumps(self.options),
            "PGQ_SCHEMA": self.schema,
            "PYTHONPATH": str(ROOT),
        }
        self.app = Celery("bench_client", broker=broker, backend=self.url, set_as_current=False)
        self.app.conf.update(
            broker_transport_options={"schema": self.schema},
            result_backend_transport_options=self.options,
            # Celery's database backend opens a pool per backend object, and Celery makes
            # one per thread: hundreds of waiting threads would take hundreds of server
            # connections. One backend for the process, with a bounded pool.
            result_backend_thread_safe=kind == "db",
            database_engine_options={"pool_size": 10, "max_overflow": 10},
        )
        self.log = Path(tempfile.mkstemp(prefix=f"bench-backends-{kind}-", suffix=".log")[1])
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "celery", "-A", "benchmarks.backends_app", "worker",
                    "-P", "threads", "-c", str(concurrency), "-l", "warning",
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                ],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        # Ready once a task comes back.
        deadline = time.monotonic() + 60
        while True:
            try:
                self.app.send_task("bench.stamp").get(timeout=5)
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"{kind} worker: {self.log.read_text()[-2000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.kind in ("pgq", "pgq-poll"):
            self.app.backend.listener.stop()
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
            )

    def round_trip(self, probes: int) -> dict[str, Any]:
        """p50/p99 of send -> get() returning; ``result_leg``: of the task's end (its
        body's last wall-clock stamp) -> get() returning, the result backend's own part
        (the store, its commit, the wake-up of the waiter and its read); the load average
        before and after."""
        times: list[float] = []
        legs: list[float] = []
        load_before = os.getloadavg()
        for n in range(probes + 10):
            started = time.perf_counter()
            ended = float(self.app.send_task("bench.stamp").get(timeout=30))
            returned = time.time()
            if n >= 10:
                times.append((time.perf_counter() - started) * 1000)
                legs.append((returned - ended) * 1000)
        cuts = quantiles(times, n=100)
        leg_cuts = quantiles(legs, n=100)
        return {
            "p50_ms": median(times),
            "p99_ms": cuts[98],
            "result_leg_p50_ms": median(legs),
            "result_leg_p99_ms": leg_cuts[98],
            "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
        }

    def chord(self, parts: int, rounds: int) -> dict[str, Any]:
        lags = []
        for _ in range(rounds):
            header = [self.app.signature("bench.stamp") for _ in range(parts)]
            result = chord(header, app=self.app)(self.app.signature("bench.gather"))
            lags.append(float(result.get(timeout=600)))
        return {"lag_s": median(lags), "lags_s": lags}

    def waiting(self, waiters: int, nap: float, window: float) -> dict[str, float]:
        results = [self.app.send_task("bench.nap", args=[nap]) for _ in range(waiters)]
        # A session reports its counts up to ~10 s after it went idle: let the sends'
        # reach the statistics before counting.
        time.sleep(SETTLE)
        idle = xacts_per_second(self.pg_url, window)  # the tasks wait, nobody waits on them
        done = threading.Event()

        def wait(r: Any) -> None:
            try:
                r.get(timeout=nap * waiters)
            except Exception:
                if not done.is_set():
                    raise

        threads = [threading.Thread(target=wait, args=(r,), daemon=True) for r in results]
        for t in threads:
            t.start()
        time.sleep(SETTLE)  # every waiter subscribed, and those statements counted
        busy = xacts_per_second(self.pg_url, window)
        done.set()
        return {"waiters": waiters, "xacts_per_s": busy - idle, "baseline_per_s": idle}


def measure(
    kinds: list[str],
    pg_url: str,
    *,
    probes: int,
    chord_parts: int,
    chord_rounds: int,
    waiters: int,
    nap: float,
    window: float,
    concurrency: int,
    rounds: int = 1,
    progress: Path | None = None,
) -> dict[str, dict[str, Any]]:
    url = ensure_database(pg_url)
    out: dict[str, dict[str, Any]] = {kind: {} for kind in kinds}
    trips: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    lags: dict[str, list[float]] = {kind: [] for kind in kinds}

    def save() -> None:
        if progress is not None:  # what is measured survives a later failure
            progress.write_text(json.dumps(out, indent=2))

    # Round trips and chords: the backends take turns, round after round, so that the
    # machine's other load falls on all of them alike.
    for turn in range(rounds):
        for kind in kinds if turn % 2 == 0 else kinds[::-1]:  # (reversed every other round)
            run = Run(kind, url, concurrency)
            try:
                trips[kind].append(run.round_trip(probes))
                lags[kind].extend(run.chord(chord_parts, chord_rounds)["lags_s"])
            finally:
                run.close()
            out[kind]["round_trip"] = {
                "p50_ms": median(t["p50_ms"] for t in trips[kind]),
                "p99_ms": median(t["p99_ms"] for t in trips[kind]),
                "result_leg_p50_ms": median(t["result_leg_p50_ms"] for t in trips[kind]),
                "result_leg_p99_ms": median(t["result_leg_p99_ms"] for t in trips[kind]),
                "rounds": trips[kind],
            }
            out[kind]["chord"] = {"lag_s": median(lags[kind]), "lags_s": lags[kind]}
            save()
    for kind in kinds if waiters > 0 else ():
        # The fewer waiters first: a waiter of Celery's database backend goes on polling
        # after its window (nothing stops a get()), a constant load that the next
        # measurement's baseline then holds too, and that is smaller this way round.
        for what, count in (("waiting_tenth", max(waiters // 10, 1)), ("waiting", waiters)):
            run = Run(kind, url, concurrency)
            try:
                out[kind][what] = run.waiting(count, nap, window)
            finally:
                run.close()
            save()
    return out


def report(figures: dict[str, dict[str, Any]]) -> str:
    base = figures.get("redis")
    for f in figures.values():
        for what in ("waiting", "waiting_tenth"):
            f.setdefault(what, {"xacts_per_s": float("nan")})
    lines = [
        f"{'backend':10} {'rt p50 ms':>10} {'rt p99 ms':>10} {'chord lag s':>12} "
        f"{'xact/s N':>10} {'xact/s N/10':>12}"
    ]
    for kind, f in figures.items():
        lines.append(
            f"{kind:10} {f['round_trip']['p50_ms']:10.2f} {f['round_trip']['p99_ms']:10.2f} "
            f"{f['chord']['lag_s']:12.3f} {f['waiting']['xacts_per_s']:10.1f} "
            f"{f['waiting_tenth']['xacts_per_s']:12.1f}"
        )
    lines.append("result leg (the task's end -> get() returning), p50 / p99 ms:")
    for kind, f in figures.items():
        rt = f["round_trip"]
        lines.append(f"  {kind:10} {rt['result_leg_p50_ms']:.2f} / {rt['result_leg_p99_ms']:.2f}")
    if base:
        lines.append("ratios against redis (round trip p50, p99, chord lag):")
        for kind, f in figures.items():
            rt = f["round_trip"]
            lines.append(
                f"  {kind:10} {rt['p50_ms'] / base['round_trip']['p50_ms']:.2f}x "
                f"{rt['p99_ms'] / base['round_trip']['p99_ms']:.2f}x "
                f"{f['chord']['lag_s'] / base['chord']['lag_s']:.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.backends", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--pg-url", default=default_pg_url())
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--chord-parts", type=int, default=1000)
    parser.add_argument("--chord-rounds", type=int, default=2, help="chords per round")
    parser.add_argument("--rounds", type=int, default=1, help="turns of every backend")
    parser.add_argument("--waiters", type=int, default=400, help="0: no waiting figures")
    parser.add_argument("--nap", type=float, default=90.0)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, help="write the figures here as they come")
    args = parser.parse_args(argv)
    figures = measure(
        [k for k in args.backends.split(",") if k],
        args.pg_url,
        probes=args.probes,
        chord_parts=args.chord_parts,
        chord_rounds=args.chord_rounds,
        waiters=args.waiters,
        nap=args.nap,
        window=args.window,
        concurrency=args.concurrency,
        rounds=args.rounds,
        progress=args.out,
    )
    print(json.dumps(figures, indent=2) if args.json else report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
