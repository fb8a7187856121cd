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
    RUN_DIR_ENV,
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
#: ``-n 0`` or ``-p no:xdist`` to run in this process). Three: the suite waits far more
#: than it computes (worker start-ups, leases, countdowns), and the session budget
#: (tests/budget.py) keeps the three within PGQ_TEST_MAX_CONNECTIONS together.
DEFAULT_WORKERS = 3
#: Sessions a test holds at most, by tier, unless it says otherwise with
#: ``@pytest.mark.sessions(n)`` (on the test or its module): what a test takes of the
#: run's budget before it starts (tests/budget.py). Every test takes at least one token, so
#: one that takes them all runs alone. Measured, not guessed: a parallel run reports each
#: test that held more than it declares (counting what earlier tests of its process still
#: hold: a unit test sees a few idle sessions its process's pools keep).
TIER_SESSIONS = {"unit": 7, "integration": 8, "conformance": 8, "acceptance": 12}
OTHER_SESSIONS = 6
#: Files whose tests (those without a marker) hold more than their tier's default: the
#: most a test of the file held in two whole runs side by side (the run's meter,
#: PGQ_TEST_SESSION_PEAKS, which counts sessions the process's earlier tests left idle
#: too), and 3 (2 was one short in a later run). With these the tier defaults could come
#: down from 10 (integration) and 14 (acceptance), so that an acceptance test and an
#: integration test fit in the budget together.
FILE_SESSIONS: dict[str, int] = {
    "tests/acceptance/test_faults.py": 16,
    "tests/acceptance/test_transactional.py": 16,
    "tests/acceptance/test_limits.py": 15,
    "tests/acceptance/test_no_grants.py": 15,
    "tests/acceptance/test_publisher_boundary.py": 15,
    "tests/integration/test_queue_limits.py": 14,
    "tests/integration/test_ttl.py": 14,
    "tests/integration/test_unique.py": 14,
    "tests/integration/test_wake.py": 14,
    "tests/integration/test_status_ordering.py": 13,
    "tests/integration/test_barrier_races.py": 12,
    "tests/integration/test_fair_share.py": 12,
    "tests/integration/test_flow_reads.py": 12,
    "tests/integration/test_lean_claim.py": 12,
    "tests/integration/test_ordering.py": 12,
    "tests/integration/test_publish_retry.py": 12,
    "tests/integration/test_publish_visibility.py": 12,
    "tests/integration/test_shutdown_drain.py": 12,
    "tests/integration/test_cli_status.py": 11,
    "tests/integration/test_flow_switch.py": 11,
    "tests/integration/test_rolled_back.py": 11,
    "tests/integration/test_store.py": 11,
    "tests/integration/test_trust.py": 11,
    "tests/integration/test_web_auth.py": 11,
    "tests/integration/test_web_samples.py": 11,
    "tests/benchmarks/test_batch.py": 10,
    "tests/integration/test_atomic_round_trips.py": 10,
    "tests/integration/test_beat.py": 10,
    "tests/integration/test_failover_urls.py": 10,
    "tests/integration/test_fencing.py": 10,
    "tests/integration/test_joined_django.py": 10,
    "tests/integration/test_listen_url.py": 10,
    "tests/integration/test_privileges.py": 10,
    "tests/integration/test_queue_names.py": 10,
    "tests/integration/test_vacuum.py": 10,
    "tests/benchmarks/test_pgbench.py": 9,
}
#: Sessions kept out of the tokens for each process beyond the first: between its tests a
#: process keeps a few sessions no test declares (a run that gave out all 30 tokens had 32
#: at once: 7 of them one process's idle barrier pool; with 3 kept back for each, runs
#: peaked at 25-28; with 4 one clean-clone run had more than 30 at once, all its tests
#: green: 5 leaves room).
IDLE_RESERVE = 5
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
    """The idle sessions a test left in this process's pools close with it: left for
    their idle timeout (30 s), they count against the next tests' session budget. Every
    pool that ever kept an idle session is one the process's reaper watches: the shared
    publishing pools, and the barrier's, the result backend's and the others each
    owner builds for itself."""
    yield
    from pg_transport.db import pool

    with pool._shared_lock:
        connectors = set(pool._shared.values())
    with pool._reaper._lock:
        connectors.update(pool._reaper._pools)
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


def declared_sessions(item: pytest.Item) -> int:
    """What ``item`` says it holds at most: its ``sessions`` marker, else its file's
    measured figure (FILE_SESSIONS), else its tier's."""
    marker = item.get_closest_marker("sessions")
    if marker is not None:
        return int(marker.args[0])
    measured = FILE_SESSIONS.get(item.nodeid.split("::", 1)[0])
    if measured is not None:
        return measured
    tier = TIERS[tier_of(item)] if tier_of(item) < len(TIERS) else ""
    return TIER_SESSIONS.get(tier, OTHER_SESSIONS)


#: A module's fleet (a ``*_fleet`` fixture: tests/acceptance/harness.py) lives across the
#: tests it serves: each of them holds the most any of them declares.
_fleet_sessions: dict[str, int] = {}


def _uses_fleet(item: pytest.Item) -> bool:
    return any(name.endswith("_fleet") for name in getattr(item, "fixturenames", ()))


