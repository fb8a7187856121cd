"""What the consumer engine needs of the rest, and what it tells: its interfaces.

The engine (:mod:`~pg_transport.consume.engine`) imports neither kombu nor the transport:
the kombu layer is a :class:`Source` to it (which queues are consumed, with room for how
many messages; how to hand a message over), and a driver is its :class:`Timers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pg_transport.message.rows import Claimed

__all__ = ["Handle", "Source", "Statements", "Timers", "Want"]


@dataclass(frozen=True)
class Want:
    """What one consuming channel wants: its queues, and room for how many messages.

    ``window``: its prefetch window (0: unlimited); ``room``: slots free now (None: no
    limit)."""

    acked: Sequence[str]
    unacked: Sequence[str]
    room: int | None
    window: int


class Source(Protocol):
    """What the engine needs of the kombu layer."""

    def wants(self) -> list[Want]:
        """Every consuming channel's queues and free room."""

    def deliver(self, claimed: Claimed) -> None:
        """Hand a message to kombu (raises: the engine dead-letters it)."""

    def visibility_timeout(self, queue: str) -> float: ...

    def max_attempts(self, queue: str) -> int: ...

    def fair_share(self, queue: str) -> bool:
        """Whether ``queue`` is configured fair (claimed round-robin over its keys)."""


class Handle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """The driver's timers: call ``fn`` once after ``delay`` seconds, on its loop."""

    def call_later(self, delay: float, fn: Callable[[], None]) -> Handle: ...


@dataclass
class Statements:
    """How many statements of each kind the engine has sent (for operators and tests:
    a claim carrying acks counts as a claim, with its acks in ``acks_riding``)."""

    listen: int = 0
    pop: int = 0
    claim: int = 0
    ack: int = 0
    acks_riding: int = 0
    acks_alone: int = 0
    #: Settle statements (atomic deliveries' acks, gathered) and the deliveries in them.
    settle: int = 0
    settled: int = 0
    next_due: int = 0
    #: Rows claims held back (ordered messages parked or waiting: not delivered).
    held: int = 0
    #: Plain claims that found a flow limit (picked nothing; flow_claim sent after).
    flow_switch: int = 0
    #: Claims sent as lean_claim (no gates: the last answer met no keyed or following
    #: message).
    lean: int = 0
    #: Seconds claims spent on the wire, from sending to reading their answer.
    claim_seconds: float = 0.0
    #: Claims sent while the consumer held no more than a quarter of its prefetch
    #: window: its pool was about to run dry waiting for the answer.
    claims_low: int = 0
