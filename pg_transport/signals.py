"""Signals pgq sends (contract: ``message_poisoned``)."""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["message_poisoned"]

#: Sent when a message is dead-lettered for exceeding max_attempts (or by
#: ``pgq dead rehook``). ``sender`` is the task name, or the queue when unknown.
message_poisoned = Signal(
    name="message_poisoned",
    providing_args={
        "queue",
        "task_id",
        "identity",
        "args",
        "kwargs",
        "attempts",
        "dead_letter_id",
    },
)
