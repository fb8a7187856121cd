"""Fair share: which key a message is served under in a fair queue (docs/flow-control.md).

A queue in fair mode (transport option ``queue_fair_share``) is claimed round-robin over
its messages' keys. A message names its key in the header ``pgq-fair-key``; a message
without one is served under the key ``''``. In a queue that is not fair the header means
nothing. Celery's ``apply_async(fair_key=…)`` and a task's ``fair_key`` attribute (an
argument's name or a callable of the call's arguments) become that header
(:func:`move_options`, :func:`task_defaults`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from pg_transport.errors import ConfigurationError
from pg_transport.message import options

__all__ = ["FAIR_KEY", "FairKeyError", "fair_key", "move_options", "task_defaults"]

FAIR_KEY = "pgq-fair-key"

# apply_async's option -> the header it becomes.
OPTIONS = {"fair_key": FAIR_KEY}

# Set by task_defaults when a task's default key cannot be had for a call: why.
DEFAULT_REFUSED = "pgq-fair-refused"

#: Keys are index keys: well under Postgres' limit for one.
MAX_KEY_BYTES = 1024


class FairKeyError(ConfigurationError):
    """A message's fair key is not usable (the header and the value named); it was not
    published."""


def _text(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise FairKeyError(f"{what}={value!r}: must be a string (or an integer)")
    text = str(value)
    if "\x00" in text:
        raise FairKeyError(f"{what}={text[:40]!r}: must be text without NUL")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise FairKeyError(f"{what}={text[:40]!r}: not valid Unicode") from None
    if size > MAX_KEY_BYTES:
        raise FairKeyError(f"{what}={text[:40]!r}…: {size} bytes, at most {MAX_KEY_BYTES}")
    return text


def fair_key(payload: Mapping[str, Any]) -> str | None:
    """The fair key ``payload`` (a kombu message) names, if any."""
    headers = payload.get("headers")
    if not isinstance(headers, Mapping):
        return None
    refused = headers.get(DEFAULT_REFUSED)
    if refused is not None:
        raise FairKeyError(str(refused))
    key = headers.get(FAIR_KEY)
    return None if key is None else _text(key, f"header {FAIR_KEY}")


def move_options(message: dict[str, Any]) -> None:
    """Move apply_async's ``fair_key`` (a message property) into the headers. A header
    already there wins."""
    options.move_options(message, OPTIONS)


def task_defaults(
    task: Any, body: Any, headers: dict[str, Any], properties: Mapping[str, Any] | None = None
) -> None:
    """A task's ``fair_key`` attribute as the header, unless the call gave one."""
    spec: Any = inspect.getattr_static(task, "fair_key", None)
    if isinstance(spec, (staticmethod, classmethod)):
        spec = spec.__func__
    if spec is None or FAIR_KEY in headers or (properties or {}).get("fair_key") is not None:
        return
    args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) and body else ((), {})
    try:
        value = options.key_of(task, "fair_key", spec, args, kwargs, FairKeyError)
        if value is not None:
            headers[FAIR_KEY] = _text(value, "fair_key")
    except Exception as exc:  # Celery would log it and publish the message anyway
        headers[DEFAULT_REFUSED] = (
            str(exc)
            if isinstance(exc, FairKeyError)
            else f"task {task.name}: fair_key raised {exc!r}"
        )
