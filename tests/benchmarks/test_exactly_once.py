"""The exactly-once benchmark runs end to end, small: atomic counts exact through kills.

Deselected by default (``-m benchmark`` runs it): it starts real workers.
"""

from __future__ import annotations

import pytest

from benchmarks.exactly_once import main

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
