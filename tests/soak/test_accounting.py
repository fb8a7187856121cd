"""The soak's duplicate accounting on made-up histories (no database, runs by default)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from benchmarks.soak import classify

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_rerun_after_its_first_worker_was_killed_is_explained_by_the_kill() -> None:
    runs = [("a", "w0g0", at(1)), ("b", "w1g0", at(1)), ("a", "w1g0", at(8))]
    counts, unexplained = classify(runs, [("kill", "w0g0", at(2))], ["a", "b"])
    assert counts["duplicates"] == 1
    assert counts["explained_by_kills"] == 1
    assert counts["unexplained"] == 0 and unexplained == []
    assert counts["ran"] == 2 and counts["never_ran"] == 0


def test_a_kill_before_the_first_run_or_after_the_rerun_explains_nothing() -> None:
    runs = [("a", "w0g0", at(5)), ("a", "w1g0", at(8))]
    events = [("kill", "w0g0", at(4)), ("kill", "w0g0", at(9)), ("kill", "w1g0", at(6))]
    counts, unexplained = classify(runs, events, ["a"])
    assert counts["unexplained"] == 1
    assert unexplained[0]["task_id"] == "a"


def test_a_termination_explains_only_when_no_kill_does() -> None:
    runs = [("a", "w0g0", at(1)), ("a", "w1g0", at(8)), ("b", "w0g0", at(1)), ("b", "w1g0", at(9))]
    events = [("terminate", "w0g0", at(2)), ("kill", "w0g0", at(8.5))]
    counts, _ = classify(runs, events, ["a", "b"])
    assert counts["explained_by_terminations"] == 1  # a: the kill came after its rerun
    assert counts["explained_by_kills"] == 1  # b
    assert counts["unexplained"] == 0


def test_a_task_that_never_ran_is_counted() -> None:
    counts, _ = classify([("a", "w0g0", at(1))], [], ["a", "b"])
    assert counts["never_ran"] == 1
    assert counts["duplicates"] == 0
