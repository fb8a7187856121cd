"""What every ``pgq`` command shares: its options, opening the store, printing tables.

Values read from rows were written by others: tables and sentences show each through
:func:`~pg_transport.ops.terminal.printable`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import psycopg

from pg_transport.config import Options
from pg_transport.db.migrate import current_version, latest_version
from pg_transport.db.pool import Connector, describe, url_to_conninfo
from pg_transport.db.url import mask_url
from pg_transport.errors import PgqError, SchemaError
from pg_transport.ops.dead import DeadLetter
from pg_transport.ops.terminal import printable
from pg_transport.store import Store

__all__ = [
    "URL_HELP",
    "Group",
    "age",
    "checked_schema",
    "hooks",
    "identity_text",
    "json_text",
    "one_line",
    "open_connector",
    "open_store",
    "plural",
    "schema_option",
    "table",
    "url_option",
]

F = TypeVar("F", bound=Callable[..., Any])

URL_HELP = (
    "Postgres to use: pgq://[user[:password]@]host[:port]/dbname[?libpq params]. "
    "Without one, libpq's defaults and PG* environment apply."
)


def one_line(exc: BaseException) -> str:
    if isinstance(exc, psycopg.Error) and not isinstance(exc, psycopg.OperationalError):
        # Server errors carry a LINE/caret excerpt of the query; the primary message is the news.
        primary = exc.diag.message_primary
        if primary:
            return printable(f"Postgres error: {primary}")
    # A server's message may quote row data; ours may hold a name from a row.
    return printable(describe(exc))


class Group(click.Group):
    """Turns pgq and driver errors into click's one-line ``Error: …`` and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (PgqError, psycopg.Error) as exc:
            raise click.ClickException(one_line(exc)) from exc


def url_option(func: F) -> F:
    return click.option("--url", envvar="PGQ_URL", show_envvar=True, metavar="URL", help=URL_HELP)(
        func
    )


def schema_option(func: F) -> F:
    return click.option(
        "--schema",
        envvar="PGQ_SCHEMA",
        default="pgq",
        show_default=True,
        show_envvar=True,
        help="Schema holding pgq's tables.",
    )(func)


def checked_schema(schema: str) -> str:
    # The same rule the transport applies to its `schema` option.
    return Options.from_sources({"schema": schema}, {}).schema


@contextmanager
def open_connector(url: str | None) -> Iterator[Connector]:
    connector = Connector(url_to_conninfo(url), display_url=mask_url(url or "pgq://"))
    try:
        yield connector
    finally:
        connector.close()


@contextmanager
def open_store(url: str | None, schema: str) -> Iterator[Store]:
    """A store on an existing, current schema; never creates or upgrades one."""
    schema = checked_schema(schema)
    with open_connector(url) as connector:
        with connector.connection() as conn:
            version = current_version(conn, schema)
        where = f"pgq schema {schema!r} at {connector.display_url}"
        if version is None:
            raise SchemaError(f"{where} does not exist: run `pgq migrate` first")
        if version < latest_version():
            raise SchemaError(
                f"{where} is at version {version}, this pgq needs {latest_version()}: "
                "run `pgq migrate`"
            )
        yield Store(connector, schema)


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


def hooks(row: DeadLetter) -> str:
    if not row.hooks:
        return "-"
    return f"{row.hooks_ok} ok, {row.hooks_failed} failed"
