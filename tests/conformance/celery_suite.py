"""Celery's own integration suite on pgq and on RabbitMQ, in one run, compared.

    python -m tests.conformance.celery_suite [--runs rabbitmq,pgq,pgq-backend] [--out DIR]
                                             [-k EXPR] [--compare DIR]

Runs ``t/integration`` of the installed Celery's sdist (fetched by :mod:`tests.upstream`)
once per run, each with Celery's own pytest settings:

- ``rabbitmq``: RabbitMQ (a fresh vhost, made with ``rabbitmqctl`` where it is at hand,
  else ``/``) with the Redis result backend (``--backend``): the baseline;
- ``pgq``: pgq as broker (a fresh schema) with the same Redis result backend;
- ``pgq-backend``: pgq as broker *and* result backend (one fresh schema), on a copy of
  the suite whose tests gated on a Redis result backend where Redis is only a side
  channel are opened to pgq (:func:`open_redis_gates`; the suite's side channel is the
  Redis at ``REDIS_HOST``/``REDIS_PORT``, as in Celery's own runs).

Writes each run's JUnit XML, a ``summary.json`` and a ``summary.md`` (counts per run, and
every test whose outcome differs) under ``--out``; ``--compare DIR`` compares the reports
already in DIR (``<run>.xml``) without running anything. Exits 1 when a test that passed
on RabbitMQ did not pass on a pgq run and is not one of that run's listed differences
(:data:`KNOWN_DIFFERENCES`, and :data:`KNOWN_BACKEND_DIFFERENCES` for ``pgq-backend``;
each listed, with its reason, in docs/conformance.md), 0 otherwise. Takes tens of
minutes per run; not part of the default run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
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
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

from tests.upstream import source_tree

__all__ = [
    "KNOWN_BACKEND_DIFFERENCES",
    "KNOWN_DIFFERENCES",
    "Comparison",
    "compare",
    "main",
    "open_redis_gates",
    "outcomes",
    "side_channel",
    "suite_environment",
]

#: Tests that pass on RabbitMQ and not on pgq as broker, by design, with why
#: (docs/conformance.md). They apply to both pgq runs.
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

#: Tests that pass on RabbitMQ + Redis and not with pgq as result backend too (the
#: ``pgq-backend`` run), with why (docs/conformance.md).
KNOWN_BACKEND_DIFFERENCES: dict[str, str] = {
    "t/integration/test_canvas.py::test_chord::"
    "test_mutable_errback_called_by_chord_from_group_fail_multiple_on_body_failure"
    "[errback_new_style]": (
        "timing: it needs a 50-task body with 42 errbacks run within about 1 s of the "
        "send; each result is a Postgres commit, and on a loaded machine fewer have run "
        "by then (every errback runs, exactly once, within seconds)"
    ),
    "t/integration/test_redis_backend.py": (
        "tests Redis's result backend itself (its keys, pub/sub channels and connection "
        "pool); gated on a redis:// backend, left gated"
    ),
    "t/integration/test_backend_leak_in_fixture_teardown.py": (
        "tests RedisBackend's connection pool (gated on isinstance(app.backend, "
        "RedisBackend)), left gated"
    ),
    "t/integration/test_tasks.py::test_task_redis_result_backend": (
        "its tests read the Redis backend's pub/sub channels (PUBSUB CHANNELS); its "
        "fixture gates the whole class, left gated"
    ),
    "t/integration/test_canvas.py::test_chord::test_redis_subscribed_channels_leak": (
        "reads the Redis backend's pub/sub channels (PUBSUB CHANNELS), left gated"
    ),
    "t/integration/test_canvas.py::test_result_set::"
    "test_join_native_timeout_zero_gives_up_on_pending_results": (
        "gated on Celery's key/value backend class (the get_many poll loop); pgq's "
        "backend is not one: join_native waits on its LISTEN-fed result consumer"
    ),
    "t/integration/test_canvas.py::test_result_set::"
    "test_join_native_timeout_zero_returns_results_that_are_ready": (
        "gated on Celery's key/value backend class (the get_many poll loop); pgq's "
        "backend is not one: join_native waits on its LISTEN-fed result consumer"
    ),
    "t/integration/test_canvas.py::test_chord::test_simple_chord_with_a_delay_in_group_save": (
        "gated on Celery's key/value backend class: it slows the key/value backends' "
        "chord counter (_apply_chord_incr), which pgq's native chords do not use"
    ),
}

#: The baseline, and the runs compared with it.
BASELINE = "rabbitmq"
PGQ_RUNS = ("pgq", "pgq-backend")

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
    counts: dict[str, dict[str, int]]  # run -> outcome -> tests
    differing: dict[str, dict[str, str]]  # test -> run -> outcome, where they differ
    unexplained: list[str]  # "run: test": passed on RabbitMQ, not on that pgq run, not listed

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
            lines += ["", "| test | " + " | ".join(brokers) + " | listed difference for |"]
            lines.append("|---|" + "---|" * (len(brokers) + 1))
            for test, by_broker in sorted(self.differing.items()):
                cells = [by_broker.get(b, "not run") for b in brokers]
                known = ", ".join(r for r in PGQ_RUNS if r in self.counts and listed(test, r))
                lines.append(f"| `{test}` | " + " | ".join(cells) + f" | {known} |")
        return "\n".join(lines) + "\n"


def known_differences(run: str) -> dict[str, str]:
    """The tests listed as passing on the baseline and not on ``run``, with why."""
    if run == "pgq-backend":
        return KNOWN_DIFFERENCES | KNOWN_BACKEND_DIFFERENCES
    return dict(KNOWN_DIFFERENCES)


def listed(test: str, run: str) -> bool:
    """Whether ``test`` is a listed difference of ``run``: by its id, or by its module's
    or class's (every test in it)."""
    known = known_differences(run)
    return any(test == key or test.startswith(key + "::") for key in known)


