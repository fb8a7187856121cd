"""The Celery-suite runner's reading of pytest's JUnit XML and its comparison of brokers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance import celery_suite
from tests.conformance.celery_suite import compare, open_redis_gates, outcomes

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
 <testcase classname="t.integration.test_tasks.test_tasks" name="test_ok" time="1"/>
 <testcase classname="t.integration.test_tasks.test_tasks" name="test_bad" time="1">
  <failure message="assert 1 == 2">...</failure></testcase>
 <testcase classname="t.integration.test_inspect.test_Inspect" name="test_setup" time="0">
  <error message="fixture failed">...</error></testcase>
 <testcase classname="t.integration.test_backend" name="test_azure" time="0">
  <skipped type="pytest.skip" message="no azure">...</skipped></testcase>
 <testcase classname="t.integration.test_canvas" name="test_xf[redis]" time="0">
  <skipped type="pytest.xfail" message="flaky on redis">...</skipped></testcase>
</testsuite></testsuites>
"""


def test_outcomes_are_read_by_pytest_node_id() -> None:
    assert outcomes(REPORT) == {
        "t/integration/test_tasks.py::test_tasks::test_ok": "passed",
        "t/integration/test_tasks.py::test_tasks::test_bad": "failed",
        "t/integration/test_inspect.py::test_Inspect::test_setup": "error",
        "t/integration/test_backend.py::test_azure": "skipped",
        "t/integration/test_canvas.py::test_xf[redis]": "xfailed",
    }


def test_compare_counts_and_finds_what_passed_on_rabbitmq_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = {
        "pgq": {"a": "passed", "b": "failed", "c": "failed", "d": "error"},
        "rabbitmq": {"a": "passed", "b": "passed", "c": "failed", "d": "passed"},
    }
    found = compare(results)
    assert found.counts["pgq"] == {
        "passed": 1,
        "failed": 2,
        "error": 1,
        "skipped": 0,
        "xfailed": 0,
        "total": 4,
    }
    assert found.differing == {
        "b": {"pgq": "failed", "rabbitmq": "passed"},
        "d": {"pgq": "error", "rabbitmq": "passed"},
    }
    assert found.unexplained == ["pgq: b", "pgq: d"]

    monkeypatch.setitem(celery_suite.KNOWN_DIFFERENCES, "b", "a reason")
    assert compare(results).unexplained == ["pgq: d"]
    table = compare(results).markdown({"celery": "5.7.0"})
    assert "| failed | 2 | 1 |" in table
    assert "| `b` | failed | passed | pgq |" in table
    assert "| `d` | error | passed |  |" in table


def test_the_pgq_backend_run_is_compared_with_the_baseline_and_has_its_own_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = {
        "rabbitmq": {"a": "passed", "b": "passed", "c": "passed"},
        "pgq": {"a": "passed", "b": "passed", "c": "failed"},
        "pgq-backend": {"a": "failed", "b": "skipped", "c": "failed"},
    }
    assert compare(results).unexplained == [
        "pgq: c",
        "pgq-backend: a",
        "pgq-backend: b",
        "pgq-backend: c",
    ]
    # A broker difference applies to both pgq runs, a backend one to pgq-backend only.
    monkeypatch.setitem(celery_suite.KNOWN_DIFFERENCES, "c", "a broker reason")
    monkeypatch.setitem(celery_suite.KNOWN_BACKEND_DIFFERENCES, "a", "a backend reason")
    found = compare(results)
    assert found.unexplained == ["pgq-backend: b"]
    # A module or class listed lists every test in it.
    monkeypatch.setitem(celery_suite.KNOWN_BACKEND_DIFFERENCES, "t/m.py::test_c", "its reason")
    assert celery_suite.listed("t/m.py::test_c::test_x[1]", "pgq-backend")
    assert not celery_suite.listed("t/m.py::test_cx::test_x", "pgq-backend")
    assert not celery_suite.listed("t/m.py::test_c::test_x[1]", "pgq")
    assert "| `a` | passed | passed | failed | pgq-backend |" in found.markdown({})
    assert "| `c` | passed | failed | failed | pgq, pgq-backend |" in found.markdown({})


