"""The flow-limits benchmark runs end to end, tiny: real workers, both parts, sane figures.

Deselected by default (``-m benchmark`` runs it): it starts real workers. The analysis
functions are checked on hand-made runs first (no workers needed, but kept with the
benchmark they serve).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.flow_limits import analyse_keys, analyse_rate, main, parse_args

pytestmark = pytest.mark.benchmark


def test_the_rate_analysis_counts_windows_and_seconds() -> None:
    # 10 starts 0.1 s apart from t=100, then 3 at once at t=101.5.
    starts = [100 + i / 10 for i in range(10)] + [101.5] * 3
    found = analyse_rate(starts, ["w1"] * 10 + ["w2"] * 3, 100.0, 1.0, 10)
    assert found["window_starts"] == 10 and found["achieved_vs_rate"] == 1.0
    # [100.0, 101.0) holds 10; [100.6, 101.6) holds 4 + 3 = 7.
    assert found["max_in_any_1s"] == 10
    assert found["max_in_a_calendar_second"] == 10
    assert found["per_worker"] == {"w1": 10, "w2": 3}
    found = analyse_rate([0.0, 0.5, 0.99, 1.0, 1.2], ["w"] * 5, 0.0, 2.0, 2)
    assert found["max_in_any_1s"] == 4  # [0.5, 1.5)
    assert found["max_in_a_calendar_second"] == 3


def test_the_key_analysis_counts_overlap_per_key_and_parallelism() -> None:
    runs = [
        ("a", 0.0, 2.0),
        ("a", 1.0, 3.0),
        ("a", 2.0, 4.0),  # starts as the first ends: 2 of "a" at once, not 3
        ("b", 0.0, 4.0),
    ]
    found = analyse_keys(runs)
    assert found["max_in_flight_of_a_key"] == 2 and found["keys_at_that_max"] == 1
    assert found["max_running"] == 3 and found["max_keys_running"] == 2
    assert found["span_seconds"] == 4.0
    assert found["mean_running"] == 2.5  # 10 task-seconds over 4 s
    assert found["mean_keys_running"] == 2.0


def test_both_parts_run_tiny_and_the_guarantees_hold(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--seconds", "4", "--celery-seconds", "3", "--rate", "10", "--workers", "2"]
    argv += ["--keys", "4", "--per-key", "6", "--task-ms", "200", "--b-concurrency", "8"]
    assert main([*argv, "--pg-url", pg_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    a, c, b = report["a_pgq"], report["a_celery"], report["b"]
    # The gate: at most rate + burst grants in any second, none of them twice. A start
    # follows its grant by the worker's lag: at most one more per slot of the fleet.
    assert a["claims_ok"] and a["claims_max_in_any_1s"] <= 11 and a["once_ok"], a
    assert a["max_in_any_1s"] <= 11 + 2 * 2 and a["window_starts"] <= 1 + 10 * 4, a
    assert a["window_starts"] >= 10 and set(a["per_worker"]) == {"a1", "a2"}, a
    # Celery's rate_limit is per worker: two workers run well past the rate.
    assert c["achieved_rate"] > 10 * 1.5, c
    assert b["all_ran_once"] and b["runs"] == 24 and b["max_in_flight_of_a_key"] <= 3, b
    assert b["max_keys_running"] >= 2 and b["mean_running"] > 1, b
    assert report["guarantees_hold"] is True
    assert min(len(report["load_start"]), len(report["load_end"])) == 3


@pytest.mark.parametrize(
    "bad",
    [["--part", "c"], ["--rate", "0"], ["--seconds", "0.5"], ["--limit", "0"], ["--part", ""]],
)
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)
