"""Celery's own integration suite on pgq and on RabbitMQ, in one run, compared.

    python -m tests.conformance.celery_suite [--brokers pgq,rabbitmq] [--out DIR] [-k EXPR]

Runs ``t/integration`` of the installed Celery's sdist (fetched by :mod:`tests.upstream`)
once per broker, each with Celery's own pytest settings, the same Redis result backend
and a broker of its own: a fresh pgq schema, a fresh RabbitMQ vhost (made with
``rabbitmqctl`` where it is at hand, else ``/``). Writes each broker's JUnit XML, a
``summary.json`` and a ``summary.md`` (counts per broker, and every test whose outcome
differs) under ``--out``. Exits 1 when a test that passed on RabbitMQ did not pass on
pgq and is not one of :data:`KNOWN_DIFFERENCES` (each listed, with its reason, in
docs/conformance.md), 0 otherwise. Takes tens of minutes; not part of the default run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from tests.upstream import source_tree

__all__ = [
    "KNOWN_DIFFERENCES",
    "Comparison",
    "compare",
    "main",
    "outcomes",
]

#: Tests that pass on RabbitMQ and not on pgq, by design, with why (docs/conformance.md).
KNOWN_DIFFERENCES: dict[str, str] = {
    "t/integration/test_inspect.py::test_Inspect::test_scheduled": (
        "ETA tasks wait in Postgres (native_delayed_delivery), in no worker's timer: "
        "`pgq delayed` lists them; the test passes with native_delayed_delivery off"
    ),
    "t/integration/test_tasks.py::test_task_replacement::test_replaced_task_nesting_level_0": (
        "the test clears the flag its task_received handler sets after .delay() returns; "
        "on pgq the worker has often received the task by then (it is delivered as soon "
        "as its publish has committed)"
    ),
    "t/integration/test_canvas.py::test_chain::"
    "test_chord_header_id_duplicated_on_rabbitmq_msg_duplication[redis-group-ids]": (
        "the test republishes with every keyword of before_task_publish as a message "
        "property, the Signal object included, which a JSON transport cannot carry "
        "(Celery expects this failure on Redis and marks it xfail there)"
    ),
}

#: Outcomes as JUnit XML tells them (an unexpected pass that is not strict is "passed").
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/13"
RABBITMQ = "pyamqp://guest:guest@127.0.0.1:5672/{vhost}"
# A whole suite on one broker, on a slow or shared machine.
SUITE_TIMEOUT = 3 * 3600


def outcomes(junit_xml: str) -> dict[str, str]:
    """Each test's final outcome (one of :data:`OUTCOMES`) in a pytest JUnit XML report,
    by ``module::class::name`` id."""
    found: dict[str, str] = {}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        found[_node_id(case.get("classname", ""), case.get("name", ""))] = _outcome(case)
    return found


def _node_id(classname: str, name: str) -> str:
    """pytest's id of a test from JUnit's dotted ``classname``: the module is the first
    ``test_*`` part, classes follow it."""
    parts = classname.split(".")
    module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1 :], name])


def _outcome(case: ET.Element) -> str:
    if case.find("failure") is not None:
        return "failed"
    if case.find("error") is not None:
        return "error"
    skipped = case.find("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


@dataclass(frozen=True)
class Comparison:
    counts: dict[str, dict[str, int]]  # broker -> outcome -> tests
    differing: dict[str, dict[str, str]]  # test -> broker -> outcome, where they differ
    unexplained: list[str]  # passed on RabbitMQ, not on pgq, not a known difference

    def markdown(self, versions: Mapping[str, str]) -> str:
        brokers = list(self.counts)
        lines = [
            "Celery's t/integration, " + ", ".join(f"{k} {v}" for k, v in versions.items()),
            "",
            "| outcome | " + " | ".join(brokers) + " |",
            "|---|" + "---|" * len(brokers),
        ]
        for outcome in (*OUTCOMES, "total"):
            cells = [str(self.counts[b].get(outcome, 0)) for b in brokers]
            lines.append(f"| {outcome} | " + " | ".join(cells) + " |")
        if self.differing:
            lines += ["", "| test | " + " | ".join(brokers) + " | known difference |"]
            lines.append("|---|" + "---|" * (len(brokers) + 1))
            for test, by_broker in sorted(self.differing.items()):
                cells = [by_broker.get(b, "not run") for b in brokers]
                known = "yes" if test in KNOWN_DIFFERENCES else ""
                lines.append(f"| `{test}` | " + " | ".join(cells) + f" | {known} |")
        return "\n".join(lines) + "\n"


def compare(results: Mapping[str, Mapping[str, str]], *, baseline: str = "rabbitmq") -> Comparison:
    """Counts per broker, the tests whose outcome differs between brokers, and those
    that passed on ``baseline`` but not on pgq, unexplained."""
    counts: dict[str, dict[str, int]] = {}
    for broker, found in results.items():
        tally = Counter(found.values())
        counts[broker] = {o: tally.get(o, 0) for o in OUTCOMES} | {"total": len(found)}
    tests = sorted({t for found in results.values() for t in found})
    differing = {
        t: {b: found.get(t, "not run") for b, found in results.items()}
        for t in tests
        if len({found.get(t, "not run") for found in results.values()}) > 1
    }
    unexplained = []
    if "pgq" in results and baseline in results:
        unexplained = [
            t
            for t in tests
            if results[baseline].get(t) == "passed"
            and results["pgq"].get(t) != "passed"
            and t not in KNOWN_DIFFERENCES
        ]
    return Comparison(counts, differing, unexplained)


@contextmanager
def pgq_broker(pg_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A pgq broker URL on a schema of its own, dropped afterwards; its environment."""
    schema = f"pgq_celery_suite_{uuid.uuid4().hex[:8]}"
    url = "pgq://" + pg_url.split("://", 1)[1]
    try:
        yield url, {"PGQ_SCHEMA": schema}
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextmanager
def rabbitmq_broker() -> Iterator[tuple[str, dict[str, str]]]:
    """A RabbitMQ broker URL on a vhost of its own where rabbitmqctl can make one."""
    ctl = shutil.which("rabbitmqctl")
    vhost = f"pgq-celery-suite-{uuid.uuid4().hex[:8]}"
    made = False
    if ctl is not None:
        made = _ctl(ctl, "add_vhost", vhost) and _ctl(
            ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"
        )
    if not made:
        print("rabbitmqctl unavailable: RabbitMQ runs on vhost /", file=sys.stderr)
    try:
        yield RABBITMQ.format(vhost=vhost if made else ""), {}
    finally:
        if made and ctl is not None:
            _ctl(ctl, "delete_vhost", vhost)


