"""The scaling benchmark runs end to end and reports what docs/scaling.md is built on.

Deselected by default (``-m benchmark``). Full size: ``python -m benchmarks.scaling``.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.scaling import main
from tests.acceptance.cluster import ClusterUnavailable, find_bindir, run_as

pytestmark = pytest.mark.benchmark


def test_cpu_and_wal_per_task_on_the_server_in_workers_and_in_producers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        find_bindir()
        run_as()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    main(["--tasks", "300", "--workers", "1", "--producers", "2", "--fsync", "off", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["empty_statement_us"] > 0
    (row,) = report["rounds"]
    assert row["workers"] == 1 and row["drain_tasks"] >= 300
    # Every phase costs the server, the workers and the producers something, and a
    # task writes WAL (its insert, its claim, its delete): none of it can be zero.
    for key in ("publish_server_us", "publish_producer_us", "drain_server_us"):
        assert row[key] > 0, key
    assert row["drain_worker_us"] > 0
    assert row["publish_wal_bytes"] > 0 and row["drain_wal_bytes"] > 0
    assert row["server_us"] == pytest.approx(row["publish_server_us"] + row["drain_server_us"])
