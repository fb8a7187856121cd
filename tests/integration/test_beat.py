"""pgq's beat scheduler on a real database: slots, the race for a slot, the lease.

Schedulers run in this process (each with its own connections); the race for one slot is
stepped through with two real transactions, the second waiting on the first's row lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.schedules import crontab

from pg_transport.beat import CannotStart, Scheduler
from pg_transport.db.locks import advisory_key
from pg_transport.errors import ConfigurationError
from pg_transport.publish.batching import batch
from tests.integration.conftest import Peek, build_schema
from tests.integration.squatter import squatter


def beat_app(broker_url: str, schema: str, entries: dict[str, Any]) -> Celery:
    app = Celery("beat_test", broker=broker_url)
    app.conf.update(
        broker_transport_options={"schema": schema},
        beat_schedule=entries,
        result_expires=None,
        task_default_queue="beat",
    )
    return app


@pytest.fixture
def peek(pg_url: str, schema: str) -> Iterator[Peek]:
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


def sends(peek: Peek) -> Counter[tuple[str, str]]:
    """Messages in the queue per (entry, slot), read from the messages themselves."""
    rows = peek(
        "SELECT payload->'headers'->>'pgq_beat_entry', payload->'headers'->>'pgq_beat_due'"
        " FROM {schema}.message"
    )
    return Counter((str(e), str(d)) for e, d in rows)


@pytest.fixture
def schedulers(broker_url: str, schema: str) -> Iterator[list[Scheduler]]:
    made: list[Scheduler] = []
    yield made
    for scheduler in made:
        scheduler.close()


def test_beat_schedule_is_stored_and_synced_again_on_start(
    broker_url: str, schema: str, peek: Peek, schedulers: list[Scheduler]
) -> None:
    entries = {
        "every-2": {"task": "t.a", "schedule": 2.0, "args": [1, "x"], "kwargs": {"k": 1}},
        "cron": {"task": "t.b", "schedule": crontab(minute="*/15", hour="8-17")},
        "delta": {"task": "t.c", "schedule": timedelta(minutes=1), "relative": True},
    }
    schedulers.append(Scheduler(beat_app(broker_url, schema, entries)))
    rows = peek("SELECT name, task, schedule, args, kwargs, origin FROM {schema}.beat_entry")
    assert sorted(rows) == [
        ("cron", "t.b", {"crontab": "*/15 8-17 * * *"}, [], {}, "config"),
        ("delta", "t.c", {"every": 60.0, "aligned": True}, [], {}, "config"),
        ("every-2", "t.a", {"every": 2.0, "aligned": False}, [1, "x"], {"k": 1}, "config"),
    ]
    [(anchor,)] = peek("SELECT anchor FROM {schema}.beat_entry WHERE name = 'every-2'")
    peek("UPDATE {schema}.beat_entry SET enabled = false WHERE name = 'cron'")
    # A later start: one entry changed its arguments, one its schedule, one is gone.
    entries = {
        "every-2": {"task": "t.a", "schedule": 2.0, "args": [2]},
        "cron": {"task": "t.b", "schedule": crontab(minute="0")},
    }
    schedulers.append(Scheduler(beat_app(broker_url, schema, entries)))
    rows = peek(
        "SELECT name, schedule, args, enabled, anchor = %s FROM {schema}.beat_entry", anchor
    )
    assert sorted(rows) == [
        ("cron", {"crontab": "0 * * * *"}, [], False, False),  # still disabled, new anchor
        ("every-2", {"every": 2.0, "aligned": False}, [2], True, True),  # same slots
    ]


@pytest.mark.sessions(11)  # 9 seen
def test_two_beats_racing_for_one_slot_send_it_once(
    broker_url: str, schema: str, peek: Peek, schedulers: list[Scheduler]
) -> None:
    """The first beat takes the slot and holds its transaction open; the second waits on
    the entry's row, then finds the slot taken once the first commits."""
    app = beat_app(broker_url, schema, {"e": {"task": "t.a", "schedule": 1.0}})
    first, second = Scheduler(app), Scheduler(app)
    schedulers += [first, second]
    peek("UPDATE {schema}.beat_entry SET anchor = now() - interval '1.5 seconds'")
    assert first.db is not None and second.db is not None
    entry = first.db.entries()[0][0]
    due = entry.anchor + timedelta(seconds=1)
    taken, committed = threading.Event(), threading.Event()
    results: dict[str, bool] = {}

    def first_sends() -> None:
        publisher = first.publisher()
        assert first.db is not None
        db = first.db
        with batch():

            def take(conn: psycopg.Connection[Any]) -> bool:
                return db.take_slot(conn, entry, due, "task-1", first.holder)

            results["first"] = bool(publisher.in_batch(take))
            taken.set()
            committed.wait(10)

    def second_sends() -> None:
        results["second"] = second.send_slot(entry, due)

    one = threading.Thread(target=first_sends)
    one.start()
    assert taken.wait(10)
    two = threading.Thread(target=second_sends)
    two.start()
    peek.wait_until(
        "SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND query LIKE %s",  # (not another run's beat)
        "%beat_slot%",
        failure="the second beat did not wait for the first's slot",
    )
    committed.set()
    one.join(10)
    two.join(10)
    assert results == {"first": True, "second": False}
    assert peek("SELECT entry, task_id FROM {schema}.beat_slot") == [("e", "task-1")]


