"""benchmarks.fair_share at a small size: a lone key behind a backlog, fair mode off and on.

Deselected by default (``-m benchmark``). Full size: ``python -m benchmarks.fair_share``.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.fair_share import main

pytestmark = pytest.mark.benchmark


def test_fair_mode_delivers_the_lone_key_by_the_first_claim(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--pg-url", pg_url, "--backlog", "2000", "--rounds", "2", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["mode"], r["round"]) for r in rows) == [
        ("off", 1), ("off", 2), ("on", 1), ("on", 2)
    ]  # fmt: skip
    for row in rows:
        if row["mode"] == "on":
            assert row["claims_until_b"] == 1 and row["delivered_before_b"] < 8
        else:  # behind the whole backlog
            assert row["delivered_before_b"] == 2000
