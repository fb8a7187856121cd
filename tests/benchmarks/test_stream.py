"""The stream benchmark runs every task it publishes once, with a real worker running
alongside the producer, and says why a broker has no numbers.

Small (150 tasks, pgq alone), so it runs with the default tests where the
timing sink's Redis answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median

import pytest
import redis

from benchmarks.stream import main, summarize

TASKS = 150


@pytest.fixture(autouse=True)
def _sink() -> None:
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/15", socket_connect_timeout=3).ping()
    except redis.RedisError:
        pytest.skip("the timing sink needs Redis on 127.0.0.1:6379")


@pytest.mark.sessions(8)  # 7 seen
def test_every_task_of_the_stream_runs_once(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--brokers",
        "pgq",
        "--tasks",
        str(TASKS),
        "--rounds",
        "2",
        "--pg-url",
        pg_url,
        "--concurrency",
        "2",
        "--log-dir",
        str(tmp_path),
        "--no-save",
        "--json",
        "--phase-timeout",
        "120",
    ]
    assert main(argv) == 0
    found = json.loads(capsys.readouterr().out)
    pgq = found["pgq"]
    assert pgq["status"] == "ok" and len(pgq["rounds"]) == 2
    for stream in pgq["rounds"]:
        # Every task counted once: the untimed first one is not among them.
        assert stream["tasks"] == TASKS and stream["duplicates"] == 0
        assert stream["publish"] > 0 and stream["through"] > 0
        # A stream: the worker had run a task before the producer was done publishing.
        assert 0 < stream["first"] < TASKS / stream["publish"], stream
    for measure in ("publish", "through", "lag"):
        assert pgq[measure] == median(s[measure] for s in pgq["rounds"])


def test_a_broker_without_numbers_says_why() -> None:
    rounds = [
        {
            "pgq": {"status": "ok", "stream": {"publish": 3.0, "through": 2.0, "lag": 0.1}},
            "rabbitmq": {"status": "skipped", "reason": "no answer"},
        },
        {
            "pgq": {"status": "failed", "reason": "worker exited"},
            "rabbitmq": {"status": "failed", "reason": "timed out"},
        },
    ]
    found = summarize(rounds)
    assert found["pgq"]["status"] == "ok" and found["pgq"]["through"] == 2.0
    assert len(found["pgq"]["rounds"]) == 1  # the failed round left out
    assert found["rabbitmq"] == {"status": "failed", "reason": "timed out"}