@pytest.mark.sessions(13)
def test_beats_all_leading_at_once_send_every_slot_once(
    broker_url: str, schema: str, peek: Peek, schedulers: list[Scheduler]
) -> None:
    """Leadership aside (each sends as if it led), three beats at once: one message per slot."""
    entries = {
        "fast": {"task": "t.a", "schedule": 0.25},
        "slow": {"task": "t.b", "schedule": 1.0},
    }
    app = beat_app(broker_url, schema, entries)
    beats = [Scheduler(app) for _ in range(3)]
    schedulers += beats
    peek("UPDATE {schema}.beat_entry SET anchor = now() - interval '5.1 seconds'")
    start = threading.Barrier(len(beats))

    def run(beat: Scheduler) -> None:
        start.wait(10)
        for _ in range(8):
            beat.send_due()

    threads = [threading.Thread(target=run, args=(b,)) for b in beats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counted = sends(peek)
    assert counted and set(counted.values()) == {1}, counted
    per_entry = Counter(entry for entry, _ in counted)
    assert per_entry["slow"] >= 5 and per_entry["fast"] >= 20, per_entry
    [(slots,)] = peek("SELECT count(*) FROM {schema}.beat_slot")
    assert slots == sum(counted.values())


def test_a_disabled_entry_sends_nothing_and_a_slot_is_never_sent_early(
    broker_url: str, schema: str, peek: Peek, schedulers: list[Scheduler]
) -> None:
    app = beat_app(broker_url, schema, {"e": {"task": "t.a", "schedule": 3600.0}})
    beat = Scheduler(app)
    schedulers.append(beat)
    assert beat.db is not None
    entry = beat.db.entries()[0][0]
    # An hour from now by the database's clock: a beat whose clock runs ahead cannot send it.
    assert not beat.send_slot(entry, entry.anchor + timedelta(hours=1))
    peek("UPDATE {schema}.beat_entry SET anchor = now() - interval '2 hours'")
    entry = beat.db.entries()[0][0]
    peek("UPDATE {schema}.beat_entry SET enabled = false, revision = revision + 1")
    assert not beat.send_slot(entry, entry.anchor + timedelta(hours=1))
    assert beat.send_due() > 0 and sends(peek) == Counter()


def test_the_lease_has_one_holder_and_passes_on_when_released(
    broker_url: str, schema: str, peek: Peek, schedulers: list[Scheduler]
) -> None:
    app = beat_app(broker_url, schema, {})
    one, two = Scheduler(app), Scheduler(app)
    schedulers += [one, two]
    assert one.hold_lease() and not two.hold_lease()
    assert one.hold_lease() and one.term == 1
    one.close()
    assert two.hold_lease() and two.term == 2
    peek("UPDATE {schema}.beat_leader SET lease_until = now() - interval '1 second'")
    three = Scheduler(app)
    schedulers.append(three)
    assert three.hold_lease() and three.term == 3
    assert not two.hold_lease() and not two.leading


def test_a_bad_entry_stops_the_scheduler_before_it_touches_the_database(
    broker_url: str, schema: str, peek: Peek
) -> None:
    app = beat_app(broker_url, schema, {"bad": {"task": "t", "schedule": 0}})
    with pytest.raises(CannotStart, match="beat_schedule entry 'bad'") as caught:
        Scheduler(app)
    assert isinstance(caught.value.__cause__, ConfigurationError)
    assert caught.value.code == "pgq beat cannot start: " + str(caught.value.__cause__)
    assert peek("SELECT to_regclass(%s)", f"{schema}.beat_entry") == [(None,)]


def test_a_broker_that_is_not_pgq_is_refused() -> None:
    app = Celery("x", broker="redis://localhost:6379/0")
    app.conf.beat_schedule = {}
    app.conf.result_expires = None
    with pytest.raises(CannotStart, match="needs a pgq:// broker"):
        Scheduler(app)


@pytest.mark.sessions(11)
def test_a_connect_only_role_holding_every_key_delays_no_start_and_no_takeover(
    pg_url: str, broker_url: str, schema: str, peek: Peek, schedulers: list[Scheduler]
) -> None:
    entries = {"every-2": {"task": "t.a", "schedule": 2.0}}
    app = beat_app(broker_url, schema, entries)
    build_schema(peek.conn, schema)  # (a migration beside a squatter: test_schema.py)
    with squatter(pg_url) as squat:
        # The key earlier pgq versions synced the schedule under at start-up.
        squat.hold(advisory_key("pgq:beat", schema))
        one = squat.beside("a beat's start-up", lambda: Scheduler(app))
        schedulers.append(one)
        assert one.hold_lease() and one.term == 1
        two = squat.beside("a second beat's start-up", lambda: Scheduler(app))
        schedulers.append(two)
        assert not two.hold_lease()
        one.close()  # the leader goes: the standby takes over
        assert squat.beside("the takeover", two.hold_lease) and two.term == 2
        assert peek("SELECT name FROM {schema}.beat_entry") == [("every-2",)]
        # What the start-up does lock, the squatter cannot take.
        with pytest.raises(psycopg.errors.InsufficientPrivilege), squat.conn.transaction():
            squat.conn.execute(
                psycopg.sql.SQL("LOCK TABLE {}.beat_entry IN SHARE UPDATE EXCLUSIVE MODE").format(
                    psycopg.sql.Identifier(schema)
                )
            )
