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
    scheduler: str | None = "pgq"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(30)


def stop_beats(beats: list[Beat]) -> None:
    """SIGTERM every beat at once, then wait for each to exit."""
    for beat in beats:
        if beat.proc.poll() is None:
            os.killpg(beat.proc.pid, signal.SIGTERM)
    for beat in beats:
        beat.proc.wait(30)


def spawn_beat(
    env: Env, entries: dict[str, Any], *, scheduler: str | None = "pgq", **environ: str
) -> Beat:
    """A beat with ``entries`` as its beat_schedule (see beat_app), just started."""
    log = Path(tempfile.mkstemp(prefix="pgq-beat-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "tests.acceptance.launch", BEAT_APP, "beat", "-l", "info"]
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
    return Beat(proc, log, scheduler)


def wait_synced(beats: list[Beat]) -> None:
    """Wait until every beat stored its schedule (Celery's own scheduler: started)."""

    def synced() -> bool:
        for beat in beats:
            if beat.proc.poll() is not None:
                raise AssertionError(f"beat exited early:\n{beat.output()}")
        return all(
            ("from beat_schedule" if b.scheduler else "beat: Starting") in b.output() for b in beats
        )

    wait_for(synced, 60, "a beat to store its schedule")


def start_beat(
    env: Env, entries: dict[str, Any], *, scheduler: str | None = "pgq", **environ: str
) -> Beat:
    """A beat with ``entries`` as its beat_schedule (see beat_app), once it stored them
    (``scheduler=None``: Celery's own file-based scheduler, once it started)."""
    beat = spawn_beat(env, entries, scheduler=scheduler, **environ)
    wait_synced([beat])
    return beat


def start_beats(env: Env, entries: dict[str, Any], *environs: dict[str, str]) -> list[Beat]:
    """One pgq beat per ``environs`` item, started side by side (as replicas are), once
    each stored its schedule."""
    beats = [spawn_beat(env, entries, **environ) for environ in environs]
    try:
        wait_synced(beats)
    except BaseException:
        for beat in beats:
            beat.kill()
        raise
    return beats
