"""benchmarks.claim_ab at a small size: two claim statements take turns over one drain.

Deselected by default (``-m benchmark``). Full size: ``python -m benchmarks.claim_ab``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from benchmarks.claim_ab import main

pytestmark = pytest.mark.benchmark


def test_each_statement_claims_half_of_every_drain(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "queries.sql"
    shipped = resources.files("pg_transport.sql").joinpath("queries.sql")
    other.write_text(shipped.read_text(encoding="utf-8"), encoding="utf-8")
    size = ["--messages", "160", "--keys", "0,8", "--window", "8", "--rounds", "2"]
    main(["--pg-url", pg_url, "--against", str(other), *size, "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(r["keys"], r["round"]) for r in rows] == [
        (k, n) for k in (0, 8) for n in ("1", "2", "all")
    ]
    # 160 messages in claims of 8 a drain (drain() raises unless all were claimed),
    # each statement timed on its turns.
    assert all(r["claims"] >= 20 and r["this_ms"] > 0 and r["other_ms"] > 0 for r in rows)
