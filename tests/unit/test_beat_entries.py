"""Schedule entries without a database: checking beat_schedule, and the slots of each
kind of schedule (pg_transport.beat.entries)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import schedule

from pg_transport.beat.entries import Cron, Every, due_slots, entry_from_config
from pg_transport.errors import ConfigurationError


def test_catch_up_sends_recent_missed_slots_and_only_the_latest_older_one() -> None:
    anchor = datetime(2026, 1, 1, tzinfo=UTC)
    every = Every(10.0)
    now = anchor + timedelta(seconds=95)
    assert due_slots(every, anchor, None, now, UTC, catch_up=30) == [
        anchor + timedelta(seconds=s) for s in (70, 80, 90)
    ]
    assert due_slots(every, anchor, anchor + timedelta(seconds=80), now, UTC, 30) == [
        anchor + timedelta(seconds=90)
    ]
    assert due_slots(every, anchor, None, now, UTC, catch_up=0) == [anchor + timedelta(seconds=90)]
    assert due_slots(every, anchor, anchor + timedelta(seconds=90), now, UTC, 30) == []
    # Aligned: multiples of the interval since the epoch, whatever the anchor.
    aligned = Every(60.0, aligned=True)
    odd = anchor + timedelta(seconds=7)
    assert aligned.next_slot(odd, odd, UTC) == anchor + timedelta(minutes=1)


def test_crontab_slots_are_the_crontabs_minutes_in_the_apps_timezone() -> None:
    cron = Cron.parse("30 9 * * mon-fri")
    paris = ZoneInfo("Europe/Paris")
    friday = datetime(2026, 3, 27, 12, 0, tzinfo=UTC)  # Friday; DST starts on the 29th
    first = cron.next_slot(friday, friday, paris)
    assert first == datetime(2026, 3, 30, 7, 30, tzinfo=UTC)  # Monday 09:30 CEST
    assert cron.last_slot(friday, first, paris) == first
    assert cron.last_slot(friday, first - timedelta(minutes=1), paris) is None  # none after anchor
    assert cron.last_slot(friday - timedelta(days=1), friday, paris) == datetime(
        2026, 3, 27, 8, 30, tzinfo=UTC
    )
    assert Cron.parse("0 0 29 2 *").next_slot(friday, friday, UTC).year == 2028


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"task": "t", "schedule": 5, "kwarg": {}}, "unknown key 'kwarg'"),
        ({"task": "t"}, "'schedule' is missing"),
        ({"schedule": 5}, "'task' is missing"),
        ({"task": "t", "schedule": -1}, "must be a number of seconds > 0"),
        ({"task": "t", "schedule": "soon"}, "schedule 'soon' is not supported"),
        ({"task": "t", "schedule": schedule(timedelta(0))}, "must be a number of seconds > 0"),
        ({"task": "t", "schedule": 5, "args": "x"}, "args 'x' must be a list"),
        ({"task": "t", "schedule": 5, "options": {"task_id": "x"}}, "'task_id' is set by"),
        ({"task": "t", "schedule": 5, "options": {"queu": "x"}}, "unknown option 'queu'"),
        ({"task": "t", "schedule": 5, "args": [object()]}, "cannot be stored in Postgres"),
        ("every minute", "must be a dict"),
    ],
)
def test_a_bad_entry_is_one_error_naming_it(entry: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match="beat_schedule entry 'bad'") as caught:
        entry_from_config("bad", entry)
    assert message in str(caught.value)
