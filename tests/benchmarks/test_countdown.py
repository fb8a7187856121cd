"""The countdown benchmark runs end to end and reports lateness on pgq.

Deselected by default (``-m benchmark`` runs it): it starts a real worker.
"""

from __future__ import annotations

import json

import pytest
import redis

from benchmarks.countdown import main, parse_args

pytestmark = pytest.mark.benchmark


def redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url("redis://127.0.0.1:6379", socket_timeout=2).ping())
    except redis.RedisError:
        return False


def test_countdowns_on_pgq_start_on_time(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    if not redis_up():
        pytest.skip("the benchmark's timing sink needs Redis on 127.0.0.1:6379")
    assert (
        main(
            [
                "--brokers",
                "pgq",
                "--tasks",
                "30",
                "--spread",
                "0.1,1.5",
                "--pg-url",
                pg_url,
                "--json",
            ]
        )
        == 0
    )
    found = json.loads(capsys.readouterr().out)["brokers"]["pgq"]
    assert found["tasks"] == 30
    (turn,) = found["rounds"]  # one round: its figures and the load it ran under
    assert turn["tasks"] == 30 and len(turn["loadavg"]["before"]) == 3
    assert found["min_ms"] > -5  # never started before its eta (clock noise aside)
    assert found["p50_ms"] < 50, found  # a poll would make it ~500 ms


@pytest.mark.parametrize(
    "bad", [["--spread", "5,1"], ["--spread", "x"], ["--tasks", "0"], ["--rounds", "0"]]
)
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)