def _ctl(ctl: str, *args: str) -> bool:
    done = subprocess.run([ctl, *args], capture_output=True, timeout=120, check=False)
    return done.returncode == 0


BROKERS = {"pgq": pgq_broker, "rabbitmq": rabbitmq_broker}


def run_suite(
    tree: Path,
    broker_url: str,
    env: Mapping[str, str],
    backend: str,
    report: Path,
    extra: Sequence[str],
) -> float:
    """Celery's integration suite against ``broker_url``; seconds it took."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "t/integration",
        "-c",
        str(tree / "pyproject.toml"),
        "--rootdir",
        str(tree),
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-q",
        "-rfE",
        f"--junitxml={report}",
        *extra,
    ]
    environment = {**os.environ, **env, "TEST_BROKER": broker_url, "TEST_BACKEND": backend}
    started = time.monotonic()
    subprocess.run(command, cwd=tree, env=environment, timeout=SUITE_TIMEOUT, check=False)
    return time.monotonic() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--brokers", default="pgq,rabbitmq")
    parser.add_argument("--out", default="celery-suite-results")
    parser.add_argument("--pg-url", default=os.environ.get("PGQ_TEST_URL", DEFAULT_PG_URL))
    parser.add_argument("--backend", default=DEFAULT_REDIS, help="result backend of every run")
    parser.add_argument("-k", dest="keyword", help="pytest -k: a part of the suite only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tree = source_tree("celery")
    extra = ["-k", args.keyword] if args.keyword else []
    results: dict[str, dict[str, str]] = {}
    seconds: dict[str, float] = {}
    for broker in args.brokers.split(","):
        report = out / f"{broker}.xml"
        with BROKERS[broker](*([args.pg_url] if broker == "pgq" else [])) as (url, env):
            seconds[broker] = run_suite(tree, url, env, args.backend, report, extra)
        results[broker] = outcomes(report.read_text()) if report.exists() else {}
    versions = {p: importlib.metadata.version(p) for p in ("celery", "kombu", "pgq", "amqp")}
    comparison = compare(results)
    (out / "summary.md").write_text(comparison.markdown(versions))
    summary = {
        "versions": versions,
        "seconds": seconds,
        "counts": comparison.counts,
        "differing": comparison.differing,
        "unexplained": comparison.unexplained,
        "results": results,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    print(comparison.markdown(versions))
    for test in comparison.unexplained:
        print(f"passed on RabbitMQ, not on pgq: {test}")
    return 1 if comparison.unexplained else 0


if __name__ == "__main__":
    raise SystemExit(main())
