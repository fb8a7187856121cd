"""Real ``celery beat`` processes for the beat tests and benchmark."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.acceptance.harness import ROOT, Env, wait_for

BEAT_APP = "tests.acceptance.beat_app"
TICK = 1.0  # --max-interval


@dataclass
class Beat:
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(30)


def start_beat(
    env: Env, entries: dict[str, Any], *, scheduler: str | None = "pgq", **environ: str
) -> Beat:
    """A beat with ``entries`` as its beat_schedule (see beat_app), once it stored them
    (``scheduler=None``: Celery's own file-based scheduler, once it started)."""
    log = Path(tempfile.mkstemp(prefix="pgq-beat-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "celery", "-A", BEAT_APP, "beat", "-l", "info"]
    cmd += ["--max-interval", str(int(TICK))]
    if scheduler is not None:
        cmd += ["-S", scheduler]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=tempfile.mkdtemp(prefix="pgq-beat-"),
            env=env.environ(
                TEST_BEAT_SCHEDULE=json.dumps(entries), PYTHONPATH=str(ROOT), **environ
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    beat = Beat(proc, log)

    def synced() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"beat exited early:\n{beat.output()}")
        return ("from beat_schedule" if scheduler else "beat: Starting") in beat.output()

    wait_for(synced, 60, "a beat to store its schedule")
    return beat
