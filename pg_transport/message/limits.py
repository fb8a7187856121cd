"""Flow limits (docs/flow-control.md): what a limit is, how it is written, what a message
asks for in its headers.

A limit is a row the claim reads at every claim (``flow_limit``): a rate, ``count`` per
``period`` seconds with a ``burst``, and/or a ``concurrency``. It is named
``task:<task name>``, ``queue:<queue name>`` or by the user (a limiter several tasks
share). A message asks for a limiter's bucket or slot of a key in its headers, which a
retry of the task keeps:

* ``pgq-rate-limiter`` / ``pgq-rate-key``: a token of the bucket ``(limiter, key)``
  (limiter default ``task:<task>``) before it may start;
* ``pgq-concurrency-limiter`` / ``pgq-concurrency-key``: a slot of ``(limiter, key)``,
  at most the limiter's concurrency in flight across the fleet.

A task's own defaults (task attributes ``pgq_rate_key``, ``pgq_rate_limiter``,
``concurrency_key``, ``concurrency_limiter``: a keyword argument's name or a callable of
the call's arguments for the keys) become those headers when it is sent
(:func:`task_defaults`), and its limits (``pgq_rate_limit``, ``pgq_rate_burst``,
``concurrency_limit``) are written at worker start (:func:`task_limits`).

Everything here refuses a bad value with :class:`pg_transport.LimitError` naming the
option and the value.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pg_transport.errors import LimitError
from pg_transport.message import options

__all__ = [
    "CONCURRENCY_KEY",
    "CONCURRENCY_LIMITER",
    "RATE_KEY",
    "RATE_LIMITER",
    "Limit",
    "Rate",
    "check_headers",
    "limit_name",
    "move_options",
    "parse_burst",
    "parse_concurrency",
    "parse_rate",
    "task_defaults",
    "task_limits",
]

RATE_LIMITER = "pgq-rate-limiter"
RATE_KEY = "pgq-rate-key"
CONCURRENCY_LIMITER = "pgq-concurrency-limiter"
CONCURRENCY_KEY = "pgq-concurrency-key"

#: A key longer than this is refused at the publish (the claim digests longer ones).
MAX_KEY_BYTES = 512
#: A limiter's name, as the table's CHECK has it.
MAX_NAME_BYTES = 200

_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:/\s*([smh]))?\s*")


@dataclass(frozen=True)
class Rate:
    """``count`` starts per ``period`` seconds."""

    count: int
    period: float

    def __str__(self) -> str:
        for unit, seconds in _PERIODS.items():
            if self.period == seconds:
                return f"{self.count}/{unit}"
        return f"{self.count}/{self.period:g}s"


@dataclass(frozen=True)
class Limit:
    """A limit's definition, as ``flow_limit`` keeps it."""

    name: str
    rate: Rate | None = None
    burst: int = 1
    concurrency: int | None = None


def parse_rate(option: str, value: Any) -> Rate:
    """Celery's ``rate_limit`` syntax: ``"10/s"``, ``"600/m"``, ``"3600/h"``, or a bare
    number (per second). A count that is not whole becomes one per a longer period
    (``"0.5/s"`` is one every two seconds)."""
    if isinstance(value, bool):
        raise LimitError(f"{option}={value!r}: a rate is a count per s, m or h, such as '10/s'")
    if isinstance(value, (int, float)):
        count, period = float(value), 1.0
    elif isinstance(value, str):
        match = _RATE.fullmatch(value)
        if match is None:
            raise LimitError(
                f"{option}={value!r}: a rate is a count per s, m or h, such as '10/s', "
                "'600/m' or '3600/h' (a bare number is per second)"
            )
        count, period = float(match.group(1)), _PERIODS[match.group(2) or "s"]
    else:
        raise LimitError(f"{option}={value!r}: a rate is a count per s, m or h, such as '10/s'")
    if not math.isfinite(count) or count <= 0:
        raise LimitError(f"{option}={value!r}: the count must be greater than 0")
    if count == int(count) and count <= 2**31 - 1:
        return Rate(int(count), period)
    return Rate(1, period / count)


