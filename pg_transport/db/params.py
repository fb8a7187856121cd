"""Statement parameters as Postgres text, without psycopg's per-value adapter lookup.

A claim carries ten parameters, five of them arrays (queues, their visibility timeouts
and attempt limits, the ids and read counts of the acks riding on it). psycopg picks a
dumper per value, and for a list it looks at the elements to pick one; under Celery's
event loop that took about 7% of the worker's main process (docs/performance.md). pgq's
named statements are prepared without parameter types: the server takes each type from
the query (``%(ids)s::bigint[]``) and every value is sent as text. So the text of the
plain values pgq sends (None, bool, int, finite float, str, and flat lists of one of
those) is written here directly; anything else goes to psycopg's dumper, which also
raises its usual error for what cannot be sent (a NUL character in a string).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from math import isfinite
from typing import Any

__all__ = ["Dump", "Text", "render"]

#: A parameter's text (None: NULL), as libpq takes it.
Text = bytes | bytearray | memoryview | None
#: psycopg's text dumper for one value (the fallback).
Dump = Callable[[Any], Text]


class _Left(Enum):
    """Marks a value left to the fallback."""

    OTHER = 0


_OTHER = _Left.OTHER


def render(values: Sequence[Any], fallback: Dump) -> list[Text]:
    """Each value as text for a parameter whose type the statement fixes (client
    encoding UTF-8); ``fallback`` renders what this module does not."""
    out: list[Text] = []
    for value in values:
        text = _scalar(value) if type(value) is not list else _array(value)
        out.append(fallback(value) if text is _OTHER else text)
    return out


def _scalar(value: Any) -> bytes | _Left | None:
    kind = type(value)
    if value is None:
        return None
    if kind is str:
        return value.encode() if "\x00" not in value else _OTHER
    if kind is int:
        return str(value).encode()
    if kind is bool:
        return b"t" if value else b"f"
    if kind is float:
        return repr(value).encode() if isfinite(value) else _OTHER
    return _OTHER


def _array(values: list[Any]) -> bytes | _Left:
    """A flat list of one of int, finite float or str as an array literal."""
    if not values:
        return b"{}"
    kind = type(values[0])
    if any(type(v) is not kind for v in values):
        return _OTHER
    if kind is int:
        return ("{" + ",".join(map(str, values)) + "}").encode()
    if kind is float:
        if not all(map(isfinite, values)):
            return _OTHER
        return ("{" + ",".join(map(repr, values)) + "}").encode()
    if kind is str:
        if any("\x00" in v for v in values):
            return _OTHER
        return ("{" + ",".join(map(_quoted, values)) + "}").encode()
    return _OTHER


def _quoted(element: str) -> str:
    """An array element in double quotes (always: "NULL", "" and spaces stay strings)."""
    if "\\" in element or '"' in element:
        element = element.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + element + '"'
