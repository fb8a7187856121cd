"""The broker benchmark still runs end to end and reports sane numbers.

Deselected by default (``-m benchmark`` runs it): it starts real workers on every
broker that answers, which takes about a minute.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from benchmarks.phases import percentile
from benchmarks.report import pgbench_ratios, ratios

pytestmark = pytest.mark.benchmark

ROOT = Path(__file__).resolve().parents[2]
BROKERS = ("pgq", "pgq-async", "redis", "redis-fsync", "rabbitmq", "rabbitmq-confirm", "sqla")
TASKS = 200
PROBES = 5


def _sink_reachable(url: str = "redis://127.0.0.1:6379/15") -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=3).ping())
    except redis.RedisError:
        return False


def _run_benchmark(pg_url: str, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    output = tmp_path / "result.json"
    command = [
        sys.executable, "-m", "benchmarks.brokers",
        "--tasks", str(TASKS), "--latency-samples", str(PROBES), "--probe-gap", "0.05",
        "--pg-url", pg_url, "--json", "--output", str(output),
        "--log-dir", str(tmp_path / "logs"), "--phase-timeout", "120", "--pgbench-seconds", "1",
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout), output


def _assert_sane(name: str, result: dict[str, Any]) -> None:
    publish, drain, latency = result["publish"], result["drain"], result["latency"]
    assert publish["tasks"] == TASKS and publish["rate"] > 0, (name, publish)
    # Both parts of a publish took time, and together they are its whole time.
    assert publish["broker_call_us"] > 0 and publish["client_us"] > 0, (name, publish)
    per_publish_us = 1e6 / publish["rate"]
    assert abs(publish["broker_call_us"] + publish["client_us"] - per_publish_us) < (
        0.01 * per_publish_us
    ), (name, publish)
    assert drain["tasks"] >= TASKS and drain["rate"] > 0, (name, drain)
    assert latency["samples"] == PROBES, (name, latency)
    assert 0 < latency["p50_ms"] <= latency["p99_ms"], (name, latency)
    assert latency["min_ms"] <= latency["p50_ms"] and latency["p99_ms"] <= latency["max_ms"]
    # The split at the publish call's return: the part after it is at most the whole (a
    # broker may start the task before its call returns: negative then).
    after50, after99 = latency["after_publish_p50_ms"], latency["after_publish_p99_ms"]
    assert after50 <= after99 <= latency["max_ms"], (name, latency)
    # The drain's worker and the idle one probed for latency both started and stopped.
    for key in ("worker", "probe_worker"):
        assert result[key]["ready_seconds"] is not None, (name, key, result[key])
        assert result[key]["exit_code"] == 0, (name, key, result[key])


def _assert_load_per_broker(measured: dict[str, dict[str, Any]]) -> None:
    """Each broker's load average, phase by phase; the drain's its own (the brokers
    drain one after another: no two drain windows overlap), the phases where they take
    turns the same for all."""
    for name, result in measured.items():
        assert set(result["loadavg"]) == {"publish", "drain", "latency"}, name
        for phase, load in result["loadavg"].items():
            assert len(load["before"]) == 3 and len(load["after"]) == 3, (name, phase)
            assert load["from"] <= load["to"], (name, phase, load)
    drains = sorted(
        (r["loadavg"]["drain"]["from"], r["loadavg"]["drain"]["to"]) for r in measured.values()
    )
    assert all(ended <= began for (_, ended), (began, _) in itertools.pairwise(drains)), drains
    for phase in ("publish", "latency"):
        assert len({json.dumps(r["loadavg"][phase]) for r in measured.values()}) == 1, phase


@pytest.mark.timeout(900)
def test_benchmark_reports_every_broker(pg_url: str, tmp_path: Path) -> None:
    if not _sink_reachable():
        pytest.skip("the benchmark's timing sink needs Redis on 127.0.0.1:6379")
    report, saved = _run_benchmark(pg_url, tmp_path)

    assert json.loads(saved.read_text()) == report
    assert {"config", "brokers", "ratios", "ratio_meaning", "run_id"} <= report.keys()
    assert report["config"]["tasks"] == TASKS
    assert set(report["brokers"]) == set(BROKERS)
    assert report["brokers"]["pgq"]["status"] == "ok", report["brokers"]["pgq"]
    for name, result in report["brokers"].items():
        assert result["status"] in ("ok", "skipped"), (name, result)
        if result["status"] == "ok":
            _assert_sane(name, result)
        else:
            assert result["reason"], name
    assert report["brokers"]["pgq-async"]["status"] == "ok", report["brokers"]["pgq-async"]
    _assert_load_per_broker({n: r for n, r in report["brokers"].items() if r["status"] == "ok"})
    compared = {
        n for n, r in report["brokers"].items() if not n.startswith("pgq") and r["status"] == "ok"
    }
    for table in ("ratios", "ratios_async"):
        assert set(report[table]) == compared
        for metrics in report[table].values():
            assert set(metrics) == {"publish", "drain", "latency_p50", "latency_p99"}
            assert all(value is not None and value > 0 for value in metrics.values())
    # The single-connection limit the publish rates are compared with.
    if report["pgbench"]["status"] == "ok":
        assert report["pgbench"]["tps"] > 0
        assert set(report["ratios_to_pgbench"]) == {"pgq", "pgq-async"}
    else:
        assert report["pgbench"]["reason"]


def test_percentile_is_an_observed_value_and_monotonic() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([5.0, 1.0], 0.5) <= percentile([5.0, 1.0], 0.99)


def test_ratios_compare_only_brokers_with_numbers() -> None:
    def ok(rate: float, p50: float) -> dict[str, Any]:
        return {
            "status": "ok",
            "publish": {"rate": rate},
            "drain": {"rate": rate},
            "latency": {"p50_ms": p50, "p99_ms": p50 * 2},
        }

    brokers = {
        "pgq": ok(100, 4),
        "pgq-async": ok(150, 3),
        "redis": ok(200, 2),
        "sqla": {"status": "skipped"},
    }
    table = ratios(brokers)
    assert set(table) == {"redis"}  # pgq's variants are not compared with each other
    assert table["redis"] == {"publish": 0.5, "drain": 0.5, "latency_p50": 2.0, "latency_p99": 2.0}
    assert ratios({"pgq": {"status": "failed"}, "redis": ok(1, 1)}) == {}


def test_publish_rates_are_compared_with_pgbench() -> None:
    brokers = {
        "pgq": {"status": "ok", "publish": {"rate": 1000.0}},
        "pgq-async": {"status": "failed"},
        "redis": {"status": "ok"},
    }
    assert pgbench_ratios(brokers, {"status": "ok", "tps": 4000.0}) == {"pgq": 0.25}
    assert pgbench_ratios(brokers, {"status": "skipped", "reason": "no pgbench"}) == {}
