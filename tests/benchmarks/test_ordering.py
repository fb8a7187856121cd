"""The ordering benchmark runs end to end on pgq, small: keys kept in order, figures sane.

Deselected by default (``-m benchmark`` runs it): it starts real workers.
"""

from __future__ import annotations

import json

import pytest
import redis

from benchmarks.ordering import main, parse_args

pytestmark = pytest.mark.benchmark


def redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url("redis://127.0.0.1:6379", socket_timeout=2).ping())
    except redis.RedisError:
        return False


def test_ordered_and_one_key_runs_report_in_order(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if not redis_up():
        pytest.skip("the benchmark's timing sink needs Redis on 127.0.0.1:6379")
    argv = ["--tasks", "200", "--keys", "20", "--one-key", "20", "--task-ms", "0,5"]
    assert main([*argv, "--rounds", "1", "--pg-url", pg_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [found] = report["rounds"]
    for name in ("unordered", "ordered", "one_key_0ms", "one_key_5ms"):
        m = found[name]
        assert m["tasks"] == (200 if name in ("unordered", "ordered") else 20), (name, m)
        assert m["duplicates"] == 0 and m["out_of_order"] == 0 and m["overlaps"] == 0, m
        assert m["rate"] > 0 and m["statements"]["claim"] > 0, m
    # Ordered messages are held back by claims (parked behind their key's earlier one).
    assert found["one_key_0ms"]["statements"]["held"] > 0
    assert found["unordered"]["statements"]["held"] == 0
    for t in ("0", "5"):
        serial = found[f"one_key_{t}ms"]["serial"]
        assert serial["tasks"] == 20 and serial["duplicates"] == 0, serial
        assert serial["statements"]["held"] == 0, serial
    assert found["store"]["ordered"] > 0 and found["store"]["unordered"] > 0
    assert min(found["statements_ms"].values()) > 0
    assert found["ratio"] > 0 and found["one_key_5ms"]["bound"] < 200  # 1 / (5 ms + rtt)
    assert report["summary"]["out_of_order"] == 0


@pytest.mark.parametrize(
    "bad", [["--task-ms", "x"], ["--keys", "0"], ["--tasks", "10", "--keys", "20"]]
)
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)
