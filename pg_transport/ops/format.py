"""How operator output writes values: ages, counts, tables, identities, errors.

Shared by the ``pgq`` command and the web console, so a value reads the same in both.
Values read from rows were written by others: tables and error lines show each through
:func:`~pg_transport.ops.terminal.printable`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import psycopg

from pg_transport.db.pool import describe
from pg_transport.ops.terminal import printable

__all__ = ["age", "identity_text", "json_text", "one_line", "plural", "table"]


def one_line(exc: BaseException) -> str:
    if isinstance(exc, psycopg.Error) and not isinstance(exc, psycopg.OperationalError):
        # Server errors carry a LINE/caret excerpt of the query; the primary message is the news.
        primary = exc.diag.message_primary
        if primary:
            return printable(f"Postgres error: {primary}")
    # A server's message may quote row data; ours may hold a name from a row.
    return printable(describe(exc))


def plural(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    """Plain columns, two spaces apart; the columns in ``right`` are right-aligned.

    Every cell is escaped (it may come from a row), before the widths are measured.
    """
    headers = [printable(h) for h in headers]
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def json_text(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    for size, unit, sub_size, sub_unit in (
        (86400, "d", 3600, "h"),
        (3600, "h", 60, "m"),
        (60, "m", 1, "s"),
    ):
        if whole >= size:
            return f"{whole // size}{unit} {whole % size // sub_size}{sub_unit}"
    return f"{seconds:.1f}s"


def identity_text(identity: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in identity.items()) or "-"
