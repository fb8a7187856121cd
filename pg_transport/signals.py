"""Signals pgq sends (contract: ``message_poisoned``; also ``message_dead_lettered``)."""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "chord_part_refused",
    "follows_missing",
    "message_dead_lettered",
    "message_poisoned",
]

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

#: Sent by a consumer for every message it moves to dead_letter: poisoned (past
#: max_attempts), too large, not a kombu message, undeliverable, rejected without requeue,
#: or with a body that does not decode. ``sender`` is the task name, or the queue when
#: unknown; ``payload`` is the stored message (headers, body; never decoded here).
#: ``settled`` is true when the worker's own code decided the outcome (a reject without
#: requeue, a body Celery could not decode): Celery has recorded what it records of it
#: (a rejected task's failure, its errbacks, its chord part), so a receiver must not do
#: that again. pgq connects a receiver: the task's result becomes FAILURE.
message_dead_lettered = Signal(
    name="message_dead_lettered",
    providing_args={"queue", "task_id", "reason", "dead_letter_id", "payload", "settled"},
)

#: Sent by a consumer as it delivers a follower whose wait ran out before the task it
#: follows was seen to finish (docs/ordering.md); the delivered message carries the
#: header ``pgq-follows-missing`` too. ``sender`` is the task name, or the queue when
#: unknown; ``follows`` the task id it named; ``payload`` the message as delivered.
follows_missing = Signal(
    name="follows_missing",
    providing_args={"queue", "task_id", "follows", "payload"},
)

#: Sent by the transport as it refuses to publish a part of a chord's header (a unique
#: key on it, a header it cannot honour): the message is not queued and the publish
#: raises ``exc``. Celery armed the chord before sending its header, so the chord's
#: result backend is to fail it (pgq's does: the body's errbacks run, its result is a
#: ``ChordError``). ``sender`` is the task name; ``task_id`` the part's id, ``group_id``
#: its chord's group id, ``payload`` the message as it was to be published.
chord_part_refused = Signal(
    name="chord_part_refused",
    providing_args={"task_id", "group_id", "exc", "payload"},
)
