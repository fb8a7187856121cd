"""Unique tasks: what a message asks for, and where it says so (docs/flow-control.md).

A message asks in its headers, which a Celery task's retry keeps:

* ``pgq-unique-key``: no other message holding this key may be queued at the same time
  (the key is global to the schema: a task's default key starts with the task's name).
* ``pgq-unique-while``: ``queued`` (the default: the key is free again once the message
  is delivered) or ``queued_or_running`` (held until the message is acked, dead-lettered,
  expired or purged).
* ``pgq-unique-conflict``: what the publish of a duplicate does: ``return`` (the default:
  nothing is inserted, the publish succeeds) or ``raise``
  (:class:`~pg_transport.errors.DuplicateTask` naming the holder's task id).

Celery's ``apply_async`` passes options it does not know on as message properties:
``unique_key=``, ``unique_while=`` and ``unique_conflict=`` are moved into those headers
(:func:`move_options`). A task's own defaults (task attributes ``unique_key``: an
argument's name, a callable of the call's arguments, or ``True`` for the task's name and
all its arguments; ``unique_while``; ``unique_conflict``) are applied when it is sent
(:func:`task_defaults`, from Celery's ``before_task_publish``).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pg_transport.config import DEFAULT_UNIQUE_WAIT
from pg_transport.errors import ConfigurationError
from pg_transport.message import options

__all__ = [
    "DEFAULT_UNIQUE_WAIT",
    "UNIQUE_CONFLICT",
    "UNIQUE_KEY",
    "UNIQUE_WHILE",
    "UniqueError",
    "Uniqueness",
    "chord_of",
    "holder_of",
    "move_options",
    "note_holder",
    "refuse_in_chord",
    "refuse_on_chord_body",
    "task_defaults",
    "uniqueness",
]

UNIQUE_KEY = "pgq-unique-key"
UNIQUE_WHILE = "pgq-unique-while"
UNIQUE_CONFLICT = "pgq-unique-conflict"

# apply_async's options -> the headers they become.
OPTIONS = {
    "unique_key": UNIQUE_KEY,
    "unique_while": UNIQUE_WHILE,
    "unique_conflict": UNIQUE_CONFLICT,
}

WHILE = ("queued", "queued_or_running")
CONFLICT = ("return", "raise")

# Set by task_defaults when a task's default key cannot be had for a call: why (Celery
# only logs what a before_task_publish receiver raises, and would publish the message).
DEFAULT_REFUSED = "pgq-unique-refused"

#: Keys are index keys: well under Postgres' limit for one.
MAX_KEY_BYTES = 1024

# DEFAULT_UNIQUE_WAIT (pg_transport.config): seconds a unique publish waits for a
# transaction that inserted the same key and has not ended yet (an application's) before
# it raises UniqueBusy; the transport option ``unique_wait``.


#: Meta key of a result row that stands for a duplicate: the holder's task id, whose
#: result the duplicate's resolves to (pg_transport.results.backend).
RESULT_ALIAS = "pgq_result_alias"

#: Duplicates this process remembers (the oldest forgotten first).
MAX_NOTED = 10_000

_holders: OrderedDict[str, str] = OrderedDict()
_holders_lock = threading.Lock()


def note_holder(task_id: str, holder: str) -> None:
    """Remember that the publish of ``task_id`` was a duplicate of ``holder``'s: its
    ``AsyncResult`` resolves to the holder's result in this process (and, where the
    result backend may write, everywhere: :mod:`pg_transport.results.backend`)."""
    if not task_id or not holder or task_id == holder:
        return
    with _holders_lock:
        _holders[task_id] = holder
        _holders.move_to_end(task_id)
        while len(_holders) > MAX_NOTED:
            _holders.popitem(last=False)


def holder_of(task_id: str) -> str | None:
    """The task whose key the publish of ``task_id`` found held, if this process
    published it as a duplicate."""
    with _holders_lock:
        return _holders.get(task_id)


class UniqueError(ConfigurationError):
    """A message asks for uniqueness in a way pgq cannot honour (the option and the value
    named); it was not published."""


@dataclass(frozen=True)
class Uniqueness:
    """What a message's unique headers ask for (``key`` None: nothing)."""

    key: str | None = None
    while_running: bool = False
    conflict: str = "return"

    def params(self) -> dict[str, Any]:
        return {"ukey": self.key, "urun": self.while_running}


