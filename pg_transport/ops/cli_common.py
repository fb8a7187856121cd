"""What every ``pgq`` command shares: its options, opening the store, its errors.

How values are written (ages, tables, counts) is in :mod:`pg_transport.ops.format`,
which the web console shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import psycopg

from pg_transport.config import Options
from pg_transport.db.migrate import current_version, latest_version
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.db.url import mask_url
from pg_transport.errors import PgqError, SchemaError
from pg_transport.ops.dead import DeadLetter
from pg_transport.ops.format import one_line
from pg_transport.store import Store

__all__ = [
    "URL_HELP",
    "Group",
    "checked_schema",
    "hooks",
    "open_connector",
    "open_store",
    "schema_option",
    "url_option",
]

F = TypeVar("F", bound=Callable[..., Any])

URL_HELP = (
    "Postgres to use: pgq://[user[:password]@]host[:port]/dbname[?libpq params]. "
    "Without one, libpq's defaults and PG* environment apply."
)


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


def hooks(row: DeadLetter) -> str:
    if not row.hooks:
        return "-"
    return f"{row.hooks_ok} ok, {row.hooks_failed} failed"
