"""pgq's ratios to the other brokers, and the printed table."""

from __future__ import annotations

from typing import Any

__all__ = ["RATIO_MEANING", "format_report", "ratios"]

RATIO_MEANING = (
    "pgq's value divided by the other broker's: above 1 is better for publish and drain "
    "(rates), below 1 is better for latency_p50 and latency_p99 (times)"
)

# (ratio key, result section, field) of every compared number.
_METRICS = (
    ("publish", "publish", "rate"),
    ("drain", "drain", "rate"),
    ("latency_p50", "latency", "p50_ms"),
    ("latency_p99", "latency", "p99_ms"),
)


def _value(result: dict[str, Any], section: str, key: str) -> float | None:
    value = result.get(section, {}).get(key)
    return float(value) if value is not None else None


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def ratios(brokers: dict[str, dict[str, Any]], reference: str = "pgq") -> dict[str, Any]:
    """pgq ÷ each other broker that produced numbers, metric by metric."""
    ours = brokers.get(reference, {})
    if ours.get("status") != "ok":
        return {}
    return {
        name: {
            metric: _ratio(_value(ours, section, key), _value(result, section, key))
            for metric, section, key in _METRICS
        }
        for name, result in brokers.items()
        if name != reference and result.get("status") == "ok"
    }


def _cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def _broker_rows(brokers: dict[str, dict[str, Any]]) -> list[str]:
    rows = [f"{'broker':<10}{'publish/s':>12}{'drain/s':>12}{'p50 ms':>10}{'p99 ms':>10}  status"]
    for name, result in brokers.items():
        status = result.get("status", "?")
        if status != "ok":
            status = f"{status}: {result.get('reason', '')}"
        rows.append(
            f"{name:<10}"
            f"{_cell(_value(result, 'publish', 'rate'), '.0f'):>12}"
            f"{_cell(_value(result, 'drain', 'rate'), '.0f'):>12}"
            f"{_cell(_value(result, 'latency', 'p50_ms'), '.2f'):>10}"
            f"{_cell(_value(result, 'latency', 'p99_ms'), '.2f'):>10}"
            f"  {status}"
        )
    return rows


def _ratio_rows(table: dict[str, Any]) -> list[str]:
    if not table:
        return ["(no ratios: pgq or every other broker has no numbers)"]
    rows = [f"{'pgq vs':<10}{'publish':>10}{'drain':>10}{'p50':>10}{'p99':>10}"]
    for name, metrics in table.items():
        cells = "".join(f"{_cell(metrics[m], '.2f') + 'x':>10}" for m, _, _ in _METRICS)
        rows.append(f"{name:<10}{cells}")
    rows.append("ratio = pgq / other: > 1 better for publish, drain; < 1 better for p50, p99")
    return rows


def format_report(report: dict[str, Any]) -> str:
    config = report["config"]
    head = (
        f"{config['tasks']} tasks, pool {config['pool']} x{config['concurrency']}, "
        f"prefetch x{config['prefetch_multiplier']}, acks_late, "
        f"{config['latency_samples']} latency probes, {config['cpus']} CPUs"
    )
    lines = [head, "", *_broker_rows(report["brokers"]), "", *_ratio_rows(report["ratios"])]
    return "\n".join(lines)
