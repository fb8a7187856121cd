"""Acks and renewals the fencing refused: said once each, and counted.

An ack or a renewal lands only under the lease its delivery was granted. One refused
means the lease lapsed and the message was claimed again (or released): the task this
worker ran (or is running) will run once more elsewhere. That duplicate is the one
at-least-once delivery allows, but it must not go unseen: every refusal is one WARNING
line naming the task and its queue, and a per-process count (:func:`counts`) that the
worker's heartbeat file carries and ``pgq health`` shows (a refusal happens in one
worker process: Postgres keeps no trace of an ack that deleted nothing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from pg_transport.message.rows import Lease

__all__ = ["counts", "refused", "refused_of"]

logger = logging.getLogger("pg_transport.fencing")

_lock = threading.Lock()
_counts: dict[str, int] = {"ack": 0, "renewal": 0}


def refused(what: str, tokens: Iterable[Lease]) -> int:
    """Log and count the ``what`` (ack, renewal) of each of ``tokens``, which the
    fencing refused; how many there were."""
    n = 0
    for token in tokens:
        n += 1
        logger.warning(
            "pgq: %s of task %s (message %d, queue %r) refused: its lease lapsed and the "
            "message was delivered again; the task runs once more",
            what,
            token.task or "?",
            token.id,
            token.queue,
        )
    if n:
        with _lock:
            _counts[what] = _counts.get(what, 0) + n
    return n


def counts() -> dict[str, int]:
    """Refusals in this process so far, by kind (ack, renewal)."""
    with _lock:
        return dict(_counts)


def refused_of(tokens: Iterable[Lease], landed: Iterable[int]) -> list[Lease]:
    """The tokens whose row id is not among ``landed`` (what a statement touched)."""
    done = set(landed)
    return [t for t in tokens if t.id not in done]
