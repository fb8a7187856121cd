"""What the console's processes page reads from a session's application_name."""

from __future__ import annotations

import os

import pytest

from pg_transport.db import pool
from pg_transport.web.reads import process_kind


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pgq:41:worker:w1@host", ("worker", "41", "w1@host")),
        ("pgq-results:41:worker:w1@host", ("worker's result listener", "41", "w1@host")),
        ("pgq:42", ("publisher", "42", None)),
        ("pgq-beat:43", ("beat", "43", None)),
        ("pgq-web:44", ("console", "44", None)),
        ("pgq-metrics:45", ("metrics exporter", "45", None)),
        ("pgq-custom", ("pgq-custom", None, None)),  # set in a URL: taken as it is
        ("pgq:x:worker:", ("worker", None, None)),
    ],
)
def test_kind_pid_and_node(name: str, expected: tuple[str, str | None, str | None]) -> None:
    assert process_kind(name) == expected


def test_a_worker_names_its_sessions_after_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool, "_process_role", None)
    assert pool.process_name("pgq") == f"pgq:{os.getpid()}"
    pool.set_process_role("worker", "w1@host")
    assert pool.process_name("pgq-results") == f"pgq-results:{os.getpid()}:worker:w1@host"
    assert process_kind(pool.process_name("pgq")) == ("worker", str(os.getpid()), "w1@host")


def test_consumers_are_read_from_the_workers_answers_skipping_malformed_ones() -> None:
    from pg_transport.web.consumers import invert

    replies = {
        "w1@h": [{"name": "celery"}, {"name": "jobs"}],
        "w2@h": [{"name": "jobs"}, {"nom": "x"}, "jobs", {"name": 7}],
        "w3@h": "not a list",
    }
    assert invert(replies) == {"celery": ["w1@h"], "jobs": ["w1@h", "w2@h"]}
    assert invert(None) == {}


def test_a_connected_node_that_did_not_answer_is_named() -> None:
    from datetime import UTC, datetime, timedelta

    from pg_transport.web.consumers import Seen, connected, silent
    from pg_transport.web.reads import ProcessRow

    asked = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def row(name: str, since: datetime) -> ProcessRow:
        return ProcessRow(name, *process_kind(name), None, None, None, 1, 0, since)

    before, after = asked - timedelta(seconds=5), asked + timedelta(seconds=5)
    rows = [
        row("pgq:1:worker:w1@h", before),  # answered
        row("pgq:2:worker:quiet@h", before),  # connected, did not answer
        row("pgq-results:2:worker:quiet@h", after),
        row("pgq:3:worker:new@h", after),  # started after the question: not asked yet
        row("pgq:4", before),  # a publisher: no node
    ]
    seen = Seen({"celery": ["w1@h"]}, 1, 1.0, answered=frozenset({"w1@h"}), asked=asked)
    assert silent(seen, rows) == ["quiet@h"]
    assert connected(rows) == ["new@h", "quiet@h", "w1@h"]
    # Nobody could be asked: nobody is called silent (the page lists who is connected).
    assert silent(Seen(at=1.0, error="NotPermitted: no", asked=asked), rows) == []
