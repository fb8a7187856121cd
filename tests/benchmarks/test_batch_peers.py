"""The batch-peers benchmark stores what it says each way publishes, and reports it.

Small and quick (a few dozen messages), so it runs with the default tests on the test
Postgres; pgqueuer's way runs only where pgqueuer is installed.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks.batch_peers import main

TASKS, ROUNDS, SIZE = 20, 2, 10


def test_each_way_stores_its_publishes_and_celery_alone_stores_none(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--pg-url", pg_url, "--tasks", str(TASKS), "--rounds", str(ROUNDS)]
    assert main([*argv, "--batch-size", str(SIZE), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    has_pgqueuer = importlib.util.find_spec("pgqueuer") is not None
    # (each pgq way publishes one message first, outside the rate: it migrates and declares)
    expected = {
        "pgq apply_async": TASKS * ROUNDS + 1,
        "Celery alone": 1,
        "pgq kombu": TASKS * ROUNDS + 1,
        "INSERT floor": TASKS * ROUNDS,
    } | ({"pgqueuer": TASKS * ROUNDS} if has_pgqueuer else {})
    assert result["stored"] == expected
    assert set(result["rate"]) == set(expected)
    assert all(rate > 0 for rate in result["rate"].values())
    assert result["ratio_to"] == ("pgqueuer" if has_pgqueuer else "INSERT floor")
    assert result["ratio"][result["ratio_to"]] == 1.0
