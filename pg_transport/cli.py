"""The ``pgq`` command.

Every command takes ``--url`` (default ``$PGQ_URL``; without one, libpq's defaults
and ``PG*`` environment) and ``--schema`` (default ``$PGQ_SCHEMA``, else ``pgq``).
Errors pgq raises on purpose, and driver errors, end here as one line on stderr
and exit code 1: a command-line user never sees a traceback for a bad URL, a
server that does not answer, or a schema that is not there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import psycopg

from pg_transport.config import Options
from pg_transport.connection import Connector, describe, mask_url, url_to_conninfo
from pg_transport.errors import PgqError, SchemaError
from pg_transport.schema import current_version, latest_version
from pg_transport.schema import migrate as migrate_schema
from pg_transport.store import Store

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])

URL_HELP = (
    "Postgres to use: pgq://[user[:password]@]host[:port]/dbname[?libpq params]. "
    "Without one, libpq's defaults and PG* environment apply."
)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, psycopg.Error) and not isinstance(exc, psycopg.OperationalError):
        # Server errors carry a LINE/caret excerpt of the query; the primary message is the news.
        primary = exc.diag.message_primary
        if primary:
            return f"Postgres error: {primary}"
    return describe(exc)


class _Group(click.Group):
    """Turns pgq and driver errors into click's one-line ``Error: …`` and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (PgqError, psycopg.Error) as exc:
            raise click.ClickException(_one_line(exc)) from exc


def url_option(func: F) -> F:
    return click.option(
        "--url", envvar="PGQ_URL", show_envvar=True, metavar="URL", help=URL_HELP
    )(func)


def schema_option(func: F) -> F:
    return click.option(
        "--schema", envvar="PGQ_SCHEMA", default="pgq", show_default=True, show_envvar=True,
        help="Schema holding pgq's tables.",
    )(func)


def _checked_schema(schema: str) -> str:
    # The same rule the transport applies to its `schema` option.
    return Options.from_sources({"schema": schema}, {}).schema


@contextmanager
def _connector(url: str | None) -> Iterator[Connector]:
    connector = Connector(url_to_conninfo(url), display_url=mask_url(url or "pgq://"))
    try:
        yield connector
    finally:
        connector.close()


@contextmanager
def _store(url: str | None, schema: str) -> Iterator[Store]:
    """A store on an existing, current schema; never creates or upgrades one."""
    schema = _checked_schema(schema)
    with _connector(url) as connector:
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


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pgq", prog_name="pgq")
def main() -> None:
    """pgq: PostgreSQL as a Celery broker."""


@main.command()
@url_option
@schema_option
def migrate(url: str | None, schema: str) -> None:
    """Create the pgq schema, or upgrade it to this pgq's version.

    Safe to run from many processes at once, and to run again: it applies only
    what is missing.
    """
    schema = _checked_schema(schema)
    with _connector(url) as connector, connector.connection() as conn:
        applied = migrate_schema(conn, schema)
        version = current_version(conn, schema) or 0
        where = f"pgq schema {schema!r} at {connector.display_url}"
    if applied:
        click.echo(
            f"{where}: applied {_plural(len(applied), 'migration')} "
            f"({', '.join(applied)}); now at version {version}"
        )
    elif version > latest_version():
        click.echo(
            f"{where} is at version {version}, newer than this pgq ({latest_version()}): "
            "nothing to apply"
        )
    else:
        click.echo(f"{where} is up to date (version {version})")


@main.command()
@url_option
@schema_option
@click.argument("queue")
def purge(url: str | None, schema: str, queue: str) -> None:
    """Delete the waiting messages of QUEUE and print how many.

    Waiting means ready or delayed; messages a worker holds right now are left to it.
    """
    with _store(url, schema) as store:
        count = store.purge(queue)
    click.echo(f"{_plural(count, 'waiting message')} purged from queue {queue!r}")


@main.command()
@url_option
@click.option(
    "--schema", metavar="NAME",
    help="Schema to run the demo in; it must not exist yet and is dropped at the end. "
    "Default: a throwaway name ($PGQ_SCHEMA is ignored here, so the demo never touches "
    "your real schema).",
)
def demo(url: str | None, schema: str | None) -> None:
    """Run Celery tasks through Postgres with a real worker, and show what happened.

    Without --url (or $PGQ_URL) it starts an embedded Postgres and deletes it after.
    """
    # Imported here: it loads Celery, which the other commands do not need.
    from pg_transport.demo import run

    run(url, _checked_schema(schema) if schema else None)


if __name__ == "__main__":
    main()
