"""The Celery-suite runner's reading of pytest's JUnit XML and its comparison of brokers."""

from __future__ import annotations

import pytest

from tests.conformance import celery_suite
from tests.conformance.celery_suite import compare, outcomes

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
    assert found.unexplained == ["b", "d"]

    monkeypatch.setitem(celery_suite.KNOWN_DIFFERENCES, "b", "a reason")
    assert compare(results).unexplained == ["d"]
    table = compare(results).markdown({"celery": "5.7.0"})
    assert "| failed | 2 | 1 |" in table
    assert "| `b` | failed | passed | yes |" in table
    assert "| `d` | error | passed |  |" in table


def test_a_test_run_on_one_broker_only_is_a_difference() -> None:
    found = compare({"pgq": {"a": "passed"}, "rabbitmq": {"a": "passed", "b": "passed"}})
    assert found.differing == {"b": {"pgq": "not run", "rabbitmq": "passed"}}
    assert found.unexplained == ["b"]