def compare(results: Mapping[str, Mapping[str, str]], *, baseline: str = BASELINE) -> Comparison:
    """Counts per run, the tests whose outcome differs between runs, and those that
    passed on ``baseline`` but not on a pgq run, unexplained (as ``run: test``)."""
    counts: dict[str, dict[str, int]] = {}
    for run, found in results.items():
        tally = Counter(found.values())
        counts[run] = {o: tally.get(o, 0) for o in OUTCOMES} | {"total": len(found)}
    tests = sorted({t for found in results.values() for t in found})
    differing = {
        t: {r: found.get(t, "not run") for r, found in results.items()}
        for t in tests
        if len({found.get(t, "not run") for found in results.values()}) > 1
    }
    unexplained = []
    if baseline in results:
        for run in (r for r in PGQ_RUNS if r in results):
            unexplained += [
                f"{run}: {t}"
                for t in tests
                if results[baseline].get(t) == "passed"
                and results[run].get(t) != "passed"
                and not listed(t, run)
            ]
    return Comparison(counts, differing, unexplained)


#: The suite's test modules whose Redis-backend gates :func:`open_redis_gates` opens.
GATED_MODULES = ("test_canvas.py", "test_tasks.py", "test_group_chains.py")
#: A gate: ``if not <app>.conf.result_backend.startswith('redis')`` (or ``('redis', 'rpc')``).
GATE = re.compile(
    r"""(?P<head>if not [\w.]+\.result_backend\.startswith\()"""
    r"""(?P<what>['"]redis['"]|\(['"]redis['"], ['"]rpc['"]\))\)"""
)
#: A test that uses one of these reads the Redis result backend's own state: its pub/sub
#: channels, or the keys its chords keep (``get_key_for_group``, the ``.j`` join list).
#: Its gate stays closed (Redis is what it tests, not a side channel).
REDIS_BACKEND_ONLY = ("get_active_redis_channels", "get_key_for_group")
DEF = re.compile(r"^(?P<indent>\s*)(async\s+)?def\s+(?P<name>\w+)")
CLASS = re.compile(r"^(?P<indent>\s*)class\s+(?P<name>\w+)")


