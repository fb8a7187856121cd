"""pgq's ratios to the other brokers, and the printed table."""

from __future__ import annotations

from statistics import median
from typing import Any

from benchmarks.phases import summarize

__all__ = [
    "PGQ_VARIANTS",
    "RATIO_MEANING",
    "combine",
    "format_report",
    "pgbench_ratios",
    "ratios",
]

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


PGQ_VARIANTS = ("pgq", "pgq-async")


def ratios(brokers: dict[str, dict[str, Any]], reference: str = "pgq") -> dict[str, Any]:
    """``reference`` ÷ each other broker that produced numbers, metric by metric (pgq's
    variants are compared with the other brokers, not with each other)."""
    ours = brokers.get(reference, {})
    if ours.get("status") != "ok":
        return {}
    return {
        name: {
            metric: _ratio(_value(ours, section, key), _value(result, section, key))
            for metric, section, key in _METRICS
        }
        for name, result in brokers.items()
        if name not in PGQ_VARIANTS and result.get("status") == "ok"
    }


def combine(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    """Each broker's result over every round (brokers take turns within a round).

    One round: its results as they are. Several: the median publish and drain rate of
    the rounds (and the median split of a publish into broker call and client), and
    latency percentiles of every probe of every round together. Each round's own
    results stay under ``rounds``. A broker that failed or was skipped in any round
    reports that round's outcome instead of numbers.
    """
    if len(rounds) == 1:
        return {name: rounds[0][name] for name in names}
    combined: dict[str, Any] = {}
    for name in names:
        results = [r[name] for r in rounds]
        bad = next((r for r in results if r.get("status") != "ok"), None)
        if bad is not None:
            combined[name] = {**bad, "rounds": results}
            continue
        samples = [ms for r in results for ms in r["latency"]["samples_ms"]]
        combined[name] = {
            "status": "ok",
            "publish": {
                "rate": median(r["publish"]["rate"] for r in results),
                "tasks": sum(r["publish"]["tasks"] for r in results),
                "broker_call_us": median(r["publish"]["broker_call_us"] for r in results),
                "client_us": median(r["publish"]["client_us"] for r in results),
            },
            "drain": {
                "rate": median(r["drain"]["rate"] for r in results),
                "tasks": sum(r["drain"]["tasks"] for r in results),
                "duplicates": sum(r["drain"]["duplicates"] for r in results),
            },
            "latency": summarize(samples),
            "rounds": results,
        }
    return combined


def pgbench_ratios(brokers: dict[str, dict[str, Any]], pgbench: dict[str, Any]) -> dict[str, Any]:
    """Publish rate of each pgq variant ÷ single-row INSERTs/s of pgbench, one client."""
    if pgbench.get("status") != "ok":
        return {}
    return {
        name: _ratio(_value(brokers[name], "publish", "rate"), float(pgbench["tps"]))
        for name in PGQ_VARIANTS
        if brokers.get(name, {}).get("status") == "ok"
    }


# Width of the name column: the longest broker name, "rabbitmq-confirm", and a space.
_NAME = 17


def _cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def _broker_rows(brokers: dict[str, dict[str, Any]]) -> list[str]:
    head = (
        f"{'broker':<{_NAME}}{'publish/s':>12}{'call us':>9}{'drain/s':>12}"
        f"{'p50 ms':>10}{'p99 ms':>10}"
    )
    rows = [f"{head}  status"]
    for name, result in brokers.items():
        status = result.get("status", "?")
        if status != "ok":
            status = f"{status}: {result.get('reason', '')}"
        rows.append(
            f"{name:<{_NAME}}"
            f"{_cell(_value(result, 'publish', 'rate'), '.0f'):>12}"
            f"{_cell(_value(result, 'publish', 'broker_call_us'), '.0f'):>9}"
            f"{_cell(_value(result, 'drain', 'rate'), '.0f'):>12}"
            f"{_cell(_value(result, 'latency', 'p50_ms'), '.2f'):>10}"
            f"{_cell(_value(result, 'latency', 'p99_ms'), '.2f'):>10}"
            f"  {status}"
        )
    return rows


def _ratio_rows(table: dict[str, Any], reference: str = "pgq") -> list[str]:
    if not table:
        return [f"(no ratios: {reference} or every other broker has no numbers)"]
    rows = [f"{reference + ' vs':<{_NAME}}{'publish':>10}{'drain':>10}{'p50':>10}{'p99':>10}"]
    for name, metrics in table.items():
        cells = "".join(f"{_cell(metrics[m], '.2f') + 'x':>10}" for m, _, _ in _METRICS)
        rows.append(f"{name:<{_NAME}}{cells}")
    return rows


def format_report(report: dict[str, Any]) -> str:
    config = report["config"]
    rounds = config.get("rounds", 1)
    head = (
        f"{config['tasks']} tasks, pool {config['pool']} x{config['concurrency']}, "
        f"prefetch x{config['prefetch_multiplier']}, acks_late, "
        f"{config['latency_samples']} latency probes, {config['cpus']} CPUs"
    )
    if rounds > 1:
        head += f"; {rounds} rounds: median rates, latency over every probe of every round"
    lines = [head, "", *_broker_rows(report["brokers"])]
    pgbench = report.get("pgbench", {})
    if pgbench.get("status") == "ok":
        lines.append(
            f"{'pgbench':<{_NAME}}{pgbench['tps']:>12.0f}  single-row INSERT, 1 client "
            "(the connection's limit)"
        )
    lines.append("")
    lines += _ratio_rows(report["ratios"])
    if report.get("ratios_async"):
        lines += _ratio_rows(report["ratios_async"], "pgq-async")
    lines.append("ratio = pgq / other: > 1 better for publish, drain; < 1 better for p50, p99")
    lines.append(
        "call us: of each publish, microseconds inside the broker's publish call "
        "(kombu's Producer._publish); the rest is Celery and kombu, alike for all"
    )
    to_pgbench = report.get("ratios_to_pgbench") or {}
    if to_pgbench:
        lines.append(
            "publish / pgbench: "
            + ", ".join(f"{name} {_cell(value, '.2f')}x" for name, value in to_pgbench.items())
        )
    lines += _after_publish_rows(report["brokers"])
    return "\n".join(lines)


def _after_publish_rows(brokers: dict[str, dict[str, Any]]) -> list[str]:
    """Each broker's probe latency split at the return of its publish call: the call (a
    durable broker waits there for its commit's flush), then the rest."""
    cells = []
    for name, result in brokers.items():
        call = _value(result, "latency", "publish_call_p50_ms")
        after = _value(result, "latency", "after_publish_p50_ms")
        after99 = _value(result, "latency", "after_publish_p99_ms")
        if call is not None and after is not None and after99 is not None:
            cells.append(f"{name} {call:.2f} / {after:.2f} (p99 {after99:.2f})")
    if not cells:
        return []
    return ["latency split, p50 of the publish call / of the rest, ms: " + "; ".join(cells)]
