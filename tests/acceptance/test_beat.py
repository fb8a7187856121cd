"""Real ``celery beat -S pgq`` processes: N replicas send each slot once, a SIGKILLed leader
is replaced within two ticks, a restart resends nothing, skewed clocks change nothing.

What was sent is read from the messages themselves (their ``pgq_beat_entry`` and
``pgq_beat_due`` headers), not from the scheduler's own bookkeeping.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.beats import BEAT_APP, TICK, Beat, start_beat, start_beats, stop_beats
from tests.acceptance.harness import ROOT, Env, wait_for

# The sessions a test holds at most (the most of two runs, -n 0); a test may say otherwise.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(6)]

# The entries' periods: shorter than the tick (slots fall due several times a tick, the
# beat sleeps until the next one), so that the slots the tests count come quickly; the
# lease, and so the takeover, keeps the tick's timing.
EVERY = TICK / 2
HALF = EVERY / 2


@pytest.fixture
def beats(env: Env) -> Iterator[list[Beat]]:
    started: list[Beat] = []
    yield started
    stop_beats(started)


def rows(env: Env, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(env.pg_url) as conn:
        text = sql.SQL(query).format(schema=sql.Identifier(env.schema))
        return conn.execute(text, params).fetchall()


def sent(env: Env) -> Counter[tuple[str, datetime]]:
    """Messages in the queue per (entry, slot)."""
    found = rows(
        env,
        "SELECT payload->'headers'->>'pgq_beat_entry', payload->'headers'->>'pgq_beat_due'"
        " FROM {schema}.message",
    )
    return Counter((str(e), datetime.fromisoformat(str(d))) for e, d in found)


def slots_of(counted: Counter[tuple[str, datetime]], entry: str) -> list[datetime]:
    return sorted(due for name, due in counted if name == entry)


def assert_once_and_contiguous(
    counted: Counter[tuple[str, datetime]], entry: str, every: float
) -> list[datetime]:
    """Every slot of ``entry`` sent exactly once, none missing between the first and last."""
    assert counted and max(counted.values()) == 1, [k for k, n in counted.items() if n > 1]
    slots = slots_of(counted, entry)
    steps = {round((b - a).total_seconds(), 3) for a, b in itertools.pairwise(slots)}
    assert steps <= {every}, (entry, steps)
    return slots


def leader(env: Env) -> tuple[str, int, datetime]:
    [(holder, term, acquired_at)] = rows(
        env, "SELECT holder, term, acquired_at FROM {schema}.beat_leader"
    )
    return str(holder), int(term), acquired_at


def count_of(env: Env, entry: str) -> int:
    return len(slots_of(sent(env), entry))


def test_three_replicas_send_each_slot_once(env: Env, beats: list[Beat]) -> None:
    entries = {"half": {"every": HALF}, "slot": {"every": EVERY}}
    beats += start_beats(env, entries, {}, {}, {})
    wait_for(lambda: count_of(env, "slot") >= 6, 30, "six slots of 'slot'")
    # One beat did the work; the others only watched the lease (until it stops: a beat
    # stopped cleanly hands the lease over).
    assert len(rows(env, "SELECT DISTINCT sent_by FROM {schema}.beat_slot")) == 1
    stop_beats(beats)
    counted = sent(env)
    assert len(assert_once_and_contiguous(counted, "slot", EVERY)) >= 6
    assert len(assert_once_and_contiguous(counted, "half", HALF)) >= 12
    [(early,)] = rows(env, "SELECT count(*) FROM {schema}.beat_slot WHERE sent_at < due_at")
    assert early == 0


def test_a_killed_leader_is_replaced_within_two_ticks_and_no_slot_is_lost(
    env: Env, beats: list[Beat]
) -> None:
    entries = {"slot": {"every": EVERY}}
    beats += start_beats(env, entries, {}, {}, {})
    wait_for(lambda: count_of(env, "slot") >= 3, 30, "three slots sent")
    # How late the leader sent its slots so far (the first, due as it started, aside):
    # the delay a loaded machine puts on a beat's wake-up at a tick, the takeover's too
    # (at least the 0.25 s the test's own reading of the time after the kill takes).
    [(late,)] = rows(
        env,
        "SELECT extract(epoch FROM max(sent_at - due_at))::float8 FROM {schema}.beat_slot"
        " WHERE due_at > (SELECT min(due_at) FROM {schema}.beat_slot)",
    )
    slack = max(0.25, float(late))
    for _ in range(2):
        holder, term, _ = leader(env)
        pid = int(holder.split(":")[-2])
        [victim] = [b for b in beats if b.proc.pid == pid]
        victim.kill()
        [(killed_at,)] = rows(env, "SELECT clock_timestamp()")
        new_holder, _, acquired_at = wait_for(
            lambda term=term: (found := leader(env))[1] > term and found,
            30,
            "another beat to take the lease",
        )
        assert new_holder != holder
        # Two ticks, and the slack measured above.
        taken_after = (acquired_at - killed_at).total_seconds()
        assert taken_after <= 2 * TICK + slack, (taken_after, slack)
        before = count_of(env, "slot")
        wait_for(lambda before=before: count_of(env, "slot") >= before + 3, 30, "sends to go on")
    stop_beats(beats)
    # The slots that fell due while no beat led were sent late, once each.
    assert len(assert_once_and_contiguous(sent(env), "slot", EVERY)) >= 9


@pytest.mark.sessions(4)  # the most of two runs, -n 0
def test_a_restarted_beat_sends_nothing_twice(env: Env, beats: list[Beat]) -> None:
    entries = {"slot": {"every": EVERY}, "cron": {"crontab": "* * * * *"}}
    first = start_beat(env, entries)
    beats.append(first)
    wait_for(lambda: count_of(env, "slot") >= 3, 30, "three slots sent")
    first.kill()  # SIGKILL: no goodbye, its lease runs out by itself
    before = sent(env)
    again = start_beat(env, entries)
    beats.append(again)
    wait_for(lambda: count_of(env, "slot") >= len(slots_of(before, "slot")) + 3, 30, "more slots")
    again.kill(signal.SIGTERM)
    third = start_beat(env, entries)  # after a clean stop, at once
    beats.append(third)
    wait_for(lambda: count_of(env, "slot") >= len(slots_of(before, "slot")) + 6, 30, "more slots")
    third.kill(signal.SIGTERM)
    slots = assert_once_and_contiguous(sent(env), "slot", EVERY)
    assert slots[: len(slots_of(before, "slot"))] == slots_of(before, "slot")
    [(entries_sent,)] = rows(env, "SELECT sum(sent_count) FROM {schema}.beat_entry")
    assert entries_sent == sum(sent(env).values())


def test_beats_with_skewed_clocks_send_each_slot_once_and_never_early(
    env: Env, beats: list[Beat]
) -> None:
    """Three beats whose clocks are 4 s ahead, right and 4 s behind; the leader is
    killed twice so that each clock gets to lead."""
    entries = {"slot": {"every": EVERY}}
    beats += start_beats(env, entries, *({"TEST_CLOCK_SKEW": s} for s in ("4", "0", "-4")))
    wait_for(lambda: count_of(env, "slot") >= 3, 30, "three slots sent")
    for _ in range(2):
        holder, term, _ = leader(env)
        pid = int(holder.split(":")[-2])
        [victim] = [b for b in beats if b.proc.pid == pid]
        victim.kill()
        wait_for(lambda term=term: leader(env)[1] > term, 30, "a new leader")
        before = count_of(env, "slot")
        wait_for(lambda before=before: count_of(env, "slot") >= before + 2, 30, "more sends")
    assert "clock skewed by" in "".join(b.output() for b in beats)
    stop_beats(beats)
    assert_once_and_contiguous(sent(env), "slot", EVERY)
    [(early,)] = rows(env, "SELECT count(*) FROM {schema}.beat_slot WHERE sent_at < due_at")
    assert early == 0


@pytest.mark.sessions(5)  # the most of two runs, -n 0
def test_a_leader_whose_sessions_are_terminated_goes_on_and_sends_each_slot_once(
    env: Env, beats: list[Beat]
) -> None:
    entries = {"half": {"every": HALF}}
    beats += start_beats(env, entries, {}, {})
    wait_for(lambda: count_of(env, "half") >= 4, 30, "four slots sent")
    for _ in range(3):
        holder, _, _ = leader(env)
        pid = int(holder.split(":")[-2])
        [(terminated,)] = rows(
            env,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name IN (%s, %s)",
            f"pgq-beat:{pid}",
            f"pgq:{pid}",
        )
        assert terminated >= 1
        before = count_of(env, "half")
        wait_for(lambda before=before: count_of(env, "half") >= before + 4, 30, "sends to go on")
    assert all(b.proc.poll() is None for b in beats), "a beat exited"
    stop_beats(beats)
    assert len(assert_once_and_contiguous(sent(env), "half", HALF)) >= 16


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{'bad': {'task': 'x', 'shedule': 5}}", "unknown key 'shedule'"),
        ("{'bad': {'task': 'x', 'schedule': -5}}", "must be a number of seconds > 0"),
        ("{'bad': {'task': 'x', 'schedule': 5, 'options': 'fast'}}", "must be a dict"),
    ],
)
@pytest.mark.sessions(1)  # the most of two runs, -n 0
def test_a_bad_schedule_stops_beat_with_one_error(env: Env, raw: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", BEAT_APP, "beat", "-S", "pgq"],
        cwd=tempfile.mkdtemp(prefix="pgq-beat-"),
        env=env.environ(TEST_BEAT_RAW=raw, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=60,
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 1, output
    lines = [line for line in output.splitlines() if message in line]
    assert len(lines) == 1 and "beat_schedule entry 'bad'" in lines[0], output
    assert "Traceback" not in output, output
    assert rows(env, "SELECT name FROM {schema}.beat_entry") == []


@pytest.mark.sessions(1)  # the most of two runs, -n 0
def test_a_slot_sent_twice_would_be_seen(env: Env) -> None:
    """The check the tests above rely on fails on a duplicate and on a missing slot."""
    t0 = datetime(2026, 1, 1, 12, 0, 0).astimezone()
    twice = Counter({("one", t0): 1, ("one", t0 + timedelta(seconds=1)): 2})
    with pytest.raises(AssertionError):
        assert_once_and_contiguous(twice, "one", 1.0)
    gap = Counter({("one", t0): 1, ("one", t0 + timedelta(seconds=2)): 1})
    with pytest.raises(AssertionError):
        assert_once_and_contiguous(gap, "one", 1.0)