SUITE = {
    "test_canvas.py": """
class test_chord:
    def test_side_channel(self, manager):
        if not manager.app.conf.result_backend.startswith('redis'):
            raise pytest.skip('Requires redis result backend.')
        redis_echo.delay('x')

    def test_join(self, manager):
        if not manager.app.conf.result_backend.startswith(('redis', 'rpc')):
            raise pytest.skip('Requires redis or rpc result backend.')

    def test_subscriptions(self, manager):
        if not manager.app.conf.result_backend.startswith("redis"):
            raise pytest.skip("Requires redis result backend.")
        assert get_active_redis_channels() == []

    def test_unordered(self, manager):
        if manager.app.conf.result_backend.startswith('redis'):
            pass

    def test_join_key(self, manager):
        if not manager.app.conf.result_backend.startswith('redis'):
            raise pytest.skip('Requires redis result backend.')
        fail.app.backend.get_key_for_group(group_id, '.j')
""",
    "test_tasks.py": """
class test_redis_backend:
    @pytest.fixture()
    def manager(self, manager):
        if not manager.app.conf.result_backend.startswith('redis'):
            raise pytest.skip('Requires redis result backend.')
        return manager

    def test_channels(self, manager):
        get_active_redis_channels()
""",
    "test_group_chains.py": """
class test_group_chains:
    @pytest.fixture(autouse=True)
    def require_redis(self, app):
        if not app.conf.result_backend.startswith('redis'):
            pytest.skip('Requires Redis result backend.')

    def test_levels(self, app):
        pass
""",
}


def _suite(root: Path, modules: dict[str, str]) -> Path:
    (root / "t" / "integration").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    for name, text in modules.items():
        (root / "t" / "integration" / name).write_text(text)
    return root


def test_redis_gates_are_opened_to_pgq_where_redis_is_a_side_channel(tmp_path: Path) -> None:
    tree = _suite(tmp_path / "celery", SUITE)
    opened = open_redis_gates(tree, tmp_path / "patched")
    assert opened == [
        "test_canvas.py::test_side_channel",
        "test_canvas.py::test_join",
        "test_group_chains.py::test_group_chains",
    ]
    canvas = (tmp_path / "patched" / "t" / "integration" / "test_canvas.py").read_text()
    assert "startswith(('redis', 'pgq')):\n            raise pytest.skip('Requires redis" in canvas
    assert "startswith(('redis', 'rpc', 'pgq'))" in canvas
    # Tests of the Redis backend itself (its pub/sub channels) stay gated, and a branch
    # that is not a gate is left alone.
    assert 'startswith("redis"):\n            raise pytest.skip("Requires' in canvas
    assert "if manager.app.conf.result_backend.startswith('redis'):\n            pass" in canvas
    # A test reading the Redis backend's chord keys stays gated too.
    join_key = canvas.split("def test_join_key")[1]
    assert "startswith('redis'):" in join_key
    tasks = (tmp_path / "patched" / "t" / "integration" / "test_tasks.py").read_text()
    assert tasks == SUITE["test_tasks.py"]
    notes = (tmp_path / "patched" / "t" / "PGQ-PATCH.md").read_text()
    kept = notes.split("Kept closed")[1]
    assert "- test_tasks.py::test_redis_backend" in kept
    assert "- test_canvas.py::test_join_key" in kept
    # The suite itself is untouched.
    assert (tree / "t" / "integration" / "test_canvas.py").read_text() == SUITE["test_canvas.py"]


def test_a_suite_without_the_gates_is_refused(tmp_path: Path) -> None:
    tree = _suite(tmp_path / "celery", SUITE | {"test_tasks.py": "def test_x():\n    pass\n"})
    with pytest.raises(RuntimeError, match=r"test_tasks\.py"):
        open_redis_gates(tree, tmp_path / "patched")


def test_a_test_run_on_one_broker_only_is_a_difference() -> None:
    found = compare({"pgq": {"a": "passed"}, "rabbitmq": {"a": "passed", "b": "passed"}})
    assert found.differing == {"b": {"pgq": "not run", "rabbitmq": "passed"}}
    assert found.unexplained == ["pgq: b"]


def test_the_side_channel_is_the_backends_redis_unless_set() -> None:
    side_channel = celery_suite.side_channel
    assert side_channel("redis://127.0.0.1:6381/13", {}) == {
        "REDIS_HOST": "127.0.0.1",
        "REDIS_PORT": "6381",
    }
    assert side_channel("redis://redis.example/0", {}) == {
        "REDIS_HOST": "redis.example",
        "REDIS_PORT": "6379",
    }
    # What the caller set wins, variable by variable.
    assert side_channel("redis://127.0.0.1:6381/13", {"REDIS_PORT": "6400"}) == {
        "REDIS_HOST": "127.0.0.1",
        "REDIS_PORT": "6400",
    }
    # A backend that is not Redis: the caller's variables, else the suite's defaults.
    assert side_channel("rpc://", {"REDIS_HOST": "h"}) == {"REDIS_HOST": "h"}
    assert side_channel("rpc://", {}) == {}


def test_the_suite_finds_the_celery_command_beside_this_python() -> None:
    env = celery_suite.suite_environment(
        {"PATH": "/usr/bin", "HOME": "/h"},
        {"PGQ_SCHEMA": "s"},
        "pgq://b",
        "redis://r",
        "/venv/bin/python",
    )
    assert env == {
        "PATH": os.pathsep.join(["/venv/bin", "/usr/bin"]),
        "HOME": "/h",
        "PGQ_SCHEMA": "s",
        "TEST_BROKER": "pgq://b",
        "TEST_BACKEND": "redis://r",
    }
