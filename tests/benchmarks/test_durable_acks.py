"""The durable_acks benchmark drains every message it publishes, in both modes."""

from __future__ import annotations

import pytest

from benchmarks.durable_acks import compare, drain_rate

pytestmark = pytest.mark.benchmark


def test_drain_rate_counts_every_message_in_both_modes(pg_url: str) -> None:
    for mode in ("on", "off"):
        assert drain_rate(pg_url, mode, 50) > 0


def test_compare_reports_the_ratio_of_the_medians(pg_url: str) -> None:
    found = compare(pg_url, 30, 1)
    assert found["ratio"] == pytest.approx(found["on"] / found["off"])
    assert len(found["rounds"]["on"]) == len(found["rounds"]["off"]) == 1
