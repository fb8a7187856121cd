"""Errors the barrier raises on purpose."""

from __future__ import annotations

from pg_transport.errors import PgqError

__all__ = ["BarrierError", "BarrierExists", "LockHeld"]


class BarrierError(PgqError):
    """A barrier cannot be dispatched or handled as asked."""


class BarrierExists(BarrierError):
    """The barrier id is taken: barrier ids are single-use."""

    def __init__(self, barrier_id: str, status: str | None) -> None:
        self.barrier_id = barrier_id
        self.status = status
        super().__init__(
            f"barrier {barrier_id!r} already exists (status {status}); barrier ids are "
            "single-use, dispatch under a new id"
        )


class LockHeld(BarrierError):
    """:func:`barrier.guards.lock_id` gave up: another session held the id's lock for
    longer than the caller would wait. ``holders`` names them (pid, role, application):
    an advisory key can be computed, and taken, by any session that can connect."""

    def __init__(self, parts: tuple[str, ...], waited: float, holders: list[str]) -> None:
        self.parts = parts
        self.holders = holders
        who = ", ".join(holders) or "a session that has since let it go"
        super().__init__(f"the lock of {parts!r} was held for {waited:g} s by {who}")
