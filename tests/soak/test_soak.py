"""The chaos soak (``python -m benchmarks.soak``), smaller, with its accounting checked.

Deselected by default; run it with ``pytest -m soak tests/soak``. ``PGQ_SOAK_TASKS``
sets the number of tasks (default 4,000; the script's own default is 20,000).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.soak

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_chaos_soak_runs_every_task_and_explains_every_duplicate(pg_url: str) -> None:
    tasks = int(os.environ.get("PGQ_SOAK_TASKS", "4000"))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        "--tasks",
        str(tasks),
        "--workers",
        "2",
        "--vt",
        "5",
        "--task-ms",
        "20",
        "--kill-every",
        "4",
        "--terminate-every",
        "3",
        "--max-seconds",
        "600",
        "--url",
        pg_url,
        "--json",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert proc.stdout, f"no report (exit {proc.returncode}):\n{proc.stderr}"
    report = json.loads(proc.stdout)
    print("\n" + proc.stderr)
    assert report["errors"] == []
    assert report["published"] == tasks
    assert report["never_ran"] == 0, "a task never ran"
    assert report["ran"] == tasks
    assert report["runs"] == tasks + report["duplicates"]
    assert report["unexplained"] == 0, report["unexplained_examples"]
    assert report["duplicates"] == (
        report["explained_by_kills"] + report["explained_by_terminations"]
    )
    assert report["messages_left"] == 0, "a message was never acked"
    assert report["dead_letters"] == 0
    assert report["kills"] >= 1, "the chaos never killed a worker: nothing was tested"
    assert report["sessions_terminated"] >= 1, "no backend was ever terminated"
    assert report["passed"] is True
    assert proc.returncode == 0
