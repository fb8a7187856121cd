"""The ``pgq`` command.

Every command takes ``--url`` (default ``$PGQ_URL``; without one, libpq's defaults
and ``PG*`` environment) and ``--schema`` (default ``$PGQ_SCHEMA``, else ``pgq``).
Errors pgq raises on purpose, and driver errors, end here as one line on stderr
and exit code 1: a command-line user never sees a traceback for a bad URL, a
server that does not answer, or a schema that is not there.

Values read from rows (queue and task names, ids, reasons, barrier fields) were written
by others: human-readable output shows each through
:func:`pg_transport.terminal.printable`, so none can send control sequences to the
operator's terminal; ``--json`` output is escaped by the JSON encoder.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timezone
from typing import Any, TypeVar

import click
import psycopg

from pg_transport import status as status_report
from pg_transport.config import Options
from pg_transport.connection import Connector, describe, url_to_conninfo
from pg_transport.dead import DeadLetter, DeadLetters, NotFound, import_app, parse_duration
from pg_transport.errors import PgqError, SchemaError
from pg_transport.schema import current_version, latest_version
from pg_transport.schema import migrate as migrate_schema
from pg_transport.secrets import mask_url
from pg_transport.store import Store
from pg_transport.terminal import printable, quoted

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
            return printable(f"Postgres error: {primary}")
    # A server's message may quote row data; ours may hold a name from a row.
    return printable(describe(exc))


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


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
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


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    for size, unit, sub_size, sub_unit in (
        (86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")
    ):
        if whole >= size:
            return f"{whole // size}{unit} {whole % size // sub_size}{sub_unit}"
    return f"{seconds:.1f}s"


def _identity(identity: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in identity.items()) or "-"


def _hooks(row: DeadLetter) -> str:
    if not row.hooks:
        return "-"
    return f"{row.hooks_ok} ok, {row.hooks_failed} failed"


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
    click.echo(f"{_plural(count, 'waiting message')} purged from queue {quoted(queue)}")


@main.command()
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def status(url: str | None, schema: str, as_json: bool) -> None:
    """Show every queue's ready, in-flight, delayed and dead messages, and the clients.

    In flight means claimed by a consumer whose lease runs; delayed means waiting for
    its ETA. Clients are pgq
    processes connected to this database (workers and publishers of every pgq schema
    in it: Postgres does not know which schema a session uses).
    """
    with _store(url, schema) as store:
        report = status_report.collect(store)
        where = f"pgq schema {store.schema!r} at {store.connector.display_url}"
    if as_json:
        click.echo(_json(report.as_json()))
        return
    click.echo(where)
    if report.queues:
        click.echo(_table(
            ["QUEUE", "READY", "IN FLIGHT", "DELAYED", "DEAD", "OLDEST READY"],
            [
                [q.queue, str(q.ready), str(q.in_flight), str(q.delayed), str(q.dead),
                 _age(q.oldest_ready_age_s)]
                for q in report.queues
            ],
            right={1, 2, 3, 4, 5, 6},
        ))
    else:
        click.echo("no queues")
    clients = report.clients
    click.echo(
        f"clients: {_plural(clients.processes, 'process', 'processes')}, "
        f"{_plural(clients.sessions, 'session')}"
    )
    if report.barriers:
        click.echo("barriers: " + ", ".join(
            f"{b.count} {printable(b.status)}" for b in report.barriers))


@main.group(cls=_Group)
def barrier() -> None:
    """Inspect fan-in barriers."""


@barrier.command("show")
@url_option
@schema_option
@click.argument("barrier_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def barrier_show(url: str | None, schema: str, barrier_id: str, as_json: bool) -> None:
    """Show one barrier: status, parts done, callback, timestamps."""
    from barrier.inspect import show  # the barrier package builds on this one

    with _store(url, schema) as store:
        found = show(store.connector, store.schema, barrier_id)
    if found is None:
        raise click.ClickException(
            f"no barrier {quoted(barrier_id)} in pgq schema {quoted(schema)}")
    if as_json:
        click.echo(_json(found))
        return
    parts = found.pop("parts", [])
    for key, value in found.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        click.echo(f"{key + ':':<16}{'-' if value is None else printable(value)}")
    if parts:
        click.echo(_table(
            ["PART", "OUTCOME", "TASK ID", "FINISHED"],
            [[str(p["index"]), str(p["outcome"]), str(p.get("task_id") or "-"),
              str(p["finished_at"])] for p in parts],
            right={0},
        ))


@main.group(cls=_Group)
def dead() -> None:
    """Dead-lettered messages: list, requeue, purge, and re-run their hooks."""


@dead.command("list")
@url_option
@schema_option
@click.option("--queue", metavar="QUEUE", help="Only rows of this queue.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=100, show_default=True,
    help="Show at most this many rows, newest first.",
)
def dead_list(url: str | None, schema: str, queue: str | None, as_json: bool, limit: int) -> None:
    """List dead-letter rows, newest first."""
    with _store(url, schema) as store:
        rows, total = DeadLetters(store).rows(queue=queue, limit=limit)
    if as_json:
        click.echo(_json({"total": total, "dead_letters": [r.as_json() for r in rows]}))
        return
    if not rows:
        click.echo("no dead-letter rows" + (f" in queue {quoted(queue)}" if queue else ""))
        return
    click.echo(_table(
        ["ID", "QUEUE", "TASK", "TASK ID", "IDENTITY", "READS", "DEAD AT", "HOOKS", "REASON"],
        [
            [str(r.id), r.queue, r.task_name or "-", r.task_id or "-", _identity(r.identity),
             str(r.read_ct), r.dead_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
             _hooks(r), r.reason]
            for r in rows
        ],
        right={0, 5},
    ))
    if total > len(rows):
        click.echo(f"({len(rows)} of {total} shown; raise --limit to see more)")


@dead.command("requeue")
@url_option
@schema_option
@click.argument("ids", nargs=-1, type=int, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Requeue every dead-letter row.")
@click.option("--queue", metavar="QUEUE", help="With --all: only rows of this queue.")
def dead_requeue(
    url: str | None, schema: str, ids: tuple[int, ...], all_: bool, queue: str | None
) -> None:
    """Move dead-letter rows back into their queues, to be delivered afresh.

    Each row becomes a message again with its priority and payload, visible now and
    with its delivery count reset; idle workers are woken.
    """
    if bool(ids) == all_:
        raise click.UsageError("give dead-letter IDs or --all, not both and not neither")
    if queue is not None and not all_:
        raise click.UsageError("--queue goes with --all")
    with _store(url, schema) as store:
        moved = DeadLetters(store).requeue(ids, every=all_, queue=queue)
    count = sum(len(v) for v in moved.values())
    missing = sorted(set(ids) - {i for v in moved.values() for i in v})
    if count or not missing:
        detail = ", ".join(f"{len(v)} to queue {quoted(q)}" for q, v in moved.items())
        click.echo(
            f"{_plural(count, 'dead-letter row')} requeued" + (f": {detail}" if detail else "")
        )
    if missing:
        rows = "row" if len(missing) == 1 else "rows"
        raise NotFound(
            f"no dead-letter {rows} {', '.join(map(str, missing))} in schema {store.schema!r}"
        )


@dead.command("purge")
@url_option
@schema_option
@click.option(
    "--older-than", metavar="DURATION",
    help="Only rows dead for longer than this: 90s, 30m, 12h, 7d. Default: every row.",
)
@click.option("--queue", metavar="QUEUE", help="Only rows of this queue.")
@click.option("-y", "--yes", is_flag=True, help="Purge every row without asking.")
def dead_purge(
    url: str | None, schema: str, older_than: str | None, queue: str | None, yes: bool
) -> None:
    """Delete dead-letter rows for good, and print how many."""
    # Checked before connecting: a typo must not wait for (or depend on) the server.
    seconds = parse_duration(older_than) if older_than is not None else None
    with _store(url, schema) as store:
        if seconds is None and not yes:
            click.confirm(
                "Delete every dead-letter row"
                + (f" of queue {quoted(queue)}" if queue else "")
                + f" in pgq schema {store.schema!r} at {store.connector.display_url}?",
                abort=True,
            )
        count = DeadLetters(store).purge(older_than=seconds, queue=queue)
    click.echo(
        f"{_plural(count, 'dead-letter row')} purged"
        + (f" from queue {quoted(queue)}" if queue else "")
        + (f" (dead for longer than {older_than})" if older_than else "")
    )


@dead.command("rehook")
@url_option
@schema_option
@click.argument("dead_letter_id", type=int, metavar="ID")
@click.option(
    "-A", "--app", metavar="MODULE",
    help="Module that connects your message_poisoned handlers (as for celery -A).",
)
def dead_rehook(url: str | None, schema: str, dead_letter_id: int, app: str | None) -> None:
    """Send message_poisoned again for dead-letter row ID and record each handler's outcome.

    Exits 1 when a handler fails; its error is recorded on the row.
    """
    if app:
        import_app(app)
    with _store(url, schema) as store:
        result = DeadLetters(store).rehook(dead_letter_id)
    click.echo(
        f"dead-letter row {result.dead_letter_id} of queue {quoted(result.queue)}: task "
        + printable(f"{result.task_name or '-'} {result.task_id or '-'}, identity "
                    f"{_identity(result.identity)}")
    )
    for outcome in result.outcomes:
        if outcome["ok"]:
            click.echo(f"  ok      {printable(outcome['receiver'])}")
        else:
            click.echo(f"  FAILED  {printable(outcome['receiver'])}: "
                       f"{printable(outcome['error'])}")
    if not result.recorded:
        raise click.ClickException(
            f"dead-letter row {dead_letter_id} was requeued or purged while the hooks ran: "
            "outcomes not recorded"
        )
    if result.failed:
        raise click.ClickException(
            f"{len(result.failed)} of {_plural(len(result.outcomes), 'handler')} failed; "
            f"outcomes recorded on dead-letter row {dead_letter_id}"
        )


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


@main.command()
@url_option
@schema_option
@click.option(
    "--serve", "port", type=click.IntRange(0, 65535), metavar="PORT",
    help="Serve the metrics over HTTP on this port (0: any free port) instead of printing "
    "them once; every scrape of /metrics computes fresh figures.",
)
@click.option(
    "--host", metavar="ADDRESS",
    help="With --serve: address to listen on.  [default: 127.0.0.1]",
)
def metrics(url: str | None, schema: str, port: int | None, host: str | None) -> None:
    """Print the figures of `pgq status` in Prometheus text format, or serve them.

    Per queue (label `queue`): ready, in-flight, delayed and dead messages and the age
    of the oldest ready message; and the connected pgq clients.
    """
    # Imported here, as demo: the other commands do not need them.
    import time

    from pg_transport import metrics as exposition

    if port is None:
        if host is not None:
            raise click.UsageError("--host goes with --serve")
        with _store(url, schema) as store:
            started = time.perf_counter()
            report = status_report.collect(store)
            elapsed = time.perf_counter() - started
        click.echo(exposition.render(report, elapsed), nl=False)
        return
    with _store(url, schema) as store:
        # Checked once, up front: a missing or outdated schema is a start-up error,
        # not a stream of failed scrapes.
        checked = store.schema
    # A connector of its own, named so `pgq status` does not count the exporter
    # among the workers and publishers (application_name 'pgq:<pid>').
    connector = Connector(
        url_to_conninfo(url), display_url=mask_url(url or "pgq://"),
        application_name="pgq-metrics",
    )
    store = Store(connector, checked)
    try:
        server = exposition.make_server(
            host or "127.0.0.1", port, lambda: status_report.collect(store),
            describe_error=_one_line, errors=(PgqError, psycopg.Error),
        )
    except OSError as exc:
        connector.close()
        raise click.ClickException(
            f"cannot listen on {host or '127.0.0.1'}:{port}: {exc.strerror or exc}"
        ) from exc
    click.echo(
        f"serving metrics of pgq schema {checked!r} at {connector.display_url} on "
        f"http://{host or '127.0.0.1'}:{server.port}/metrics"
    )
    try:
        exposition.serve(server)
    finally:
        connector.close()


@main.command()
@click.option(
    "--file", "path", envvar="PGQ_HEALTH_FILE", show_envvar=True, metavar="PATH",
    type=click.Path(dir_okay=False), default=None,
    help="Heartbeat file the worker touches every consume-loop cycle.  "
    "[default: pgq-<uid>/worker.heartbeat in the temporary directory, a directory "
    "only this user may enter]",
)
@click.option(
    "--stale-after", envvar="PGQ_HEALTH_STALE_SECONDS", show_envvar=True, metavar="SECONDS",
    type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
    help="Fail when the worker's last consume-loop cycle is older than this.",
)
def health(path: str | None, stale_after: float) -> None:
    """Exit 0 while a worker keeps consuming, 1 once it has stopped: a container healthcheck.

    The worker must run pg_transport.health's heartbeat step (pg_transport.health.install(app)).
    Fails when the worker is gone, stopped or stuck, not only when its process is.
    """
    from pathlib import Path

    from pg_transport import health as worker_health

    result = worker_health.check(Path(path) if path else worker_health.default_file(),
                                 stale_after)
    # The message names the host read from the heartbeat file, which others may write.
    if not result.healthy:
        raise click.ClickException(printable(result.message))
    click.echo(f"healthy: {printable(result.message)}")


if __name__ == "__main__":
    main()
