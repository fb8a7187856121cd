"""``Barrier(app).dispatch(…)``: arm a fan-in barrier and publish its parts."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from celery.canvas import Signature
from celery.utils import uuid

from barrier import inspect
from pg_transport.fanin import state
from pg_transport.fanin.backend import Backend, backend_for
from pg_transport.fanin.errors import BarrierError
from pg_transport.fanin.messages import as_signature, task_message
from pg_transport.fanin.protocol import HEADER_BARRIER, HEADER_PART
from pg_transport.fanin.settings import seconds
from pg_transport.publish import joined

__all__ = ["Barrier", "Dispatched"]

logger = logging.getLogger("barrier.dispatch")


@dataclass(frozen=True)
class Dispatched:
    """What a dispatch armed: the task ids of the parts, the callback and the errback."""

    barrier_id: str
    part_ids: tuple[str, ...]
    callback_id: str
    errback_id: str | None


def _frozen(app: Any, sig: Any, what: str) -> Signature:
    """A copy of ``sig`` with its task id fixed now, so it is known (and shown)
    before the message exists."""
    signature = as_signature(app, sig, what).clone()
    signature.options.setdefault("task_id", uuid())
    return signature


class Barrier:
    """Fan-in on Postgres for one Celery app (whose broker must be pgq).

    The barrier's tables live next to the app's queue, so arming and publishing
    the parts is one transaction: either the barrier is armed and every part is
    queued, or nothing happened.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def backend(self) -> Backend:
        # Connecting waits for first use: Barrier(app) may be built at import time.
        return backend_for(self.app)

    def dispatch(
        self,
        barrier_id: str,
        parts: Iterable[Any],
        callback: Any,
        errback: Any = None,
        *,
        ttl: float | None = None,
        stuck_timeout: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> Dispatched:
        """Arm ``barrier_id`` with one slot per part and publish the parts.

        The callback runs once every part succeeded, with the parts' results in
        part order as its first argument (like a chord) and ``TRANSPORT_MARKER=True``
        in its kwargs. If a part fails for good, or the barrier outlives ``ttl``
        seconds, or no part finishes for ``stuck_timeout`` seconds, the errback runs
        instead, once, with a dict describing what happened as its first argument.
        Zero parts fire the callback at once (with ``[]``). An id that exists already
        is refused (:class:`~barrier.BarrierExists`): ids are single-use.
        ``conn`` arms inside the caller's open transaction (a savepoint) instead of
        a transaction of our own, as does an open ``pg_transport.transaction()`` block
        (or a joined Django ``transaction.atomic()``).
        """
        if not isinstance(barrier_id, str) or not barrier_id:
            raise BarrierError(f"a barrier id must be a non-empty string, not {barrier_id!r}")
        db = self.backend
        ttl = seconds("ttl", db.settings.ttl if ttl is None else ttl)
        stuck = seconds(
            "stuck_timeout", db.settings.stuck_timeout if stuck_timeout is None else stuck_timeout
        )
        outgoing = [
            task_message(
                self.app,
                as_signature(self.app, part, f"part {index}"),
                headers={HEADER_BARRIER: barrier_id, HEADER_PART: index},
            )
            for index, part in enumerate(parts)
        ]
        callback_sig = _frozen(self.app, callback, "callback")
        errback_sig = _frozen(self.app, errback, "errback") if errback is not None else None

        def work(c: psycopg.Connection[Any]) -> None:
            state.arm(
                db,
                c,
                barrier_id,
                outgoing,
                callback_sig,
                errback_sig,
                ttl=ttl,
                stuck_timeout=stuck,
                metadata=metadata or {},
            )

        caller = joined.current() if conn is None else None
        if conn is not None:
            work(conn)
        elif caller is not None:
            db.publisher.on_caller(caller, work)
        else:
            # Not retried: after a lost commit a retry would find the id taken.
            db.connector.run(work, idempotent=False)
        logger.debug("barrier %s armed with %d parts", barrier_id, len(outgoing))
        return Dispatched(
            barrier_id=barrier_id,
            part_ids=tuple(o.task_id for o in outgoing),
            callback_id=str(callback_sig.id),
            errback_id=str(errback_sig.id) if errback_sig is not None else None,
        )

    def show(self, barrier_id: str) -> dict[str, Any] | None:
        """One barrier as a plain dict (see :func:`barrier.inspect.show`)."""
        db = self.backend
        return inspect.show(db.connector, db.schema, barrier_id)

    def counts(self) -> dict[str, int]:
        """Barriers by status (see :func:`barrier.inspect.status_counts`)."""
        db = self.backend
        return inspect.status_counts(db.connector, db.schema)