NOT_UNIQUE = Uniqueness()


def _key_text(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UniqueError(f"{what}={value!r}: must be a string (or an integer)")
    text = str(value)
    if not text or "\x00" in text:
        raise UniqueError(f"{what}={text[:40]!r}: must be non-empty text without NUL")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise UniqueError(f"{what}={text[:40]!r}: not valid Unicode") from None
    if size > MAX_KEY_BYTES:
        raise UniqueError(f"{what}={text[:40]!r}…: {size} bytes, at most {MAX_KEY_BYTES}")
    return text


def _choice(header: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise UniqueError(f"{header}={value!r}: must be one of {', '.join(choices)}")
    return str(value)


def uniqueness(payload: Mapping[str, Any]) -> Uniqueness:
    """What ``payload`` (a kombu message) asks for; :class:`UniqueError` when a header is
    not usable (the message is then not published)."""
    headers = payload.get("headers")
    if not isinstance(headers, Mapping):
        return NOT_UNIQUE
    refused = headers.get(DEFAULT_REFUSED)
    if refused is not None:
        raise UniqueError(str(refused))
    key = headers.get(UNIQUE_KEY)
    mode = headers.get(UNIQUE_WHILE)
    conflict = headers.get(UNIQUE_CONFLICT)
    if key is None and mode is None and conflict is None:
        return NOT_UNIQUE
    # Each checked even without a key: a bad value is refused wherever it is given.
    mode = _choice(UNIQUE_WHILE, "queued" if mode is None else mode, WHILE)
    conflict = _choice(UNIQUE_CONFLICT, "return" if conflict is None else conflict, CONFLICT)
    if key is None:
        return NOT_UNIQUE
    return Uniqueness(
        key=_key_text(key, UNIQUE_KEY),
        while_running=mode == "queued_or_running",
        conflict=conflict,
    )


def task_id_of(payload: Mapping[str, Any]) -> str | None:
    """The Celery task id a message carries (protocol 2 headers, else protocol 1's
    correlation id)."""
    headers = payload.get("headers")
    task_id = headers.get("id") if isinstance(headers, Mapping) else None
    if task_id is None:
        properties = payload.get("properties")
        if isinstance(properties, Mapping):
            task_id = properties.get("correlation_id")
    return None if task_id is None else str(task_id)


def move_options(message: dict[str, Any]) -> None:
    """Move apply_async's unique options (message properties) into the headers, where a
    retry of the task keeps them. A header already there wins."""
    options.move_options(message, OPTIONS)


def canonical(args: Any, kwargs: Any) -> str:
    """The arguments of a call as one text: JSON with sorted keys and no spaces, so equal
    arguments give equal keys whatever the order the keywords were given in."""
    return json.dumps(
        [list(args), dict(kwargs)], sort_keys=True, separators=(",", ":"), default=repr
    )


def _default_key(task: Any, spec: Any, args: Any, kwargs: Any) -> str | None:
    """The unique key a task's ``unique_key`` attribute gives for one call, prefixed by
    the task's name (two tasks never share a default key)."""
    args = list(args) if isinstance(args, (list, tuple)) else []
    kwargs = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    if spec is True:
        return f"{task.name}:{canonical(args, kwargs)}"
    if not callable(spec) and not isinstance(spec, str):
        raise UniqueError(
            f"task {task.name}: unique_key={spec!r} must name an argument, be callable or True"
        )
    value = options.key_of(task, "unique_key", spec, args, kwargs, UniqueError)
    if value is None:
        return None
    return _key_text(f"{task.name}:{_key_text(value, 'unique_key')}", "unique_key")


def task_defaults(
    task: Any, body: Any, headers: dict[str, Any], properties: Mapping[str, Any] | None = None
) -> None:
    """A task's ``unique_key``, ``unique_while`` and ``unique_conflict`` attributes as
    ``headers``, unless the call gave them (as headers, or as options still among the
    message's ``properties``). A key this call cannot give makes the publish refuse the
    message (:data:`DEFAULT_REFUSED`)."""
    given = dict(properties or {})

    def unset(option: str) -> bool:
        return OPTIONS[option] not in headers and given.get(option) is None

    spec: Any = inspect.getattr_static(task, "unique_key", None)
    if isinstance(spec, (staticmethod, classmethod)):
        spec = spec.__func__
    if spec is not None and spec is not False and unset("unique_key"):
        args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) and body else ((), {})
        try:
            key = _default_key(task, spec, args, kwargs)
            if key is not None:
                headers[UNIQUE_KEY] = key
        except Exception as exc:  # Celery would log it and publish the message anyway
            headers[DEFAULT_REFUSED] = (
                str(exc)
                if isinstance(exc, UniqueError)
                else f"task {task.name}: unique_key raised {exc!r}"
            )
    for option in ("unique_while", "unique_conflict"):
        value = getattr(task, option, None)
        if isinstance(value, str) and unset(option):
            headers[OPTIONS[option]] = value


CHORD_REFUSAL = (
    "a chord's parts may not be unique: a duplicate is never run, so a header whose part "
    "is a duplicate never completes (the chord counts its own parts), and a body that is "
    "a duplicate would answer for the chord with another task's result; send the chord "
    "without unique_key (a task's unique_key default included), or make the task that "
    "sends the chord unique instead"
)


def chord_of(body: Any) -> Any:
    """The chord (its body) a task message's decoded ``body`` is a header part of, as
    Celery embeds it; ``None`` for a task outside a chord's header."""
    if isinstance(body, (list, tuple)) and len(body) > 2 and isinstance(body[2], Mapping):
        return body[2].get("chord") or None  # protocol 2: the embed
    if isinstance(body, Mapping):
        return body.get("chord") or None  # protocol 1
    return None


def refuse_in_chord(
    body: Any, headers: dict[str, Any], properties: Mapping[str, Any] | None
) -> None:
    """A part of a chord's header that asks for a unique key (a header, an option, or
    the task's default) is refused when published (:data:`DEFAULT_REFUSED`)."""
    if not chord_of(body):
        return
    key = headers.get(UNIQUE_KEY)
    if key is None:
        key = (properties or {}).get("unique_key")
    if key is None or DEFAULT_REFUSED in headers:
        return
    headers[DEFAULT_REFUSED] = (
        f"unique_key={str(key)[:40]!r}: task {headers.get('task')} is a part of chord "
        f"{headers.get('group')}; {CHORD_REFUSAL}"
    )


def refuse_on_chord_body(body: Any, task: Any) -> None:
    """:class:`UniqueError` when a chord's body (``body``, a signature; ``task``, its
    task if this app knows it) asks for a unique key: raised before anything of the
    chord is sent."""
    options = getattr(body, "options", None)
    key = options.get("unique_key") if isinstance(options, Mapping) else None
    spec: Any = None if task is None else inspect.getattr_static(task, "unique_key", None)
    if key is None and (spec is None or spec is False):
        return
    name = getattr(body, "task", None) or "?"
    shown = (
        f"unique_key={str(key)[:40]!r}"
        if key is not None
        else f"unique_key (task {name}'s default)"
    )
    raise UniqueError(f"{shown}: task {name} is the body of a chord; {CHORD_REFUSAL}")
