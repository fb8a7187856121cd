"""The result-backend benchmark runs end to end on a small scale (pgq and Redis)."""

from __future__ import annotations

import json

import pytest
import redis

from benchmarks.backends import main

pytestmark = pytest.mark.benchmark


def test_the_backends_benchmark_reports_every_figure(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/14", socket_connect_timeout=3).ping()
    except redis.RedisError:
        pytest.skip("needs Redis on 127.0.0.1:6379")
    argv = ["--backends", "pgq,redis", "--pg-url", pg_url, "--probes", "20"]
    argv += ["--chord-parts", "20", "--chord-rounds", "1", "--waiters", "20"]
    argv += ["--nap", "20", "--window", "2", "--json"]
    assert main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == {"pgq", "redis"}
    for kind, f in figures.items():
        assert f["round_trip"]["p50_ms"] > 0, kind
        # The result's leg is part of the round trip, and each round's load is kept.
        leg = f["round_trip"]["result_leg_p50_ms"]
        assert 0 < leg <= f["round_trip"]["p50_ms"], (kind, f["round_trip"])
        assert all(len(r["loadavg"]["before"]) == 3 for r in f["round_trip"]["rounds"]), kind
        assert f["chord"]["lag_s"] < 5, kind
        assert f["waiting"]["waiters"] == 20 and f["waiting_tenth"]["waiters"] == 2
