from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from tests import budget
from tests.pg import (
    ConnectionMeter,
    RunMeter,
    created_session_database,
    drop_schema,
    drop_session_database,
    find_postgres,
    new_schema_name,
    session_database,
    to_broker_url,
)
from tests.proxy import CuttingProxy

# The most sessions the suite may hold on its database at once (PGQ_TEST_MAX_CONNECTIONS):
# a server with max_connections=100 is shared with whatever else runs there.
MAX_CONNECTIONS = int(os.environ.get("PGQ_TEST_MAX_CONNECTIONS", "30"))
_meter: ConnectionMeter | None = None
_running = ""

# -- running side by side (pytest-xdist) --
#: How many pytest processes the default run uses (``-n N`` or PGQ_TEST_WORKERS to choose,
#: ``-n 0`` or ``-p no:xdist`` to run in this process). The suite waits on worker
#: processes and events far more than it computes: three keep two cores busy.
DEFAULT_WORKERS = 3
#: Sessions a test holds at most, by tier, unless it says otherwise with
#: ``@pytest.mark.sessions(n)`` (on the test or its module): what a test takes of the
#: run's budget before it starts (tests/budget.py). Every test takes at least one token, so
#: one that takes them all runs alone.
TIER_SESSIONS = {"unit": 1, "integration": 6, "conformance": 6, "acceptance": 10}
OTHER_SESSIONS = 6
_budget: budget.Budget | None = None
_run_dir: Path | None = None
_run_meter: RunMeter | None = None
_workers_started = 0


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A libpq URL of a database this test session created (and drops at its end)."""
    global _meter
    url = session_database()
    if _run_dir is not None:  # a worker of a parallel run: the controller meters the run
        _announce_database()
    elif created_session_database():
        _meter = ConnectionMeter(url, lambda: _running)
        _meter.start()
    try:
        yield url
    finally:
        if _meter is not None:
            _meter.stop()
        drop_session_database()


@pytest.fixture
def schema(pg_url: str) -> Iterator[str]:
    """A new schema name (nothing created). Dropped after the test, unless the session
    made its own database: dropping that at the session's end takes every test's schema
    along at once, cheaper than a connection and a DROP SCHEMA per test (~20 ms each)."""
    name = new_schema_name()
    yield name
    if not created_session_database():
        drop_schema(pg_url, name)


@pytest.fixture(autouse=True)
def _results_listeners() -> Iterator[None]:
    """Each test's result waiters' sessions end with it (one per schema otherwise)."""
    yield
    from pg_transport.results.listener import stop_listeners

    stop_listeners()


@pytest.fixture(autouse=True)
def _idle_shared_sessions() -> Iterator[None]:
    """The idle sessions a test left in this process's shared pools close with it: left
    for their idle timeout (30 s), they count against the next tests' session budget."""
    yield
    from pg_transport.db import pool

    with pool._shared_lock:
        connectors = list(pool._shared.values())
    for connector in connectors:
        connector.discard_idle()


@pytest.fixture
def proxy(pg_url: str) -> Iterator[CuttingProxy]:
    """A TCP proxy in front of the test server (tests/proxy.py)."""
    parts = urlsplit(pg_url)
    with CuttingProxy((parts.hostname or "127.0.0.1", parts.port or 5432)) as p:
        yield p


@pytest.fixture
def proxied_url(pg_url: str, proxy: CuttingProxy) -> str:
    """A pgq URL of the test database through :func:`proxy` (it reads the bytes: no TLS)."""
    parts = urlsplit(pg_url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return f"pgq://{auth}127.0.0.1:{proxy.port}{parts.path}?sslmode=disable"


@pytest.fixture
def broker_url(pg_url: str) -> str:
    return to_broker_url(pg_url)


def _worker_id() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "gw")


def _announce_database() -> None:
    """(a worker) Name this process's session database to the controller's meter."""
    if _run_dir is None or not created_session_database():
        return
    path = _run_dir / f"db-{_worker_id()}"
    if not path.exists():
        path.write_text(unquote(urlsplit(session_database()).path[1:]))