def _whole(option: str, value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LimitError(f"{option}={value!r}: {what} must be a whole number of at least 1")
    try:
        number = int(value)
    except ValueError:
        raise LimitError(
            f"{option}={value!r}: {what} must be a whole number of at least 1"
        ) from None
    if number < 1 or number > 2**31 - 1:
        raise LimitError(f"{option}={value!r}: {what} must be a whole number of at least 1")
    return number


def parse_burst(option: str, value: Any) -> int:
    """How many may start at once after an idle spell (at least 1)."""
    return _whole(option, value, "a burst")


def parse_concurrency(option: str, value: Any) -> int:
    """How many may be in flight at once (at least 1)."""
    return _whole(option, value, "a concurrency limit")


def limit_name(option: str, value: Any) -> str:
    """A limiter's name: text of 1 to 200 bytes without NUL."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise LimitError(f"{option}={value!r}: a limiter's name is non-empty text")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise LimitError(f"{option}={value[:40]!r}...: at most {MAX_NAME_BYTES} bytes")
    return value


def _key_text(option: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LimitError(f"{option}={value!r}: a key is a string or an integer")
    text = str(value)
    if not text or "\x00" in text or len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise LimitError(
            f"{option}={text[:40]!r}: a key is 1 to {MAX_KEY_BYTES} bytes of text without NUL"
        )
    return text


def _static(task: Any, name: str) -> Any:
    # Read unbound: Celery keeps a task's options as class attributes, and a function
    # there would come back as a method of the task.
    spec = inspect.getattr_static(task, name, None)
    if isinstance(spec, (staticmethod, classmethod)):
        spec = spec.__func__
    return spec


# task attribute -> header, for the keys and the limiters.
_DEFAULTS: dict[str, str] = {
    "pgq_rate_key": RATE_KEY,
    "concurrency_key": CONCURRENCY_KEY,
}
_LIMITERS: dict[str, str] = {
    "pgq_rate_limiter": RATE_LIMITER,
    "concurrency_limiter": CONCURRENCY_LIMITER,
}


# Set by task_defaults when a task's default key cannot be had for a call: why. Celery
# logs what a before_task_publish receiver raises and publishes anyway (outside its
# limit); the publish refuses the message instead (check_headers).
DEFAULT_REFUSED = "pgq-limit-refused"


def task_defaults(task: Any, body: Any, headers: dict[str, Any]) -> None:
    """A task's limit keys and limiters as ``headers``, unless the call gave them. A key
    this call cannot give makes the publish refuse the message (:data:`DEFAULT_REFUSED`):
    a message that escaped its limit would not be noticed."""
    args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) and body else ((), {})
    try:
        for attribute, header in _DEFAULTS.items():
            spec: Callable[..., Any] | str | None = _static(task, attribute)
            if spec is not None and header not in headers:
                key = options.key_of(task, attribute, spec, args, kwargs, LimitError)
                if key is not None:
                    headers[header] = _key_text(attribute, key)
        for attribute, header in _LIMITERS.items():
            name = _static(task, attribute)
            if name is not None and header not in headers:
                headers[header] = limit_name(attribute, name)
    except Exception as exc:  # Celery would log it and publish the message unlimited
        headers[DEFAULT_REFUSED] = (
            str(exc)
            if isinstance(exc, LimitError)
            else f"task {task.name}: a limit key raised {exc!r}"
        )


def task_limits(task: Any) -> list[Limit]:
    """The limits a task's attributes define (``pgq_rate_limit``, ``pgq_rate_burst``,
    ``concurrency_limit``), under its own name ``task:<name>`` or the limiter it names."""
    rate_spec = _static(task, "pgq_rate_limit")
    concurrency_spec = _static(task, "concurrency_limit")
    found: list[Limit] = []
    if rate_spec is not None:
        rate = parse_rate(f"task {task.name}: pgq_rate_limit", rate_spec)
        burst_spec = _static(task, "pgq_rate_burst")
        burst = (
            1
            if burst_spec is None
            else parse_burst(f"task {task.name}: pgq_rate_burst", burst_spec)
        )
        limiter = _static(task, "pgq_rate_limiter")
        name = f"task:{task.name}" if limiter is None else limit_name("pgq_rate_limiter", limiter)
        found.append(Limit(name, rate=rate, burst=burst))
    if concurrency_spec is not None:
        option = f"task {task.name}: concurrency_limit"
        cap = parse_concurrency(option, concurrency_spec)
        if _static(task, "concurrency_key") is None:
            raise LimitError(
                f"{option}={concurrency_spec!r} needs concurrency_key (the argument whose "
                "value is the key): a limit per key without a key"
            )
        limiter = _static(task, "concurrency_limiter")
        name = (
            f"task:{task.name}" if limiter is None else limit_name("concurrency_limiter", limiter)
        )
        merged = [i for i, f in enumerate(found) if f.name == name]
        if merged:
            found[merged[0]] = Limit(name, found[merged[0]].rate, found[merged[0]].burst, cap)
        else:
            found.append(Limit(name, concurrency=cap))
    return found


# apply_async's options -> the headers they become.
OPTIONS: dict[str, str] = {
    "pgq_rate_key": RATE_KEY,
    "pgq_rate_limiter": RATE_LIMITER,
    "concurrency_key": CONCURRENCY_KEY,
    "concurrency_limiter": CONCURRENCY_LIMITER,
}


def move_options(message: dict[str, Any]) -> None:
    """Move apply_async's limit options (message properties) into the headers, where a
    retry of the task keeps them. A header already there wins."""
    options.move_options(message, OPTIONS)


def check_headers(payload: Mapping[str, Any]) -> None:
    """Refuse, before anything is stored, a limit header the claim could not honour: a
    key that is not 1 to 512 bytes of text (or an integer), a limiter name that is not
    1 to 200 bytes of text."""
    headers = payload.get("headers")
    if not isinstance(headers, Mapping):
        return
    refused = headers.get(DEFAULT_REFUSED)
    if refused is not None:
        raise LimitError(str(refused))
    for header in (RATE_KEY, CONCURRENCY_KEY):
        if header in headers:
            _key_text(f"header {header}", headers[header])
    for header in (RATE_LIMITER, CONCURRENCY_LIMITER):
        if header in headers:
            limit_name(f"header {header}", headers[header])
