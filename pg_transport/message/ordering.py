"""Ordered delivery per key, and "follows": what a message asks for, and where it says so.

A message asks in its headers (docs/ordering.md), which a Celery task's retry keeps:

* ``pgq-ordering-key``: delivered only once no earlier message of the same key and queue
  is left (waiting, running or failing); one at a time, in publish order.
* ``pgq-follows``: the task id of a message this one must not run before (until it is
  acked or dead-lettered), waiting at most ``pgq-follows-timeout`` seconds (default: the
  transport option ``follows_timeout``); past it, it runs with ``pgq-follows-missing``
  set to that task id and :data:`pg_transport.signals.follows_missing` is sent
  (:mod:`pg_transport.consume.follows`).
* ``pgq-followable``: record this message's end for followers published after it ended
  (a keyed message or a follower is findable while it is queued; its end is recorded when
  a follower named it, or when it is followable).

Celery's ``apply_async`` passes options it does not know on to the publish as message
properties: ``ordering_key=``, ``follows=``, ``follows_timeout=`` and ``followable=`` are
moved into those headers (:func:`move_options`). A task's own defaults (task attributes
``ordering_key``, a keyword argument's name or a callable of the call's arguments, and
``followable``) are applied when it is sent (:func:`task_defaults`, from Celery's
``before_task_publish``: :mod:`pg_transport.kombu.hooks`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pg_transport.config import DEFAULT_FOLLOWS_RETENTION, DEFAULT_FOLLOWS_TIMEOUT
from pg_transport.errors import PgqError
from pg_transport.message import options

__all__ = [
    "DEFAULT_FOLLOWS_RETENTION",
    "DEFAULT_FOLLOWS_TIMEOUT",
    "FOLLOWABLE",
    "FOLLOWS",
    "FOLLOWS_MISSING",
    "FOLLOWS_TIMEOUT",
    "MAX_KEY_HOLD",
    "ORDERING_KEY",
    "OrderingError",
    "Placement",
    "check_hold",
    "move_options",
    "placement",
    "task_defaults",
]

ORDERING_KEY = "pgq-ordering-key"
FOLLOWS = "pgq-follows"
FOLLOWS_TIMEOUT = "pgq-follows-timeout"
FOLLOWABLE = "pgq-followable"
#: Set on a follower delivered past its wait: the task id it followed.
FOLLOWS_MISSING = "pgq-follows-missing"

# apply_async's options -> the headers they become.
OPTIONS = {
    "ordering_key": ORDERING_KEY,
    "follows": FOLLOWS,
    "follows_timeout": FOLLOWS_TIMEOUT,
    "followable": FOLLOWABLE,
}

# Set by task_defaults when a task's default key cannot be had for a call: why.
# Celery logs what a before_task_publish receiver raises and publishes anyway (unordered,
# with no error for the caller); the publish refuses the message instead (placement).
DEFAULT_REFUSED = "pgq-ordering-refused"

# Keys and task ids are index keys: well under Postgres' limit for one.
MAX_KEY_BYTES = 1024
# Longest wait a follower may ask for (a year: longer overflows nothing, but means nothing).
MAX_FOLLOWS_TIMEOUT = 365 * 24 * 3600.0
#: Longest a message of an ordering key may wait to run (its ETA or countdown, then its
#: follows wait): every later message of its key waits behind it, so a year-9999 ETA
#: would hold the key for good. The database keeps the same bound for every writer
#: (migration 0013_publish_boundary.sql).
MAX_KEY_HOLD = 24 * 3600.0


class OrderingError(PgqError, ValueError):
    """A message asks for ordering in a way pgq cannot honour; it was not published."""


@dataclass(frozen=True)
class Placement:
    """What a message's ordering headers ask for, as the publish statement's values."""

    okey: str | None = None
    task_id: str | None = None
    follows: str | None = None
    follow_wait: float | None = None
    followable: bool = False

    def params(self) -> dict[str, Any]:
        return {
            "okey": self.okey,
            "task_id": self.task_id,
            "follows": self.follows,
            "follow_wait": self.follow_wait,
            "followable": self.followable,
        }


UNORDERED = Placement()


def _text(header: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise OrderingError(
            f"header {header}={value!r}: must be a string (or an integer), "
            f"not {type(value).__name__}"
        )
    text = str(value)
    if not text or "\x00" in text or len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise OrderingError(
            f"header {header}={text[:40]!r}: must be 1 to {MAX_KEY_BYTES} bytes of text without NUL"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise OrderingError(f"header {header}={text[:40]!r}: not valid Unicode") from None
    return text


def _seconds(header: str, value: Any) -> float:
    if isinstance(value, bool):
        raise OrderingError(f"header {header}={value!r}: must be a number of seconds")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise OrderingError(f"header {header}={value!r}: must be a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_FOLLOWS_TIMEOUT:
        raise OrderingError(
            f"header {header}={value!r}: must be between 0 and {MAX_FOLLOWS_TIMEOUT:.0f} seconds"
        )
    return seconds


def _flag(header: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", ""):
        return False
    raise OrderingError(f"header {header}={value!r}: must be true or false")


def placement(payload: Mapping[str, Any], default_wait: float) -> Placement:
    """What ``payload`` (a kombu message) asks for; :class:`OrderingError` when a header
    is not usable (the message is then not published)."""
    headers = payload.get("headers")
    if not isinstance(headers, Mapping):
        return UNORDERED
    refused = headers.get(DEFAULT_REFUSED)
    if refused is not None:
        raise OrderingError(str(refused))
    key, follows = headers.get(ORDERING_KEY), headers.get(FOLLOWS)
    followable = headers.get(FOLLOWABLE)
    if key is None and follows is None and followable is None:
        return UNORDERED
    okey = None if key is None else _text(ORDERING_KEY, key)
    after = None if follows is None else _text(FOLLOWS, follows)
    wait = headers.get(FOLLOWS_TIMEOUT)
    # A follower is followable: chains (c follows b follows a) are what follows is for.
    marked = after is not None or (followable is not None and _flag(FOLLOWABLE, followable))
    task_id = headers.get("id")
    if task_id is None:
        properties = payload.get("properties")
        if isinstance(properties, Mapping):
            task_id = properties.get("correlation_id")
    return Placement(
        okey=okey,
        task_id=None if task_id is None else _text("id", task_id),
        follows=after,
        follow_wait=None
        if after is None
        else (default_wait if wait is None else _seconds(FOLLOWS_TIMEOUT, wait)),
        followable=marked,
    )


def check_hold(place: Placement, delay: float) -> None:
    """:class:`OrderingError` when a message of an ordering key would wait longer than
    :data:`MAX_KEY_HOLD` to run: ``delay`` (its ETA or countdown, in seconds) and its
    follows wait together."""
    if place.okey is None:
        return
    hold = delay + (place.follow_wait or 0.0)
    if hold > MAX_KEY_HOLD:
        waits = f"eta/countdown {delay:.0f} s" + (
            f" + {FOLLOWS_TIMEOUT} {place.follow_wait:.0f} s" if place.follow_wait else ""
        )
        raise OrderingError(
            f"header {ORDERING_KEY}={place.okey[:40]!r}: a message of an ordering key may wait "
            f"at most {MAX_KEY_HOLD:.0f} s to run ({waits}): every later message of its key "
            "would wait behind it; send it without the key, or later"
        )


def move_options(message: dict[str, Any]) -> None:
    """Move apply_async's ordering options (message properties) into the headers, where
    a retry of the task keeps them. A header already there wins."""
    options.move_options(message, OPTIONS)


def task_defaults(task: Any, body: Any, headers: dict[str, Any]) -> None:
    """A task's ``ordering_key`` and ``followable`` attributes as ``headers``, unless the
    call gave them. A key this call cannot give (the argument not passed, a value that is
    no key, a callable that raises) makes the publish refuse the message with
    :class:`OrderingError` (:data:`DEFAULT_REFUSED`): raised from Celery's
    ``before_task_publish``, it would only be logged and the message published unordered."""
    # Read unbound: Celery keeps a task's options as class attributes, and a function
    # there would come back as a method of the task.
    spec: Callable[..., Any] | str | None = inspect.getattr_static(task, "ordering_key", None)
    if isinstance(spec, (staticmethod, classmethod)):
        spec = spec.__func__
    if spec is not None and ORDERING_KEY not in headers:
        args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) and body else ((), {})
        try:
            key = options.key_of(task, "ordering_key", spec, args, kwargs, OrderingError)
            if key is not None:
                headers[ORDERING_KEY] = _text(ORDERING_KEY, key)
        except Exception as exc:  # Celery would log it and publish the message unordered
            headers[DEFAULT_REFUSED] = (
                str(exc)
                if isinstance(exc, OrderingError)
                else f"task {task.name}: ordering_key raised {exc!r}"
            )
    if getattr(task, "followable", False) and FOLLOWABLE not in headers:
        headers[FOLLOWABLE] = True
