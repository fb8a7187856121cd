"""Celery's task message protocol, checked before Celery is given a message.

A Celery worker unpacks a task message's fields without asking what they are: it
splits ``timelimit`` into two numbers, parses ``eta`` and ``expires`` as ISO 8601 dates,
looks ``task`` up in a dict, and does some of this only after its pool has given the
message a slot (prefork, when the pool is free) or later still, in a callback of its event
loop (when the pool is busy, or an ETA falls due). A field of the wrong shape there
either kills the worker (``Unrecoverable error``) or keeps the slot forever. Anyone with
the publisher role writes these fields, so the consumer checks them here first and
dead-letters a message that fails, naming the field.

What is checked is what Celery reads (celery.worker.strategy, celery.worker.request,
celery.app.trace), in the shapes Celery itself writes:

* protocol 2: the fields are message headers (``task`` among them); a JSON body must be
  ``[args, kwargs, embed]``;
* protocol 1: the fields are in the (JSON) body, with ``args`` and ``kwargs``;
* a "hybrid" message (protocol 2 headers, a JSON body that is an object with ``args``)
  is read by Celery as the body's fields updated by the headers: checked so too.

A message that is not a Celery task (no ``task`` header, no JSON object body naming a
task: kombu's own messages, a worker's remote-control broadcasts) is not looked at.
Bodies in other serializers (pickle, msgpack, YAML) are left to Celery: their headers are
still checked, as they sit in the JSON envelope. No SQL, no kombu: a payload in, a reason
out.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from dateutil.parser import isoparse

__all__ = ["EMBED", "FIELDS", "HYBRID", "MAX_SECONDS", "REQUIRED", "fault"]

#: The largest time limit accepted, in seconds (about 68 years: past it, timer
#: arithmetic in some pools overflows; no real limit is near it).
MAX_SECONDS = float(2**31)
# Dates Celery converts to timestamps in the worker's timezone: a year at either end
# of Python's range overflows there.
MIN_YEAR, MAX_YEAR = 2, 9998
_JSON = "application/json"

Check = Callable[[Any], "str | None"]


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) else f"is {_shown(value)}, not a string"


def _optional_string(value: Any) -> str | None:
    return None if value is None else _string(value)


def _count(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return None
    return f"is {_shown(value)}, not a whole number of at least 0"


def _optional_count(value: Any) -> str | None:
    return None if value is None else _count(value)


def _optional_bool(value: Any) -> str | None:
    return (
        None
        if value is None or isinstance(value, bool)
        else f"is {_shown(value)}, not true or false"
    )


def _seconds(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_SECONDS
    )


def _time_limits(value: Any) -> str | None:
    # Celery reads `if timelimit: hard, soft = timelimit` (an empty one is "none").
    if not value:
        return None
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(limit is None or _seconds(limit) for limit in value)
    ):
        return None
    return (
        f"is {_shown(value)}, not [hard, soft]: two time limits, each null or a number "
        f"of seconds from 0 to {MAX_SECONDS:.0f}"
    )


def _date(value: Any) -> str | None:
    # Celery parses any value but null with dateutil's isoparse, then makes it aware
    # (an empty string parses to nothing, which it cannot make aware).
    if value is None:
        return None
    if not isinstance(value, str):
        return f"is {_shown(value)}, not an ISO 8601 date string"
    try:
        # Python's parser first (ten times faster), then Celery's (dateutil's) for the
        # forms only it reads. A form only Python's read would fail Celery's parse,
        # which Celery reports itself (InvalidTaskError) before a pool slot is taken.
        parsed = datetime.fromisoformat(value)
    except ValueError:
        try:
            parsed = isoparse(value)
        except (ValueError, OverflowError) as exc:
            return f"is {_shown(value)}, not an ISO 8601 date ({exc})"
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    try:
        year = parsed.astimezone(timezone.utc).year
    except (ValueError, OverflowError):
        year = 0
    if not MIN_YEAR <= year <= MAX_YEAR:
        return f"is {_shown(value)}: a date outside the years {MIN_YEAR}-{MAX_YEAR}"
    return None


def _optional_list(value: Any) -> str | None:
    return None if value is None or isinstance(value, list) else f"is {_shown(value)}, not a list"


def _optional_object(value: Any) -> str | None:
    if value is None or isinstance(value, dict):
        return None
    return f"is {_shown(value)}, not an object"


def _strings(value: Any) -> str | None:
    if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None
    return f"is {_shown(value)}, not a list of strings"


#: Every field a worker reads before the task runs, with the shape it needs.
FIELDS: dict[str, Check] = {
    "id": _string,
    "task": _string,
    "shadow": _optional_string,
    "root_id": _optional_string,
    "parent_id": _optional_string,
    "group": _optional_string,
    "group_index": _optional_count,
    "lang": _optional_string,
    "origin": _optional_string,
    "argsrepr": _optional_string,
    "kwargsrepr": _optional_string,
    "timelimit": _time_limits,
    "eta": _date,
    "expires": _date,
    "retries": _optional_count,
    "ignore_result": _optional_bool,
    "replaced_task_nesting": _optional_count,
    "stamped_headers": _strings,
    "stamps": _optional_object,
}
#: Fields Celery requires.
REQUIRED = ("id", "task")
#: The embed (third part of a protocol 2 body; the body itself in protocol 1).
EMBED: dict[str, Check] = {
    "callbacks": _optional_list,
    "errbacks": _optional_list,
    "chain": _optional_list,
    "chord": _optional_object,
}


def fault(payload: Mapping[str, Any]) -> str | None:
    """Why a Celery worker could not take ``payload`` (None: it can, or it is not a
    Celery task message). ``payload`` has passed :func:`envelope.fault`."""
    headers = payload.get("headers") or {}
    if "task" in headers:  # protocol 2 (or hybrid)
        body = _body(payload, objects_only=True)
        if isinstance(body, dict) and "args" in body:
            # Hybrid: Celery takes these from the body, then the headers over them.
            fields = {k: body[k] for k in HYBRID if k in body}
            fields.update(headers)
            return _fields(fields, "field") or _arguments(body) or _embed(body, "body")
        return _fields(headers, "header")
    body = _body(payload, objects_only=False)
    if not isinstance(body, dict) or "task" not in body:
        return None  # not a Celery task message (or not one Celery would take as one)
    return _fields(body, "body field") or _arguments(body) or _embed(body, "body")


#: The body fields Celery reads from a hybrid message (celery.worker.strategy).
HYBRID = (
    "lang", "task", "id", "root_id", "parent_id", "group", "meth", "shadow", "eta",
    "expires", "retries", "timelimit", "argsrepr", "kwargsrepr", "origin",
)  # fmt: skip


def _fields(fields: Mapping[str, Any], where: str) -> str | None:
    for name in REQUIRED:
        if name not in fields:
            return f"Celery task message has no {where} {name!r}"
    for name, check in FIELDS.items():
        if name in fields:
            why = check(fields[name])
            if why is not None:
                return f"Celery task message's {where} {name!r} {why}"
    return None


def _arguments(body: Mapping[str, Any]) -> str | None:
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list):
        return f"Celery task message's body field 'args' is {_shown(args)}, not a list"
    if not isinstance(kwargs, dict):
        return f"Celery task message's body field 'kwargs' is {_shown(kwargs)}, not an object"
    return None


def _embed(embed: Mapping[str, Any], where: str) -> str | None:
    for name, check in EMBED.items():
        why = check(embed.get(name))
        if why is not None:
            return f"Celery task message's {where} {name!r} {why}"
    return None


def _body(payload: Mapping[str, Any], *, objects_only: bool) -> Any:
    """The decoded JSON body; None when it is not JSON or does not decode (Celery's
    decoder reports that, and pgq dead-letters what it cannot decode, before a pool slot
    is taken). ``objects_only``: decode only a body that is a JSON object (a protocol 2
    body is an array, which Celery's own unpacking checks as it reads it)."""
    if payload.get("content-type", _JSON) != _JSON or "compression" in (
        payload.get("headers") or {}
    ):
        return None  # another serializer, or compressed: Celery's decoder reads it
    text = payload.get("body")
    if not isinstance(text, str):
        return None
    try:
        if (payload.get("properties") or {}).get("body_encoding") == "base64":
            encoding = payload.get("content-encoding") or "utf-8"
            text = base64.b64decode(text, validate=True).decode(encoding)
        if objects_only and not text.lstrip().startswith("{"):
            return None
        return json.loads(text)
    except (binascii.Error, ValueError, LookupError):
        return None


def _shown(value: Any) -> str:
    kind = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        type(None): "null",
    }.get(type(value), "number")
    text = json.dumps(value, default=repr)
    if len(text) > 40:
        text = text[:39] + "…"
    return f"the JSON {kind} {text}"
