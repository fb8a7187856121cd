from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.pg import (
    ConnectionMeter,
    created_session_database,
    drop_schema,
    drop_session_database,
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


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A libpq URL of a database this test session created (and drops at its end)."""
    global _meter
    url = session_database()
    if created_session_database():
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    global _running
    _running = item.nodeid
    yield


#: The order the tiers run in: the quick ones first, so that a broken build fails in
#: seconds rather than after the acceptance tests' worker processes.
TIERS = ("unit", "integration", "conformance", "acceptance")


def tier_of(item: pytest.Item) -> int:
    parts = item.nodeid.split("::", 1)[0].split("/")
    for n, tier in enumerate(TIERS):
        if len(parts) > 1 and parts[0] == "tests" and parts[1] == tier:
            return n
    return len(TIERS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Stable: each module's tests stay together and in order (module-scoped fixtures).
    items.sort(key=tier_of)


def pytest_sessionfinish(session: pytest.Session) -> None:
    drop_session_database()  # (made at import by a settings module, with no test using it)
    if _meter is not None and _meter.peak > MAX_CONNECTIONS:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
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