def open_redis_gates(tree: Path, into: Path) -> list[str]:
    """Copy Celery's suite (``tree``) to ``into`` with the tests gated on a Redis result
    backend, where Redis is only a side channel, opened to pgq's backend; the opened
    gates, as ``module::function``.

    A gate ``if not ….result_backend.startswith('redis'):`` (or ``('redis', 'rpc')``)
    in :data:`GATED_MODULES` becomes ``….startswith(('redis', 'pgq'))`` (or with
    ``'rpc'``), unless its function reads the Redis backend's own pub/sub channels or
    chord keys (:data:`REDIS_BACKEND_ONLY`). Those, test_redis_backend.py and the
    ``isinstance(app.backend, RedisBackend)`` gate stay as they are: they test Redis's
    backend itself. The copy's ``t/`` holds a ``PGQ-PATCH.md`` listing what was opened.
    Raises RuntimeError when a module has no gate left to open (another Celery)."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(tree, into)
    opened: list[str] = []
    kept: list[str] = []
    for module in GATED_MODULES:
        path = into / "t" / "integration" / module
        lines = path.read_text().splitlines(keepends=True)
        found = 0
        for number, line in enumerate(lines):
            gate = GATE.search(line)
            if gate is None:
                continue
            found += 1
            name, body = _enclosing(lines, number)
            where = f"{module}::{name}"
            if any(use in body for use in REDIS_BACKEND_ONLY):
                kept.append(where)
                continue
            what = gate["what"]
            wider = (
                "('redis', 'pgq')" if what.strip("'\"") == "redis" else "('redis', 'rpc', 'pgq')"
            )
            lines[number] = line[: gate.start()] + gate["head"] + wider + ")" + line[gate.end() :]
            opened.append(where)
        if not found:
            raise RuntimeError(f"no Redis-backend gate found in t/integration/{module}")
        path.write_text("".join(lines))
    notes = [
        "# pgq's patch of this copy (tests/conformance/celery_suite.py, open_redis_gates)",
        "",
        "Opened to the pgq result backend (Redis is only a side channel there):",
        "",
        *(f"- {where}" for where in opened),
        "",
        "Kept closed (they read the Redis result backend's own pub/sub channels or keys):",
        "",
        *(f"- {where}" for where in kept),
        "",
    ]
    (into / "t" / "PGQ-PATCH.md").write_text("\n".join(notes))
    return opened


def _enclosing(lines: Sequence[str], number: int) -> tuple[str, str]:
    """The name and source of the test around line ``number``: its function, or for a
    fixture (a function not named ``test…``) the class holding it, whose tests it gates."""
    name, start, end = _block(lines, number, DEF)
    if name.startswith("test") or start == 0:
        return name, "".join(lines[start:end])
    owner, start, end = _block(lines, start, CLASS)
    return (owner if start else name), "".join(lines[start:end])


def _block(lines: Sequence[str], number: int, opener: re.Pattern[str]) -> tuple[str, int, int]:
    """Name, first and end line of the innermost ``opener`` block around line ``number``
    (the whole module, as ``<module>``, when there is none)."""
    indent = len(lines[number]) - len(lines[number].lstrip())
    for start in range(number, -1, -1):
        match = opener.match(lines[start])
        if match and len(match["indent"]) < indent:
            break
    else:
        return "<module>", 0, len(lines)
    own = len(match["indent"])
    end = start + 1
    while end < len(lines):
        text = lines[end]
        if (
            text.strip()
            and len(text) - len(text.lstrip()) <= own
            and not text.lstrip().startswith(")")
        ):
            break
        end += 1
    return match["name"], start, end


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


RUNS = ("rabbitmq", "pgq", "pgq-backend")


def side_channel(backend: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``REDIS_HOST`` and ``REDIS_PORT`` for the suite's side channel (the Redis its
    tasks push to, ``redis_echo``, ``redis_count``...): the Redis of ``backend`` (the
    ``--backend`` URL), so that runs side by side, each given a Redis of its own, share
    no side-channel keys. Either variable already set in ``environ`` is kept; a backend
    that is not Redis leaves both to ``environ`` (else the suite's own default)."""
    parts = urlsplit(backend)
    if parts.scheme not in ("redis", "rediss"):
        return {name: environ[name] for name in ("REDIS_HOST", "REDIS_PORT") if name in environ}
    found = {"REDIS_HOST": parts.hostname or "localhost", "REDIS_PORT": str(parts.port or 6379)}
    return {name: environ.get(name, value) for name, value in found.items()}


