"""The one Celery worker subprocess of a benchmark run, and what its log says went wrong."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import app as bench_app
from benchmarks.targets import Target

ROOT = Path(__file__).resolve().parents[1]
APP_MODULE = "benchmarks.app"
# Lines worth reporting from a worker log: errors, tracebacks, and warnings Celery or
# the transports log when a delivery or connection goes wrong.
_TROUBLE = re.compile(r"\b(ERROR|CRITICAL|Traceback|WARNING)\b|Error:|Exception")
MAX_REPORTED_LINES = 20


@dataclass(frozen=True)
class WorkerSpec:
    pool: str
    concurrency: int
    prefetch_multiplier: int
    sink_url: str
    #: The module of the worker's Celery app (``celery -A``).
    app: str = APP_MODULE


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        """Warm shutdown (SIGTERM), then SIGKILL of the whole group if it hangs."""
        if self.proc.poll() is None:
            # The main process only: it stops its pool children itself, and a child
            # signalled directly would be logged as an ERROR ("exited with signal 15").
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return int(self.proc.returncode)

    def trouble(self) -> list[str]:
        """The first problem lines of the log (there should be none)."""
        lines = [line for line in self.output().splitlines() if _TROUBLE.search(line)]
        return lines[:MAX_REPORTED_LINES]


def worker_env(target: Target, spec: WorkerSpec, sink_prefix: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(target.env)
    env.update(
        {
            bench_app.ENV_BROKER_URL: target.broker_url,
            bench_app.ENV_QUEUE: target.queue,
            bench_app.ENV_TRANSPORT_OPTIONS: json.dumps(target.transport_options),
            bench_app.ENV_PREFETCH: str(spec.prefetch_multiplier),
            bench_app.ENV_SINK_URL: spec.sink_url,
            bench_app.ENV_SINK_PREFIX: sink_prefix,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def worker_command(target: Target, spec: WorkerSpec, name: str) -> list[str]:
    # Gossip, mingle and heartbeat are cluster chatter, not the workload: off for all.
    # Log level warning: INFO would write two lines per task and measure the logger.
    return [
        sys.executable, "-m", "celery", "-A", spec.app, "worker",
        "-P", spec.pool, "-c", str(spec.concurrency), "-Q", target.queue,
        "-n", f"{name}@%h", "-l", "warning",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip


def start_worker(
    target: Target, spec: WorkerSpec, name: str, sink_prefix: str, log: Path
) -> Worker:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        # A session of its own, so stop() can signal the pool children too.
        proc = subprocess.Popen(
            worker_command(target, spec, name),
            cwd=ROOT,
            env=worker_env(target, spec, sink_prefix),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Worker(proc, log)
