"""docker/grafana-dashboard.json asks Prometheus only for what `pgq metrics` exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pg_transport.ops import metrics
from pg_transport.ops.status import BarrierCount, Clients, QueueStatus, Status

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana-dashboard.json"

#: PromQL's functions, aggregations and keywords the dashboard may use.
PROMQL = {
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "by", "without", "delta",
    "rate", "increase", "deriv", "max_over_time", "min_over_time", "avg_over_time",
    "label_values", "clamp_min", "abs", "on", "ignoring", "and", "or", "unless", "offset",
}  # fmt: skip


def exported() -> dict[str, set[str]]:
    """Every family the exporter emits, with its label names (one sample of each)."""
    report = Status(
        "pgq",
        [QueueStatus("celery", 1, 1, 1, 1, 2.0), QueueStatus("w@h.celery.pidbox", 1, 0, 0, 0, 1)],
        Clients(1, 2),
        [BarrierCount("armed", 1)],
    )
    return {
        f.name: {key for labels, _ in f.samples for key in labels}
        for f in metrics.families(report, 0.1)
    }


def queries(node: Any) -> list[str]:
    """Every PromQL text in the dashboard: panel targets and template queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, dict) and "query" in value:
                found.append(str(value["query"]))
            else:
                found.extend(queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(queries(item))
    return found


def references(expr: str) -> list[tuple[str, set[str]]]:
    """The metric names an expression reads, each with the label names it matches on."""
    refs = []
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", expr):
        if name in PROMQL:
            continue
        refs.append((name, set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*=~?", matchers))))
    return refs


def cleaned(expr: str) -> str:
    """``expr`` without its range selectors, numbers, strings and $variables."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)
    # Label names after by/without, and label_values' second argument, are labels.
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"label_values\(([^,]+),\s*\w+\)", r"label_values(\1)", expr)
    return re.sub(r"\b\d+(\.\d+)?\b", "", expr)


def test_every_query_reads_only_metrics_and_labels_the_exporter_emits() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    families = exported()
    texts = queries(dashboard)
    assert len(texts) >= 10
    seen: set[str] = set()
    for expr in texts:
        refs = references(cleaned(expr))
        assert refs, expr
        for name, labels in refs:
            assert name in families, f"{expr!r} reads {name!r}, which pgq metrics does not emit"
            assert labels <= families[name], f"{expr!r} matches labels {name} does not have"
            seen.add(name)
    # The per-queue figures a user watches are all on it.
    for name in (
        "pgq_queue_ready_messages",
        "pgq_queue_oldest_ready_age_seconds",
        "pgq_queue_dead_messages",
        "pgq_client_processes",
    ):
        assert name in seen


def test_every_legend_names_a_label_of_its_metrics() -> None:
    families = exported()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            names = [n for n, _ in references(cleaned(target["expr"]))]
            for label in wanted:
                assert any(label in families[n] for n in names), (panel["title"], label)


def test_a_misspelt_metric_is_caught() -> None:
    families = exported()
    refs = references(cleaned('sum(pgq_queue_redy_messages{queue=~"$queue"})'))
    assert [name for name, _ in refs if name not in families] == ["pgq_queue_redy_messages"]