def sessions_of(item: pytest.Item) -> int:
    """The most sessions ``item`` holds at once (its share of the run's budget)."""
    if _uses_fleet(item):
        return _fleet_sessions.get(item.nodeid.split("::", 1)[0], declared_sessions(item))
    return declared_sessions(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _running
    _running = item.nodeid
    if _budget is not None and _run_dir is not None:
        need = sessions_of(item)
        (_run_dir / f"running-{_worker_id()}").write_text("")  # waiting: nothing running
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
        os.environ[RUN_DIR_ENV] = str(_run_dir)  # tests.pg.metered_database
        _budget = budget.Budget(_run_dir / "budget")
    elif _parallel(config):
        _run_dir = Path(tempfile.mkdtemp(prefix="pgq-test-run-"))
        processes = config.option.numprocesses
        extra = (processes if isinstance(processes, int) else os.cpu_count() or 1) - 1
        budget.make(_run_dir / "budget", max(1, MAX_CONNECTIONS - IDLE_RESERVE * extra))


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


#: Seconds each test file took (setup, call and teardown of its tests) in a whole default
#: run side by side at load 8-22, files of 10 s or more (others count as 0): only their
#: order matters. The longest files start first, so that the run does not end with one
#: process still in a long file while the others are done.
FILE_SECONDS: dict[str, float] = {
    "tests/acceptance/test_install.py": 209,
    "tests/acceptance/test_ordering.py": 205,
    "tests/acceptance/test_compose.py": 174,
    "tests/acceptance/test_password_masking.py": 168,
    "tests/acceptance/test_beat.py": 155,
    "tests/acceptance/test_chords.py": 124,
    "tests/acceptance/test_web.py": 118,
    "tests/acceptance/test_delivery.py": 100,
    "tests/acceptance/test_pools.py": 99,
    "tests/acceptance/test_failover.py": 97,
    "tests/acceptance/test_barrier.py": 95,
    "tests/integration/test_plans.py": 91,
    "tests/acceptance/test_features.py": 81,
    "tests/integration/test_kombu_suite.py": 77,
    "tests/unit/test_url.py": 76,
    "tests/acceptance/test_restart.py": 72,
    "tests/integration/test_ordering_plans.py": 70,
    "tests/unit/test_web_processes.py": 68,
    "tests/integration/test_privileges.py": 67,
    "tests/acceptance/test_demo.py": 60,
    "tests/integration/test_cli_dead.py": 57,
    "tests/acceptance/test_headers.py": 55,
    "tests/acceptance/test_control.py": 50,
    "tests/integration/test_barrier_races.py": 47,
    "tests/acceptance/test_due.py": 42,
    "tests/acceptance/test_results.py": 42,
    "tests/acceptance/test_result_dead_letters.py": 41,
    "tests/acceptance/test_transactional.py": 41,
    "tests/unit/test_sql_placement.py": 38,
    "tests/integration/test_queue_names.py": 38,
    "tests/integration/test_trust.py": 38,
    "tests/unit/test_layers.py": 38,
    "tests/acceptance/test_footprint.py": 37,
    "tests/benchmarks/test_stream.py": 36,
    "tests/acceptance/test_poison.py": 35,
    "tests/benchmarks/test_compare.py": 35,
    "tests/unit/test_web_chart.py": 33,
    "tests/integration/test_claim_plans.py": 32,
    "tests/integration/test_joined.py": 32,
    "tests/integration/test_results.py": 29,
    "tests/acceptance/test_delayed.py": 29,
    "tests/integration/test_metrics.py": 28,
    "tests/integration/test_cli.py": 28,
    "tests/integration/test_barrier.py": 27,
    "tests/acceptance/test_poolers.py": 26,
    "tests/acceptance/test_dead_peer.py": 25,
    "tests/integration/test_event_loop.py": 24,
    "tests/integration/test_suites.py": 24,
    "tests/integration/test_schema.py": 23,
    "tests/integration/test_bad_input.py": 23,
    "tests/acceptance/test_testing_plugin.py": 22,
    "tests/integration/test_suite_portability.py": 21,
    "tests/acceptance/test_partition.py": 21,
    "tests/integration/test_guards.py": 20,
    "tests/integration/test_ordering.py": 20,
    "tests/integration/test_result_roles.py": 20,
    "tests/integration/test_topic.py": 20,
    "tests/integration/test_transport.py": 19,
    "tests/integration/test_chords.py": 19,
    "tests/integration/test_batch.py": 18,
    "tests/integration/test_housekeeping.py": 18,
    "tests/integration/test_cli_status.py": 18,
    "tests/benchmarks/test_batch_peers.py": 17,
    "tests/acceptance/test_preflight.py": 17,
    "tests/integration/test_publisher_boundary.py": 17,
    "tests/integration/test_many_fds.py": 17,
    "tests/integration/test_poolers.py": 16,
    "tests/integration/test_docs.py": 15,
    "tests/benchmarks/test_layers.py": 14,
    "tests/acceptance/test_registration.py": 14,
    "tests/integration/test_ordering_commit.py": 13,
    "tests/integration/test_cli_schedule.py": 12,
    "tests/benchmarks/test_wake.py": 12,
    "tests/benchmarks/test_producers.py": 12,
    "tests/integration/test_fencing.py": 12,
    "tests/acceptance/test_no_grants.py": 11,
    "tests/integration/test_session_databases.py": 11,
    "tests/acceptance/test_faults.py": 11,
    "tests/unit/test_budget.py": 11,
}


def file_seconds(item: pytest.Item) -> float:
    return FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each module's tests stay together and in order (module-scoped fixtures).
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: (-file_seconds(item), -tier_of(item)))
        for item in filter(_uses_fleet, items):
            module = item.nodeid.split("::", 1)[0]
            _fleet_sessions[module] = max(_fleet_sessions.get(module, 0), declared_sessions(item))
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