def suite_environment(
    environ: Mapping[str, str],
    env: Mapping[str, str],
    broker_url: str,
    backend: str,
    executable: str,
) -> dict[str, str]:
    """The suite's environment: ``environ`` with ``env``, the broker and the backend, and
    the directory of ``executable`` (this Python's, a virtualenv's ``bin``) first on
    ``PATH``, where the ``celery`` command the suite starts (``test_run_worker``,
    ``test_config_serialization``) is installed beside it."""
    path = environ.get("PATH", os.defpath)
    return {
        **environ,
        **env,
        "PATH": os.pathsep.join([str(Path(executable).parent), path]),
        "TEST_BROKER": broker_url,
        "TEST_BACKEND": backend,
    }


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
    environment = suite_environment(os.environ, env, broker_url, backend, sys.executable)
    started = time.monotonic()
    subprocess.run(command, cwd=tree, env=environment, timeout=SUITE_TIMEOUT, check=False)
    return time.monotonic() - started


def one_run(run: str, args: argparse.Namespace, out: Path, extra: Sequence[str]) -> float:
    """``run`` (one of :data:`RUNS`), its report written to ``out/<run>.xml``; seconds."""
    tree = source_tree("celery")
    report = out / f"{run}.xml"
    redis = side_channel(args.backend, os.environ)
    if run == "rabbitmq":
        with rabbitmq_broker() as (url, env):
            return run_suite(tree, url, redis | env, args.backend, report, extra)
    with pgq_broker(args.pg_url) as (url, env):
        if run == "pgq":
            return run_suite(tree, url, redis | env, args.backend, report, extra)
        patched = out / "suite-pgq-backend"
        open_redis_gates(tree, patched)
        return run_suite(patched, url, redis | env, url, report, extra)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", "--brokers", default=",".join(RUNS), help="of " + ", ".join(RUNS))
    parser.add_argument("--out", default="celery-suite-results")
    parser.add_argument("--pg-url", default=os.environ.get("PGQ_TEST_URL", DEFAULT_PG_URL))
    parser.add_argument(
        "--backend",
        default=DEFAULT_REDIS,
        help="the Redis result backend (of the rabbitmq and pgq runs) and, unless "
        "REDIS_HOST/REDIS_PORT are set, the suite's side channel (every run)",
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k: a part of the suite only")
    parser.add_argument(
        "--compare", metavar="DIR", help="compare the <run>.xml reports in DIR; run nothing"
    )
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}: choose from {', '.join(RUNS)}")
    out = Path(args.compare or args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["-k", args.keyword] if args.keyword else []
    seconds: dict[str, float] = {}
    if not args.compare:
        for run in runs:
            seconds[run] = one_run(run, args, out, extra)
    results: dict[str, dict[str, str]] = {}
    for run in runs:
        report = out / f"{run}.xml"
        results[run] = outcomes(report.read_text()) if report.exists() else {}
    versions = {p: importlib.metadata.version(p) for p in ("celery", "kombu", "celery-pgq", "amqp")}
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
    for entry in comparison.unexplained:
        print(f"passed on RabbitMQ, not on {entry}")
    return 1 if comparison.unexplained else 0


if __name__ == "__main__":
    raise SystemExit(main())
