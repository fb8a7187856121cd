"""The many-queues benchmark runs end to end and reports what it exists to report.

Deselected by default (``-m benchmark``). Full size: ``python -m benchmarks.many_queues``.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.many_queues import main

pytestmark = pytest.mark.benchmark


def test_rates_and_claims_per_queue_count(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--pg-url",
            pg_url,
            "--messages",
            "200",
            "--queues",
            "1,20",
            "--prefetch",
            "8",
            "--rounds",
            "1",
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["queues"] for r in rows] == [1, 20]
    assert rows[0]["kombu_ratio"] == rows[0]["store_ratio"] == 1.0
    assert all(r["kombu_rate"] > 0 and r["store_shared_rate"] > 0 for r in rows)
    # A claim names no more queues than its prefetch window, however many are consumed.
    assert all(r["queues_named_per_claim"] <= 8 for r in rows)
