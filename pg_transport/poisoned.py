"""Poisoned messages: recover identity, run the hooks, record what they did.

A message is poisoned when its next delivery would exceed ``max_attempts``; the
claim itself has already moved it to ``dead_letter`` (nothing here can lose it).
This module only learns what the message was (:mod:`pg_transport.message.poison`),
tells the app through the ``message_poisoned`` signal, and records each handler's
outcome on the row so an operator can re-run the hooks (``pgq dead rehook ID``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pg_transport.message import identity as identity_registry
from pg_transport.message.poison import Decoded, decode
from pg_transport.signals import message_dead_lettered, message_poisoned

__all__ = ["PoisonReport", "handle_poisoned", "run_hooks", "tell_dead_lettered"]

logger = logging.getLogger("pg_transport.poison")


@dataclass
class PoisonReport:
    dead_letter_id: int
    queue: str
    task_id: str | None
    task_name: str | None
    identity: dict[str, Any]
    reasons: list[str]
    hooks: list[dict[str, Any]]


def run_hooks(
    *,
    dead_letter_id: int,
    queue: str,
    decoded: Decoded,
    identity: dict[str, Any],
    attempts: int,
) -> list[dict[str, Any]]:
    """Send ``message_poisoned``; one outcome per handler, a raising one included."""
    responses = message_poisoned.send(
        sender=decoded.task_name or queue,
        queue=queue,
        task_id=decoded.task_id,
        identity=dict(identity),
        args=decoded.args,
        kwargs=decoded.kwargs,
        attempts=attempts,
        dead_letter_id=dead_letter_id,
    )
    at = datetime.now(timezone.utc).isoformat()
    outcomes: list[dict[str, Any]] = []
    for receiver, response in responses:
        module = getattr(receiver, "__module__", "?")
        name = f"{module}.{getattr(receiver, '__qualname__', receiver)}"
        if isinstance(response, BaseException):
            outcomes.append({"receiver": name, "ok": False, "error": repr(response), "at": at})
        else:
            outcomes.append({"receiver": name, "ok": True, "at": at})
    return outcomes


def handle_poisoned(
    store: Any,
    *,
    dead_letter_id: int,
    queue: str,
    payload: Mapping[str, Any],
    attempts: int,
    reason: str = "",
) -> PoisonReport:
    """Recover identity, record it on the dead-letter row, run and record the hooks."""
    decoded = decode(payload)
    identity, why = identity_registry.recover(decoded.task_name, decoded.args, decoded.kwargs)
    reasons = decoded.reasons + why
    store.identify_dead_letter(
        dead_letter_id,
        task_id=decoded.task_id,
        task_name=decoded.task_name,
        identity=identity,
        reasons=reasons,
    )
    hooks = run_hooks(
        dead_letter_id=dead_letter_id,
        queue=queue,
        decoded=decoded,
        identity=identity,
        attempts=attempts,
    )
    store.record_hooks(dead_letter_id, hooks)
    failed = [h for h in hooks if not h["ok"]]
    logger.error(
        "dead-lettered message %s of queue %r (task %s %s) after %d deliveries (%s); identity %s%s",
        dead_letter_id,
        queue,
        decoded.task_name,
        decoded.task_id,
        attempts,
        reason or "max_attempts",
        identity,
        f"; {len(failed)} hook(s) failed: re-run with `pgq dead rehook {dead_letter_id}`"
        if failed
        else "",
    )
    return PoisonReport(
        dead_letter_id, queue, decoded.task_id, decoded.task_name, identity, reasons, hooks
    )


def tell_dead_lettered(
    *,
    dead_letter_id: int,
    queue: str,
    payload: Mapping[str, Any],
    reason: str,
    settled: bool,
) -> None:
    """Send ``message_dead_lettered``; a raising receiver is logged, never raised: the
    message is in dead_letter whatever its receivers do."""
    decoded = decode(payload)
    for receiver, response in message_dead_lettered.send(
        sender=decoded.task_name or queue,
        queue=queue,
        task_id=decoded.task_id,
        reason=reason,
        dead_letter_id=dead_letter_id,
        payload=payload,
        settled=settled,
    ):
        if isinstance(response, BaseException):
            logger.error(
                "message_dead_lettered receiver %r failed for dead letter %s: %r",
                receiver,
                dead_letter_id,
                response,
            )
