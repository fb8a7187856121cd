"""What a row of the message table becomes in Python, and what Python gives back.

:class:`Lease` is the fencing token of a delivery; :class:`Claimed` a row a claim or pop
brought back, its payload decoded (or the reason it could not be). Text and JSON stored
from what a message held go through :func:`text` and :func:`storable` first: Postgres
text holds no NUL, jsonb no NaN.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "FOLLOWS_MISSING",
    "HELD",
    "REFUSED",
    "Claimed",
    "Lease",
    "decode_claimed",
    "row_to_claimed",
    "storable",
    "text",
]

#: Largest payload (its JSON text, in bytes) published or delivered by default.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: The claim's notes (its ninth column).
HELD = "held"
#: An ack the claim carried that the fencing refused (not a delivery).
REFUSED = "refused"
FOLLOWS_MISSING = "follows-missing"
#: The claim's last row when a flow limit exists (not a message): the plain claim picked
#: nothing, and the flow claim is the one to send (queries.sql, claim_limits).
LIMITS = "limits"
#: The claim's very last row when it met a message the gates must judge (an ordering
#: key, a follows link; an ack of a keyed message): the next claim is the full claim,
#: not the lean one (queries.sql, claim_featured).
FEATURED = "featured"
#: The notes of rows that are no message, only at the end of a claim's answer.
MARKERS = frozenset({LIMITS, FEATURED})


@dataclass(frozen=True)
class Lease:
    """The fencing token of one delivery: row id, grant and queue (and, known only to
    the consumer that holds it, the task id of its message, for what it logs)."""

    id: int
    lease: int
    queue: str
    task: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Claimed:
    """One row a claim (or pop) brought back.

    ``dead_letter_id`` set: the claim moved the row to dead_letter instead of delivering
    it, for ``fault`` (past max_attempts, too large, not a JSON object). ``fault`` set and
    ``dead_letter_id`` None: the row was delivered but cannot be decoded into a message
    (the consumer dead-letters it under its lease). ``payload`` is None for an oversized
    row (never sent to the consumer) and for one that could not be decoded."""

    id: int
    queue: str
    priority: int
    read_ct: int
    lease: int
    payload: dict[str, Any] | None
    dead_letter_id: int | None = None
    fault: str | None = None
    #: The payload's JSON text, kept only when it did not decode.
    raw: str | None = None
    #: What the claim says beside the row: ``held`` (an ordered message it held back,
    #: not delivered: see the claim query) or ``follows-missing`` (a follower delivered
    #: past its wait, its predecessor not seen to finish).
    note: str | None = None

    @property
    def held(self) -> bool:
        """Held back by the claim (ordering): not a delivery, nothing to ack."""
        return self.note == HELD

    @property
    def refused(self) -> bool:
        """An ack the claim carried and the fencing refused: no delivery, a report."""
        return self.note == REFUSED

    @property
    def token(self) -> Lease:
        return Lease(self.id, self.lease, self.queue)


def decode_claimed(row: Sequence[bytes | None]) -> Claimed:
    """A claim row as libpq's text values (statements sent without psycopg's cursor).

    Never raises for what a row holds: a payload that does not decode into a JSON
    object comes back with ``fault`` saying why, for the consumer to dead-letter."""
    ident, queue, priority, read_ct, lease, payload, dead, fault = row[:8]
    note = row[8] if len(row) > 8 else None
    assert ident is not None and queue is not None
    assert priority is not None and read_ct is not None and lease is not None
    claimed = row_to_claimed(
        int(ident),
        queue.decode("utf-8", "replace"),
        int(priority),
        int(read_ct),
        int(lease),
        payload,
        None if dead is None else int(dead),
        None if fault is None else fault.decode("utf-8", "replace"),
    )
    if note is not None:
        claimed = replace(claimed, note=note.decode("utf-8", "replace"))
    return claimed


def row_to_claimed(
    ident: int,
    queue: str,
    priority: int,
    read_ct: int,
    lease: int,
    payload: Any,
    dead: int | None,
    fault: str | None,
) -> Claimed:
    """A Claimed row, its payload decoded and checked (``payload``: JSON text or bytes,
    or what psycopg already decoded)."""
    decoded: dict[str, Any] | None = None
    raw: str | None = None
    if payload is not None:
        try:
            value = json.loads(payload) if isinstance(payload, (bytes, str)) else payload
        except (ValueError, RecursionError) as exc:
            value, fault = None, fault or f"payload does not decode: {type(exc).__name__}"
        if isinstance(value, dict):
            decoded = value
        else:
            fault = fault or f"payload is a JSON {type(value).__name__}, not an object"
            if isinstance(payload, (bytes, str)):
                raw = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
    return Claimed(ident, queue, priority, read_ct, lease, decoded, dead, fault, raw)


def text(value: str) -> str:
    """``value`` as Postgres text can hold it: NUL and lone surrogates replaced."""
    cleaned = value.replace("\x00", "\N{REPLACEMENT CHARACTER}")
    return cleaned.encode("utf-8", "replace").decode("utf-8")


def storable(value: Any) -> Any:
    """``value`` as jsonb can hold it: strings through :func:`_text`, floats that are not
    finite (NaN, infinities) as their text, anything else not JSON as its repr."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, dict):
        return {text(str(k)): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return text(repr(value))