def sessions_of(item: pytest.Item) -> int:
    """The most sessions ``item`` holds at once: its ``sessions`` marker, else its tier's."""
    marker = item.get_closest_marker("sessions")
    if marker is not None:
        return int(marker.args[0])
    tier = TIERS[tier_of(item)] if tier_of(item) < len(TIERS) else ""
    return TIER_SESSIONS.get(tier, OTHER_SESSIONS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _running
    _running = item.nodeid
    if _budget is not None and _run_dir is not None:
        need = sessions_of(item)
        _budget.hold(need)
        _announce_database()  # (a settings module may have made it at import)
        (_run_dir / f"running-{_worker_id()}").write_text(f"{need}\t{item.nodeid}")
    yield
    if _budget is not None and nextitem is None:
        _budget.release()


def _parallel(config: pytest.Config) -> bool:
    """Whether this is the controlling process of a parallel run."""
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The default run runs DEFAULT_WORKERS processes side by side, each test file in one
    of them (module-scoped fixtures, such as a module's worker fleet, stay together)."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    option = config.option
    if option.numprocesses is None and not option.collectonly and not option.usepdb:
        option.numprocesses = int(os.environ.get("PGQ_TEST_WORKERS") or DEFAULT_WORKERS)
    if option.numprocesses and option.dist == "no" and not option.distload:
        option.dist = "loadfile"
        option.loadscopereorder = False  # the order of pytest_collection_modifyitems


def pytest_configure(config: pytest.Config) -> None:
    global _budget, _run_dir
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and "pgq_run_dir" in workerinput:
        _run_dir = Path(workerinput["pgq_run_dir"])
        _budget = budget.Budget(_run_dir / "budget")
    elif _parallel(config):
        _run_dir = Path(tempfile.mkdtemp(prefix="pgq-test-run-"))
        budget.make(_run_dir / "budget", MAX_CONNECTIONS)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(controller) Each worker learns the run's directory: budget, databases, tests."""
    node.workerinput["pgq_run_dir"] = str(_run_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    global _workers_started
    _workers_started += int(getattr(node, "workeroutput", {}).get("pgq_workers_started", 0))


def pytest_sessionstart(session: pytest.Session) -> None:
    global _run_meter
    if _run_dir is not None and _budget is None:  # the controller
        _run_meter = RunMeter(find_postgres(), _run_dir)
        _run_meter.start()


#: The order the tiers run in: the quick ones first, so that a broken build fails in
#: seconds rather than after the acceptance tests' worker processes.
TIERS = ("unit", "integration", "conformance", "acceptance")


def tier_of(item: pytest.Item) -> int:
    parts = item.nodeid.split("::", 1)[0].split("/")
    for n, tier in enumerate(TIERS):
        if len(parts) > 1 and parts[0] == "tests" and parts[1] == tier:
            return n
    return len(TIERS)


#: Seconds each test file took in a whole default run (serial, on a quiet 2-core machine;
#: files not listed count as 0). When tests run side by side the longest files start
#: first, so that the run does not end with one process still in a long file.
FILE_SECONDS: dict[str, float] = {}


def file_seconds(item: pytest.Item) -> float:
    return FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each module's tests stay together and in order (module-scoped fixtures).
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: (-file_seconds(item), -tier_of(item)))
    else:
        items.sort(key=tier_of)


def pytest_sessionfinish(session: pytest.Session) -> None:
    drop_session_database()  # (made at import by a settings module, with no test using it)
    if _meter is not None and _meter.peak > MAX_CONNECTIONS:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    workeroutput: dict[str, Any] | None = getattr(session.config, "workeroutput", None)
    harness = sys.modules.get("tests.acceptance.harness")
    if workeroutput is not None and harness is not None:
        workeroutput["pgq_workers_started"] = len(harness.STARTED)
    if _run_meter is not None:
        _run_meter.stop()
        if _run_meter.peak > MAX_CONNECTIONS:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _run_dir is not None and _budget is None:
        peaks = os.environ.get("PGQ_TEST_SESSION_PEAKS")
        if peaks and _run_meter is not None:
            Path(peaks).write_text(
                "".join(
                    f"{held}\t{declared}\t{test}\n"
                    for test, (held, declared) in sorted(_run_meter.by_test.items())
                )
            )
        shutil.rmtree(_run_dir, ignore_errors=True)


def _run_summary(terminalreporter: pytest.TerminalReporter, meter: RunMeter) -> None:
    if _workers_started:
        terminalreporter.write_line(
            f"pgq: {_workers_started} celery worker processes started (tests/acceptance/harness.py)"
        )
    over = meter.peak > MAX_CONNECTIONS
    terminalreporter.write_line(
        f"pgq: at most {meter.peak} sessions on the test databases at once, "
        f"{'over' if over else 'within'} the budget of {MAX_CONNECTIONS} "
        f"(PGQ_TEST_MAX_CONNECTIONS); peak during {meter.peak_during or '-'}",
        red=over,
    )
    if over:
        by = ", ".join(f"{name or '(unnamed)'}: {n}" for name, n in meter.peak_by.items())
        terminalreporter.write_line(f"pgq: sessions at the peak by application_name: {by}")
    beyond = sorted(
        ((held, declared, test) for test, (held, declared) in meter.by_test.items()),
        reverse=True,
    )
    beyond = [(h, d, t) for h, d, t in beyond if h > d]
    for held, declared, test in beyond:
        terminalreporter.write_line(
            f"pgq: {test} held {held} sessions, more than the {declared} it declares "
            "(mark it @pytest.mark.sessions(n))",
            yellow=True,
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _run_meter is not None:
        _run_summary(terminalreporter, _run_meter)
        return
    harness = sys.modules.get("tests.acceptance.harness")
    if harness is not None and harness.STARTED:
        terminalreporter.write_line(
            f"pgq: {len(harness.STARTED)} celery worker processes started "
            "(tests/acceptance/harness.py)"
        )
    if _meter is None:
        return
    verdict = "over" if _meter.peak > MAX_CONNECTIONS else "within"
    terminalreporter.write_line(
        f"pgq: at most {_meter.peak} sessions on the test database at once, {verdict} "
        f"the budget of {MAX_CONNECTIONS} (PGQ_TEST_MAX_CONNECTIONS); peak during "
        f"{_meter.peak_during or '-'}",
        red=_meter.peak > MAX_CONNECTIONS,
    )
    if _meter.peak > MAX_CONNECTIONS:
        by = ", ".join(f"{name or '(unnamed)'}: {n}" for name, n in _meter.peak_by.items())
        terminalreporter.write_line(f"pgq: sessions at the peak by application_name: {by}")
