"""The HA beat benchmark, small: three replicas for 25 s, the leader SIGKILLed twice, and
Celery's own beat for comparison. Its JSON says each slot was sent once and none missed.

Deselected by default (a benchmark); ``python -m benchmarks.beat`` runs the full
10 minutes.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.beat import main

pytestmark = pytest.mark.benchmark


def test_a_short_run_sends_every_slot_once_and_stock_beat_sends_each_per_replica(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "--url",
            pg_url,
            "--seconds",
            "25",
            "--kill-every",
            "10",
            "--stock-seconds",
            "11",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] is True, report
    pgq = report["pgq"]
    assert pgq["kills"] == 2 and pgq["takeover_s"]["max"] <= 2.25, pgq
    for entry in pgq["entries"].values():
        assert entry["sends_per_slot"] == {"min": 1, "max": 1} and entry["slots_missing"] == 0
    assert pgq["entries"]["every-1s"]["slots"] >= 20
    # Each of Celery's own beats sends every slot: about one send per replica per slot.
    assert report["stock"]["entries"]["every-1s"]["sends_per_slot"] >= 2.5, report["stock"]
