"""``pgq schedule list|add|enable|disable|remove`` on a real database, and a beat that
sends what the command added and stops sending what it disabled or removed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from celery import Celery

from pg_transport.beat import Scheduler
from tests.integration.conftest import Peek
from tests.integration.test_cli import invoke
from tests.pg import to_broker_url


@pytest.fixture
def url(pg_url: str, schema: str) -> str:
    url = to_broker_url(pg_url)
    assert invoke("migrate", "--url", url, "--schema", schema).exit_code == 0
    return url


@pytest.fixture
def peek(pg_url: str, schema: str) -> Iterator[Peek]:
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


def pgq(url: str, schema: str, *args: str) -> tuple[int, str]:
    result = invoke("schedule", *args, PGQ_URL=url, PGQ_SCHEMA=schema)
    return result.exit_code, result.output


def test_add_list_disable_enable_remove(url: str, schema: str, peek: Peek) -> None:
    assert pgq(url, schema, "list") == (
        0,
        "no schedule entries\nleader: none yet (no beat has run)\n",
    )
    code, out = pgq(
        url, schema, "add", "report", "--task", "app.report", "--crontab", "30 2 * * 1-5",
        "--kwargs", '{"full": true}', "--queue", "reports",
    )  # fmt: skip
    assert (code, out) == (0, "added 'report': app.report crontab 30 2 * * 1-5\n")
    code, out = pgq(url, schema, "add", "ping", "--task", "app.ping", "--every", "2.5", "--aligned")
    assert code == 0, out
    code, out = pgq(url, schema, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "TASK",
        "SCHEDULE",
        "ENABLED",
        "FROM",
        "LAST",
        "SLOT",
        "SENT",
    ]
    assert " ".join(lines[1].split()) == "ping app.ping every 2.5s (aligned) yes pgq schedule - 0"
    assert " ".join(lines[2].split()) == (
        "report app.report crontab 30 2 * * 1-5 yes pgq schedule - 0"
    )
    assert pgq(url, schema, "disable", "ping") == (0, "'ping' disabled\n")
    code, out = pgq(url, schema, "list", "--json")
    listed = {e["name"]: e for e in json.loads(out)["entries"]}
    assert listed["ping"]["enabled"] is False
    assert listed["report"]["kwargs"] == {"full": True}
    assert listed["report"]["options"] == {"queue": "reports"}
    assert listed["ping"]["schedule"] == {"every": 2.5, "aligned": True}
    assert pgq(url, schema, "enable", "ping") == (0, "'ping' enabled\n")
    assert pgq(url, schema, "remove", "ping", "report") == (
        0,
        "removed 2 entries: 'ping', 'report'\n",
    )
    assert peek("SELECT count(*) FROM {schema}.beat_entry") == [(0,)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "t"], "give one of --every SECONDS or --crontab SPEC"),
        (["--task", "t", "--every", "1", "--crontab", "* * * * *"], "give one of --every"),
        (["--task", "t", "--every", "0"], "0.0 is not in the range x>0"),
        (["--task", "t", "--every", "soon"], "'soon' is not a valid float"),
        (["--task", "t", "--crontab", "61 * * * *"], "'61 * * * *' is not a valid crontab"),
        (["--task", "t", "--crontab", "* * *"], "has 3 fields, a crontab has 5"),
        (["--task", "t", "--every", "1", "--args", "{}"], "args {} must be a list"),
        (["--task", "t", "--every", "1", "--kwargs", "[1"], "'[1' is not JSON"),
        (["--task", "t", "--every", "1", "--options", '{"task_id": "x"}'], "'task_id' is set"),
        (["--task", "t", "--every", "1", "--options", '{"prio": 1}'], "unknown option 'prio'"),
        (["--task", "t", "--crontab", "* * * * *", "--aligned"], "--aligned goes with --every"),
        (["--task", "t", "--evry", "1"], "No such option '--evry'"),
    ],
)
def test_bad_input_is_one_clear_error_and_stores_nothing(
    url: str, schema: str, peek: Peek, args: list[str], message: str
) -> None:
    code, out = pgq(url, schema, "add", "bad", *args)
    assert code in (1, 2), out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], out
    assert peek("SELECT count(*) FROM {schema}.beat_entry") == [(0,)]


def test_unknown_and_duplicate_names_are_errors(url: str, schema: str) -> None:
    assert pgq(url, schema, "add", "a", "--task", "t", "--every", "5")[0] == 0
    code, out = pgq(url, schema, "add", "a", "--task", "other", "--every", "1")
    assert code == 1 and "schedule entry 'a' exists already" in out
    for command in ("disable", "enable", "remove"):
        code, out = pgq(url, schema, command, "nope")
        assert code == 1 and "no schedule entry 'nope'" in out, (command, out)


def test_a_beat_sends_what_was_added_and_stops_on_disable_and_remove(
    url: str, schema: str, peek: Peek
) -> None:
    app = Celery("beat_cli", broker=url)
    app.conf.update(
        broker_transport_options={"schema": schema}, beat_schedule={}, result_expires=None
    )
    beat = Scheduler(app)
    try:
        added = pgq(
            url, schema, "add", "tick", "--task", "app.tick", "--every", "1", "--queue", "q"
        )
        assert added[0] == 0, added
        peek("UPDATE {schema}.beat_entry SET anchor = now() - interval '2.5 seconds'")
        beat.send_due()
        rows = peek("SELECT queue, payload->'headers'->>'task' FROM {schema}.message")
        assert rows == [("q", "app.tick"), ("q", "app.tick")]
        code, out = pgq(url, schema, "list")
        assert "2" in out.splitlines()[1].split()[-1:]
        assert pgq(url, schema, "disable", "tick")[0] == 0
        peek("UPDATE {schema}.beat_entry SET anchor = now() - interval '10 seconds'")
        beat.send_due()
        assert peek("SELECT count(*) FROM {schema}.message") == [(2,)]
        assert pgq(url, schema, "remove", "tick")[0] == 0
        beat.send_due()
        assert peek("SELECT count(*) FROM {schema}.message") == [(2,)]
        # A beat_schedule entry removed here comes back when a beat starts.
        app.conf.beat_schedule = {"conf": {"task": "app.c", "schedule": 60}}
        Scheduler(app).close()
        code, out = pgq(url, schema, "remove", "conf")
        assert code == 0 and "come back when a beat starts" in out
    finally:
        beat.close()
