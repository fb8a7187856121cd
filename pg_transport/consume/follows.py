"""A follower delivered past its wait: say so in its headers and send the signal."""

from __future__ import annotations

import logging

from pg_transport.message.ordering import FOLLOWS, FOLLOWS_MISSING
from pg_transport.message.rows import Claimed
from pg_transport.signals import follows_missing as signal

__all__ = ["follows_missing"]

logger = logging.getLogger("pg_transport.ordering")


def follows_missing(claimed: Claimed) -> None:
    """A follower is delivered past its wait: say so in its headers (``pgq-follows-missing``:
    the task id it followed) and send :data:`~pg_transport.signals.follows_missing`. A
    receiver that raises is logged; the message is delivered all the same."""
    payload = claimed.payload
    if payload is None:
        return
    headers = payload.get("headers")
    if not isinstance(headers, dict):
        headers = payload["headers"] = {}
    follows = headers.get(FOLLOWS)
    headers[FOLLOWS_MISSING] = follows
    task = headers.get("task")
    logger.warning(
        "pgq: message %d of queue %r (task %r) follows task %r, which was not seen to "
        "finish within its wait: delivered now",
        claimed.id,
        claimed.queue,
        task,
        follows,
    )
    for receiver, outcome in signal.send_robust(
        sender=task if isinstance(task, str) else claimed.queue,
        queue=claimed.queue,
        task_id=headers.get("id"),
        follows=follows,
        payload=payload,
    ):
        if isinstance(outcome, Exception):
            logger.error("pgq: follows_missing receiver %r raised %r", receiver, outcome)
