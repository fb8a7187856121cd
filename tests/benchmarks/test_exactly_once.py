"""The exactly-once benchmark runs end to end, small: atomic counts exact through kills.

Deselected by default (``-m benchmark`` runs it): it starts real workers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.exactly_once import ROOT, main

pytestmark = pytest.mark.benchmark


def test_atomic_counts_are_exact_through_kills_and_terminations(pg_url: str) -> None:
    report = main(
        [
            "--pg-url",
            pg_url,
            "--tasks",
            "200",
            "--kill-every",
            "6",
            "--terminate-rate",
            "0.1",
            "--ways",
            "pgq-atomic,pgq",
            "--timeout",
            "600",
            "--json",
        ]
    )
    atomic, plain = report["ways"]
    assert atomic["way"] == "pgq-atomic" and atomic["exact"], atomic
    assert plain["way"] == "pgq" and plain["audit_rows"] >= plain["tasks"], plain
    assert report["atomic_over_plain_pgq"] > 0


def test_cpu_a_task_is_reported_for_each_way_and_as_a_ratio(pg_url: str) -> None:
    """``--cpu``: the worker's and its backends' CPU a task, and plain's ÷ atomic's. (Run
    as its own process: the benchmark drops and recreates its schemas, which a second
    run in a process whose pools kept sessions on the first ones does not expect.)"""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.exactly_once", "--pg-url", pg_url, "--tasks",
         "300", "--kill-every", "0", "--terminate-rate", "0", "--ways", "pgq-atomic,pgq",
         "--timeout", "600", "--cpu", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout)
    for way in report["ways"]:
        cpu = way["cpu"]
        assert way["exact"] and cpu["tasks"] > 0 and cpu["backends"] > 0, way
        assert cpu["worker_ms"] > 0 and cpu["backend_ms"] > 0, way
        assert cpu["total_ms"] == pytest.approx(cpu["worker_ms"] + cpu["backend_ms"], abs=0.01)
    assert report["atomic_over_plain_pgq_cpu"] > 0
