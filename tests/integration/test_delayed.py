"""``pgq delayed``: the ETA tasks waiting in Postgres, which no worker holds.

With native delayed delivery a task with an ETA or a countdown is a row not visible
until it is due; Celery's ``inspect scheduled`` reads a worker's timer and does not see
it. ``pgq delayed`` lists exactly those rows: waiting for their ETA, never delivered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from tests.integration.conftest import Peek
from tests.integration.test_cli import invoke


@pytest.fixture
def app(broker_url: str, schema: str) -> Iterator[Celery]:
    app = Celery("sched", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    yield app
    app.close()


def test_lists_the_tasks_waiting_for_their_eta_and_only_those(
    app: Celery, pg_url: str, schema: str, broker_url: str
) -> None:
    eta = datetime.now(timezone.utc) + timedelta(hours=1)
    later = app.send_task("t.report", args=(1, "x"), kwargs={"z": 3}, eta=eta, priority=6)
    sooner = app.send_task("t.mail", countdown=600, queue="mail")
    app.send_task("t.now")  # due now: a worker's to take, not delayed
    held = app.send_task("t.held", countdown=900)
    rows = Peek(pg_url, schema)
    try:
        # Claimed (a worker holding it until its ETA, as without native delayed delivery).
        rows(
            "UPDATE {schema}.message SET read_ct = 1 WHERE payload -> 'headers' ->> 'id' = %s",
            held.id,
        )
    finally:
        rows.conn.close()

    listed = invoke("delayed", "--json", "--url", broker_url, "--schema", schema)
    assert listed.exit_code == 0, listed.output
    found = json.loads(listed.output)
    assert [(s["task"], s["task_id"], s["queue"]) for s in found] == [
        ("t.mail", sooner.id, "mail"),
        ("t.report", later.id, "celery"),
    ]
    report = found[1]
    assert report["eta"] == eta.isoformat()
    assert abs(datetime.fromisoformat(report["due"]) - eta) < timedelta(seconds=1)
    assert report["priority"] == 6
    assert report["argsrepr"] == "(1, 'x')" and report["kwargsrepr"] == "{'z': 3}"

    only = invoke("delayed", "--json", "--queue", "celery", "--url", broker_url, "--schema", schema)
    assert [s["task_id"] for s in json.loads(only.output)] == [later.id]
    first = invoke("delayed", "--limit", "1", "--url", broker_url, "--schema", schema)
    assert first.exit_code == 0, first.output
    lines = first.output.splitlines()
    assert lines[0].split() == ["DUE", "QUEUE", "TASK", "ID", "PRIORITY"]
    assert lines[1].split()[1:] == ["mail", "t.mail", sooner.id, "0"]
    assert lines[2] == "(the first 1: --limit lists more)"


def test_header_text_cannot_reach_the_terminal_raw(
    app: Celery, pg_url: str, schema: str, broker_url: str
) -> None:
    app.send_task("t.\x1b[2Jevil", countdown=600)
    listed = invoke("delayed", "--url", broker_url, "--schema", schema)
    assert listed.exit_code == 0, listed.output
    assert "\x1b" not in listed.output and "t.\\x1b[2Jevil" in listed.output


def test_nothing_delayed_says_so(app: Celery, schema: str, broker_url: str) -> None:
    app.send_task("t.now")
    listed = invoke("delayed", "--url", broker_url, "--schema", schema)
    assert listed.exit_code == 0, listed.output
    assert listed.output == "no delayed messages\n"
