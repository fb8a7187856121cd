"""The unique-tasks race (benchmark part (c)) runs end to end, small: real workers, real
racing publishers, and exactly one task per key runs.

Deselected by default (``-m benchmark`` runs it): it starts real workers.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.unique_race import _calls, main, parse_args

pytestmark = pytest.mark.benchmark


def test_every_key_is_published_by_several_publishers() -> None:
    shares = [_calls(n, 3, 20, 4) for n in range(3)]
    assert [len(s) for s in shares] == [7, 7, 6]
    flat = [k for s in shares for k in s]
    assert sorted(set(flat)) == ["k0", "k1", "k2", "k3"]
    assert [s[0] for s in shares] == ["k0", "k1", "k2"]  # each from its own offset
    for key in set(flat):
        assert sum(key in s for s in shares) >= 2  # raced from more than one thread


# 4 publishers' and 2 workers' sessions (a threads pool's task sessions each), the harness's.
@pytest.mark.sessions(28)
def test_racing_publishers_run_exactly_one_task_per_key(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--publishers", "4", "--publishes", "120", "--keys", "12", "--workers", "2"]
    assert main([*argv, "--concurrency", "8", "--pg-url", pg_url, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True, r
    assert (r["tasks_run"], r["distinct_tasks_run"], r["keys_run"]) == (12, 12, 12), r
    assert (r["calls_answered"], r["distinct_ids_returned"], r["duplicates"]) == (120, 12, 108)
    assert r["messages_at_race_end"] == 12 and r["left_in_queue"] == 0, r


@pytest.mark.parametrize(
    "bad", [["--keys", "0"], ["--publishes", "10", "--keys", "50"], ["--publishers", "0"]]
)
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)
