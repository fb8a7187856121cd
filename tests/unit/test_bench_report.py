"""The broker benchmark's scheduling: brokers taking turns to publish and to be
probed, and how one broker's results over several rounds combine."""

from __future__ import annotations

import time
from typing import Any

from kombu import Connection

from benchmarks.phases import (
    PhaseError,
    broker_call_clock,
    latency_interleaved,
    publish_interleaved,
)
from benchmarks.report import combine, ratios


def result(
    publish: float, drain: float, samples: list[float], call_us: float = 0.0
) -> dict[str, Any]:
    return {
        "status": "ok",
        "publish": {
            "rate": publish,
            "tasks": 10,
            "broker_call_us": call_us,
            "client_us": 1e6 / publish - call_us,
        },
        "drain": {"rate": drain, "tasks": 10, "duplicates": 0},
        "latency": {"p50_ms": 0.0, "p99_ms": 0.0, "samples_ms": samples},
    }


def test_one_round_is_reported_as_it_is() -> None:
    only = {"pgq": result(1.0, 2.0, [1.0])}
    assert combine([only], ["pgq"]) == only


def test_rates_are_the_median_round_and_latency_pools_every_probe() -> None:
    rounds = [
        {"pgq": result(100, 900, [1.0, 2.0], 700), "redis": result(50, 300, [3.0, 4.0])},
        {"pgq": result(300, 700, [5.0, 6.0], 900), "redis": result(70, 100, [7.0, 8.0])},
        {"pgq": result(200, 800, [9.0, 10.0], 800), "redis": result(60, 200, [11.0, 12.0])},
    ]
    combined = combine(rounds, ["pgq", "redis"])
    assert combined["pgq"]["publish"] == {
        "rate": 200,
        "tasks": 30,
        "broker_call_us": 800,
        "client_us": 4200,  # 9300, 2433, 4200
    }
    assert combined["pgq"]["drain"]["rate"] == 800
    latency = combined["pgq"]["latency"]
    assert (latency["samples"], latency["min_ms"], latency["max_ms"]) == (6, 1.0, 10.0)
    assert latency["p50_ms"] == 5.0  # nearest rank over all six probes
    assert combined["pgq"]["rounds"] == [r["pgq"] for r in rounds]
    assert ratios(combined)["redis"]["publish"] == 200 / 60


def test_a_round_that_failed_is_what_the_broker_reports() -> None:
    failed = {"status": "failed", "reason": "worker exited"}
    rounds = [{"pgq": result(1.0, 1.0, [1.0])}, {"pgq": failed}]
    combined = combine(rounds, ["pgq"])
    assert combined["pgq"]["status"] == "failed"
    assert combined["pgq"]["reason"] == "worker exited"
    assert "publish" not in combined["pgq"]


def test_publishers_take_turns_and_a_failing_one_stops_alone() -> None:
    calls: list[tuple[str, int]] = []

    def publisher(name: str, fail_after: int | None = None) -> Any:
        def publish(n: int) -> None:
            if fail_after is not None and len([c for c in calls if c[0] == name]) >= fail_after:
                raise ConnectionError("broker went away")
            calls.append((name, n))

        return publish

    outcome = publish_interleaved(
        {"a": publisher("a"), "b": publisher("b"), "c": publisher("c", fail_after=2)},
        count=7,
        chunk=3,
        timeout=60,
    )
    # A first task alone each, then turns of 3 (reversed every other pass).
    assert calls == [("a", 1), ("b", 1), ("c", 1), ("a", 3), ("b", 3), ("c", 3), ("b", 3), ("a", 3)]
    assert outcome["a"]["tasks"] == outcome["b"]["tasks"] == 7  # type: ignore[index]
    assert isinstance(outcome["c"], PhaseError) and "broker went away" in str(outcome["c"])


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def test_a_publish_is_split_into_the_broker_call_and_the_rest() -> None:
    """Time inside kombu's Producer._publish counts as the broker's, time around it
    as the client's; outside the phase the clock is gone."""
    inside, outside = 0.01, 0.002
    # What the sleeps took, as measured: a loaded machine stretches each of them (a 2 ms
    # sleep took 19 ms at load 26), so the bounds are the measured times, not the asked.
    spent_inside: list[float] = []
    spent_outside: list[float] = []
    with Connection("memory://") as conn:
        channel = conn.default_channel
        original = channel.basic_publish

        def slow_basic_publish(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            _sleep_until(started + inside)
            spent_inside.append(time.perf_counter() - started)
            return original(*args, **kwargs)

        channel.basic_publish = slow_basic_publish  # type: ignore[method-assign]
        producer = conn.Producer(channel, routing_key="split")

        def publish(n: int) -> None:
            for _ in range(n):
                started = time.perf_counter()
                _sleep_until(started + outside)  # the client's own work
                spent_outside.append(time.perf_counter() - started)
                producer.publish({"n": 1})

        outcome = publish_interleaved({"memory": publish}, count=6, chunk=5, timeout=60)
        found = outcome["memory"]
        assert not isinstance(found, PhaseError)
        assert found["broker_call_us"] >= min(spent_inside) * 1e6
        # The client's share holds its own work and not the broker call's.
        client_work = sum(spent_outside) / len(spent_outside)
        assert min(spent_outside) * 1e6 <= found["client_us"]
        assert found["client_us"] < (client_work + min(spent_inside)) * 1e6
        # The clock counts only while a phase is open.
        with broker_call_clock() as clock:
            assert clock() == 0.0
            producer.publish({"n": 2})
            during = clock()
        producer.publish({"n": 3})
        assert during >= inside and clock() == during


def test_probes_take_turns_warm_up_uncounted_and_a_failing_one_stops_alone() -> None:
    calls: list[tuple[str, int]] = []

    def prober(name: str, took: float, fail_at: int | None = None) -> Any:
        def one(seq: int) -> tuple[float, float]:
            calls.append((name, seq))
            if seq == fail_at:
                raise TimeoutError("worker stopped answering")
            return took + seq, took / 10

        return one

    outcome = latency_interleaved(
        {"a": prober("a", 1.0), "b": prober("b", 2.0), "c": prober("c", 3.0, fail_at=2)},
        samples=3,
        max_gap=0.0,
        warmup=1,
    )
    # One probe each per pass, in reverse order every other pass; c stops at its failure.
    assert calls == [
        ("a", 0),
        ("b", 0),
        ("c", 0),
        ("c", 1),
        ("b", 1),
        ("a", 1),
        ("a", 2),
        ("b", 2),
        ("c", 2),
        ("b", 3),
        ("a", 3),
    ]
    a, b, c = outcome["a"], outcome["b"], outcome["c"]
    assert not isinstance(a, PhaseError) and not isinstance(b, PhaseError)
    # The warm-up pass (seq 0) is not counted.
    assert a["samples_ms"] == [2.0, 3.0, 4.0] and a["samples"] == 3
    assert b["samples_ms"] == [3.0, 4.0, 5.0] and b["p50_ms"] == 4.0 and b["p99_ms"] == 5.0
    assert b["publish_call_p50_ms"] == 0.2
    assert isinstance(c, PhaseError) and "probe 2 failed" in str(c)
    assert "worker stopped answering" in str(c)
