"""The wake-up benchmark times each step of an idle consumer's wait, in order.

Small and quick (a few probes each way), so it runs with the default tests.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.wake import main, measure


def test_each_step_follows_the_one_before(pg_url: str) -> None:
    for durable in (True, False):
        steps = measure(pg_url, 10, durable=durable)
        assert list(steps) == ["returned", "woken", "claimed"]
        p50s = [steps[name]["p50"] for name in steps]
        # The wake-up is sent once the commit is done, and the claim after the wake-up.
        assert 0 < p50s[0] <= p50s[1] < p50s[2], (durable, steps)
        assert all(value["p99"] >= value["p50"] for value in steps.values())


def test_json_names_both_ways(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--url", pg_url, "--probes", "5", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert set(found) == {"durable", "async"}
    assert all(set(steps) == {"returned", "woken", "claimed"} for steps in found.values())
