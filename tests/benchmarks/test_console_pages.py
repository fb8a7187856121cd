"""The console page-time benchmark, small: 50,000 messages, every page timed over HTTP.

Deselected by default (a benchmark); ``python -m benchmarks.console_pages`` runs it at
1,000,000 messages.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.console_pages import main

pytestmark = pytest.mark.benchmark


def test_every_page_answers_within_the_budget(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--url", pg_url, "--rows", "50000", "--runs", "5", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report["pages"]) >= {"queues", "queue", "dead", "barriers", "schedules"}
    assert code == 0 and report["passed"] is True, report
