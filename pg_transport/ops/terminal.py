"""Text written by others, made safe to print on an operator's terminal.

Queue names, task names, ids, identities, reasons and barrier fields come from rows any
publisher (or any holder of the worker role) could have written. Printed raw, an escape
sequence in one of them can recolour, move the cursor, rewrite earlier lines (``\\r``,
backspace), set the terminal's title or clipboard (OSC), or reorder what a reader sees
(bidi overrides such as U+202E). ``pgq``'s human-readable output passes every such value
through :func:`printable`; ``--json`` output is escaped by the JSON encoder instead.
"""

from __future__ import annotations

import unicodedata

__all__ = ["printable", "quoted"]

# Control (C0, DEL, C1), format (bidi controls and marks, zero-width characters),
# surrogate (unpaired: unprintable in UTF-8), and the line and paragraph separators.
_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(char: str) -> str:
    if unicodedata.category(char) not in _ESCAPED:
        return char
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: object) -> str:
    """``value`` as text with every control, format and separator character written as a
    Python-style escape (``\\x1b``, ``\\r``, ``\\u202e``); all else, spaces and non-ASCII
    letters included, as it is.

    The result holds only printable characters, so escaping it again changes nothing: a
    message already escaped where it was made can pass through here safely.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # false for every category escaped (and for some harmless ones)
        return text
    return "".join(_escape(c) for c in text)


def quoted(value: object) -> str:
    """``printable(value)`` between single quotes: a name inside a sentence."""
    return f"'{printable(value)}'"
