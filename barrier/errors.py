"""Errors the barrier raises on purpose."""

from __future__ import annotations

from pg_transport.errors import PgqError

__all__ = ["BarrierError", "BarrierExists"]


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
