"""Whether a publish should try to hand its message to a waiting consumer.

Trying costs the publish statement a look at the queue's waiters and a DELETE even when
nobody waits: about a tenth of the statement's round trip (docs/performance.md). Nobody
waits while a queue has a backlog: every consumer is busy, and the next claim of each
takes what is queued. So once ``misses`` tries in a row on a queue found no consumer
waiting, publishes to that queue stop trying for ``pause`` seconds. Then one tries
again: if it finds nobody, the pause starts over; if it hands its message over, every
publish tries again.

A consumer that starts waiting during a pause loses nothing but time: every publish
wakes the queue's listeners, and its claim takes the message one round trip later than
a hand-off would have brought it. Publishes spaced further apart than the pause (an
idle queue, where a hand-off matters) always try; so does a trickle in which consumers
come back to wait between publishes, since a try that finds one ends the streak.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic

__all__ = ["MISSES", "PAUSE", "HandoffGate"]

#: Tries in a row that found nobody waiting before a queue's publishes stop trying.
MISSES = 3
#: How long they stop (seconds).
PAUSE = 0.01
# Queues with a streak of misses remembered at most; more are forgotten (they try again).
_MAX_QUEUES = 1024


class HandoffGate:
    """Per-queue memory of the hand-off tries of one publisher (a :class:`Store`).

    Shared by the threads publishing through that store without a lock: two of them
    racing on a queue's entry can only make one more try or one less, never lose or
    deliver a message."""

    def __init__(
        self, misses: int = MISSES, pause: float = PAUSE,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        if misses < 1 or pause < 0:
            raise ValueError(f"misses must be >= 1 and pause >= 0, not {misses} and {pause}")
        self.misses = misses
        self.pause = pause
        self.clock = clock
        # queue -> (misses in a row, no tries before this time)
        self._streaks: dict[str, tuple[int, float]] = {}

    def worth_trying(self, queue: str) -> bool:
        streak = self._streaks.get(queue)
        return streak is None or self.clock() >= streak[1]

    def tried(self, queue: str, handed: bool) -> None:
        """Learn what a try on ``queue`` found."""
        if handed:
            self._streaks.pop(queue, None)
            return
        count = self._streaks.get(queue, (0, 0.0))[0] + 1
        until = self.clock() + self.pause if count >= self.misses else 0.0
        if len(self._streaks) >= _MAX_QUEUES and queue not in self._streaks:
            self._streaks.clear()
        self._streaks[queue] = (count, until)
