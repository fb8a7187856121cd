"""The hand-off gate's memory, on a clock the test moves (the SQL side is in
tests/integration/test_handoff.py)."""

from __future__ import annotations

import pytest

from pg_transport.gate import HandoffGate
from tests.clock import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_tries_stop_after_misses_in_a_row_and_resume_after_the_pause(clock: Clock) -> None:
    gate = HandoffGate(misses=3, pause=0.01, clock=clock)
    for _ in range(2):
        gate.tried("q", handed=False)
        assert gate.worth_trying("q")
    gate.tried("q", handed=False)
    assert not gate.worth_trying("q")
    assert gate.worth_trying("other")  # queues are apart
    clock.now += 0.009
    assert not gate.worth_trying("q")
    clock.now += 0.001
    assert gate.worth_trying("q")


def paused_and_over(clock: Clock) -> HandoffGate:
    """A gate whose tries on "q" paused after three misses, the pause just over."""
    gate = HandoffGate(misses=3, pause=0.01, clock=clock)
    for _ in range(3):
        gate.tried("q", handed=False)
    clock.now += 0.01
    assert gate.worth_trying("q")
    return gate


def test_after_a_pause_one_miss_stops_the_tries_again(clock: Clock) -> None:
    gate = paused_and_over(clock)
    gate.tried("q", handed=False)
    assert not gate.worth_trying("q")


def test_a_handoff_ends_the_streak(clock: Clock) -> None:
    gate = paused_and_over(clock)
    gate.tried("q", handed=True)
    # Two misses again are not three in a row.
    gate.tried("q", handed=False)
    gate.tried("q", handed=False)
    assert gate.worth_trying("q")


def test_memory_is_bounded_and_forgetting_only_means_trying(clock: Clock) -> None:
    gate = HandoffGate(misses=1, pause=10.0, clock=clock)
    for n in range(5000):
        gate.tried(f"q{n}", handed=False)
    assert len(gate._streaks) <= 1024
    assert not gate.worth_trying("q4999")  # the latest is remembered
    assert gate.worth_trying("q0")  # the forgotten try again


@pytest.mark.parametrize(("misses", "pause"), [(0, 0.01), (3, -1.0)])
def test_bad_settings_are_refused(misses: int, pause: float) -> None:
    with pytest.raises(ValueError, match="misses must be >= 1 and pause >= 0"):
        HandoffGate(misses=misses, pause=pause)
