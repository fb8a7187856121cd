"""The ``pgq`` command.

Every command takes ``--url`` (default ``$PGQ_URL``; without one, libpq's defaults
and ``PG*`` environment) and ``--schema`` (default ``$PGQ_SCHEMA``, else ``pgq``).
Errors pgq raises on purpose, and driver errors, end here as one line on stderr
and exit code 1: a command-line user never sees a traceback for a bad URL, a
server that does not answer, or a schema that is not there.

Values read from rows (queue and task names, ids, reasons, barrier fields) were written
by others: human-readable output shows each through
:func:`pg_transport.ops.terminal.printable`, so none can send control sequences to the
operator's terminal; ``--json`` output is escaped by the JSON encoder.
"""

from __future__ import annotations

import os

import click
import psycopg

from pg_transport.config import warn_unknown_environment
from pg_transport.db.migrate import current_version, latest_version
from pg_transport.db.migrate import migrate as migrate_schema
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.db.url import mask_url
from pg_transport.errors import PgqError
from pg_transport.ops import delayed as delayed_report
from pg_transport.ops import status as status_report
from pg_transport.ops.cli_common import (
    Group,
    checked_schema,
    open_connector,
    open_store,
    schema_option,
    url_option,
)
from pg_transport.ops.cli_dead import dead
from pg_transport.ops.cli_limits import limit
from pg_transport.ops.cli_schedule import schedule
from pg_transport.ops.format import age, json_text, one_line, plural, table
from pg_transport.ops.plugins import PluginCommands
from pg_transport.ops.terminal import printable, quoted
from pg_transport.store import Store

__all__ = ["main"]


class Main(PluginCommands, Group):
    """pgq's commands, and each installed plugin's group (``pgq barrier``)."""


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="celery-pgq", prog_name="pgq")
def main() -> None:
    """pgq: PostgreSQL as a Celery broker."""
    warn_unknown_environment(os.environ)


main.add_command(dead)
main.add_command(limit)
main.add_command(schedule)


@main.command()
@url_option
@schema_option
def migrate(url: str | None, schema: str) -> None:
    """Create the pgq schema, or upgrade it to this pgq's version.

    Safe to run from many processes at once, and to run again: it applies only
    what is missing.
    """
    schema = checked_schema(schema)
    with open_connector(url) as connector, connector.connection() as conn:
        applied = migrate_schema(conn, schema)
        version = current_version(conn, schema) or 0
        where = f"pgq schema {schema!r} at {connector.display_url}"
    if applied:
        click.echo(
            f"{where}: applied {plural(len(applied), 'migration')} "
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
    with open_store(url, schema) as store:
        count = store.purge(queue)
        known = count > 0 or store.has_queue(queue) or store.size(queue) > 0
    if not known:
        raise click.ClickException(
            f"no queue {quoted(queue)} in pgq schema {quoted(schema)}: nothing was purged "
            "(`pgq status` lists the queues)"
        )
    click.echo(f"{plural(count, 'waiting message')} purged from queue {quoted(queue)}")


@main.command()
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def status(url: str | None, schema: str, as_json: bool) -> None:
    """Show every queue's ready, in-flight, delayed and dead messages, and the clients.

    In flight means claimed by a consumer whose lease runs; delayed means waiting for
    its ETA, and NEXT DUE IN says when the first of them falls due. Queues with ordered
    messages held back are listed again below: their ordering keys blocked (messages
    parked until an earlier one of the key is done), those messages, how long ago the
    oldest of them was published, and the followers waiting for the task they follow.
    Queues with unique tasks list how many unique keys their messages hold, queued and
    running (counts only, never a key). Clients are pgq processes connected to this
    database (workers and publishers of every pgq schema in it: Postgres does not know
    which schema a session uses).
    """
    with open_store(url, schema) as store:
        report = status_report.collect(store)
        where = f"pgq schema {store.schema!r} at {store.connector.display_url}"
    if as_json:
        click.echo(json_text(report.as_json()))
        return
    click.echo(where)
    if report.queues:
        click.echo(
            table(
                ["QUEUE", "READY", "IN FLIGHT", "DELAYED", "DEAD", "OLDEST READY", "NEXT DUE IN"],
                [
                    [
                        q.queue,
                        str(q.ready),
                        str(q.in_flight),
                        str(q.delayed),
                        str(q.dead),
                        age(q.oldest_ready_age_s),
                        age(q.next_due_in_s),
                    ]
                    for q in report.queues
                ],
                right={1, 2, 3, 4, 5, 6, 7},
            )
        )
    else:
        click.echo("no queues")
    held = [q for q in report.queues if q.blocked or q.following]
    if held:
        click.echo("ordering:")
        click.echo(
            table(
                [
                    "QUEUE",
                    "BLOCKED KEYS",
                    "MESSAGES BLOCKED",
                    "OLDEST BLOCKED",
                    "FOLLOWERS WAITING",
                ],
                [
                    [
                        q.queue,
                        str(q.blocked_keys),
                        str(q.blocked),
                        age(q.oldest_blocked_age_s),
                        str(q.following),
                    ]
                    for q in held
                ],
                right={1, 2, 3, 4},
            )
        )
    unique = [q for q in report.queues if q.unique_queued or q.unique_running]
    if unique:
        click.echo("unique keys held:")
        click.echo(
            table(
                ["QUEUE", "QUEUED", "RUNNING"],
                [[q.queue, str(q.unique_queued), str(q.unique_running)] for q in unique],
                right={1, 2},
            )
        )
    elif report.queues and report.queues[0].unique_queued is None:
        click.echo(
            "unique keys held: not counted (this role may not run unique_counts(): "
            "see docs/least-privilege.md, blocks 4 and 5)"
        )
    if report.limits:
        click.echo("limits:")
        click.echo(
            table(
                ["LIMIT", "RATE", "BURST", "CONCURRENCY", "IN FLIGHT", "WAITING FOR A SLOT"],
                [
                    [
                        lim.name,
                        lim.rate or "-",
                        str(lim.burst) if lim.rate else "-",
                        "-" if lim.concurrency is None else str(lim.concurrency),
                        str(lim.in_flight),
                        str(lim.waiting),
                    ]
                    for lim in report.limits
                ],
                right={2, 3, 4, 5},
            )
        )
    clients = report.clients
    click.echo(
        f"clients: {plural(clients.processes, 'process', 'processes')}, "
        f"{plural(clients.sessions, 'session')}"
    )
    for process in clients.by_process:
        click.echo(
            f"  {printable(process.name)} from {printable(process.address)}: "
            f"{plural(process.sessions, 'session')}, {process.active} active"
        )
    if report.barriers:
        click.echo(
            "barriers: " + ", ".join(f"{b.count} {printable(b.status)}" for b in report.barriers)
        )


@main.command()
@url_option
@schema_option
@click.option("--queue", "queues", multiple=True, help="Only this queue (repeatable).")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=delayed_report.DEFAULT_LIMIT,
    show_default=True,
    help="List at most this many, soonest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def delayed(
    url: str | None, schema: str, queues: tuple[str, ...], limit: int, as_json: bool
) -> None:
    """List ETA and countdown tasks waiting in Postgres until they are due.

    With native_delayed_delivery on (the default) no worker holds them, so Celery's
    `inspect scheduled` does not list them: this does, for every worker at once.
    Reads message payloads: run it as the worker or the owner role.
    """
    with open_store(url, schema) as store:
        found = delayed_report.collect(store, queues, limit)
    if as_json:
        click.echo(json_text([s.as_json() for s in found]))
        return
    if not found:
        click.echo("no delayed messages")
        return
    click.echo(
        table(
            ["DUE", "QUEUE", "TASK", "ID", "PRIORITY"],
            [
                [
                    s.due.isoformat(timespec="seconds"),
                    s.queue,
                    s.task or "-",
                    s.task_id or "-",
                    str(s.priority),
                ]
                for s in found
            ],
            right={4},
        )
    )
    if len(found) == limit:
        click.echo(f"(the first {limit}: --limit lists more)")


@main.command()
@click.option(
    "--url",
    envvar="PGQ_URL",
    show_envvar=True,
    metavar="URL",
    help="Postgres to run the demo on: pgq://[user[:password]@]host[:port]/dbname. "
    "Without one, an embedded Postgres is started and deleted after (pip install "
    "'celery-pgq[embedded]').",
)
@click.option(
    "--schema",
    metavar="NAME",
    help="Schema to run the demo in; it must not exist yet and is dropped at the end. "
    "Default: a throwaway name ($PGQ_SCHEMA is ignored here, so the demo never touches "
    "your real schema).",
)
def demo(url: str | None, schema: str | None) -> None:
    """Run Celery tasks through Postgres with a real worker, and show what happened.

    Without --url (or $PGQ_URL) it starts an embedded Postgres and deletes it after.
    """
    # Imported here: it loads Celery, which the other commands do not need.
    from pg_transport.ops.demo import run

    run(url, checked_schema(schema) if schema else None)


@main.command()
@url_option
@schema_option
@click.option(
    "--serve",
    "port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    help="Serve the metrics over HTTP on this port (0: any free port) instead of printing "
    "them once; every scrape of /metrics computes fresh figures.",
)
@click.option(
    "--host",
    metavar="ADDRESS",
    help="With --serve: address to listen on.  [default: 127.0.0.1]",
)
def metrics(url: str | None, schema: str, port: int | None, host: str | None) -> None:
    """Print the figures of `pgq status` in Prometheus text format, or serve them.

    Per queue (label `queue`): ready, in-flight, delayed and dead messages and the age
    of the oldest ready message; and the connected pgq clients.
    """
    # Imported here, as demo: the other commands do not need them.
    import time

    from pg_transport.ops import metrics as exposition

    if port is None:
        if host is not None:
            raise click.UsageError("--host goes with --serve")
        with open_store(url, schema) as store:
            started = time.perf_counter()
            report = status_report.collect(store)
            elapsed = time.perf_counter() - started
        click.echo(exposition.render(report, elapsed), nl=False)
        return
    with open_store(url, schema) as store:
        # Checked once, up front: a missing or outdated schema is a start-up error,
        # not a stream of failed scrapes.
        checked = store.schema
    # A connector of its own, named so `pgq status` does not count the exporter
    # among the workers and publishers (application_name 'pgq:<pid>').
    connector = Connector(
        url_to_conninfo(url),
        display_url=mask_url(url or "pgq://"),
        application_name="pgq-metrics",
    )
    store = Store(connector, checked)
    try:
        server = exposition.make_server(
            host or "127.0.0.1",
            port,
            lambda: status_report.collect(store),
            describe_error=one_line,
            errors=(PgqError, psycopg.Error),
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
@url_option
@schema_option
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    metavar="ADDRESS",
    help="Address to listen on.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8780,
    show_default=True,
    help="Port to listen on (0: any free port).",
)
@click.option(
    "--token",
    envvar="PGQ_WEB_TOKEN",
    show_envvar=True,
    metavar="TOKEN",
    help="The token that allows actions (requeue, rehook, purge), at least 16 characters; "
    "prefer the variable or --token-file (other users can see a command line). Without "
    "one the console is read-only.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Read the token from this file instead.",
)
@click.option(
    "--interval",
    type=click.FloatRange(1, 3600),
    default=10.0,
    show_default=True,
    help="Seconds between the samples the charts draw.",
)
@click.option(
    "-A",
    "--app",
    metavar="MODULE",
    help="Module that connects your message_poisoned handlers (for rehook).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name browsers reach the console by (a proxy's public name, say); "
    "repeatable. An IP address and localhost always are.",
)
def web(
    url: str | None,
    schema: str,
    host: str,
    port: int,
    token: str | None,
    token_file: str | None,
    interval: float,
    app: str | None,
    allowed_hosts: tuple[str, ...],
) -> None:
    """Serve a web console of the queues, dead letters, barriers, schedules and processes.

    Read-only unless a token is given; pages show what the database role may read.
    """
    from pathlib import Path

    try:
        from pg_transport.web.server import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the web console needs pgq's `web` extra: pip install 'celery-pgq[web]' ({exc})"
        ) from exc
    from pg_transport.ops.dead import import_app

    if token_file is not None:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise click.UsageError(
                f"cannot read --token-file {token_file!r}: {exc.strerror or exc}"
            ) from exc
    if token is not None and len(token) < 16:
        raise click.UsageError("the console's token must be at least 16 characters")
    if app:
        import_app(app)
    with open_store(url, schema) as store:
        checked = store.schema
    connector = Connector(
        url_to_conninfo(url),
        display_url=mask_url(url or "pgq://"),
        application_name="pgq-web",
        max_size=6,
    )
    try:
        serve(
            connector,
            checked,
            host=host,
            port=port,
            token=token or None,
            interval=interval,
            allowed_hosts=allowed_hosts,
            announce=click.echo,
            url=url or "pgq://",
        )
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    finally:
        connector.close()


@main.command()
@click.option(
    "--file",
    "path",
    envvar="PGQ_HEALTH_FILE",
    show_envvar=True,
    metavar="PATH",
    type=click.Path(dir_okay=False),
    default=None,
    help="Heartbeat file the worker touches every consume-loop cycle.  "
    "[default: pgq-<uid>/worker.heartbeat in the temporary directory, a directory "
    "only this user may enter]",
)
@click.option(
    "--stale-after",
    envvar="PGQ_HEALTH_STALE_SECONDS",
    show_envvar=True,
    metavar="SECONDS",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Fail when the worker's last consume-loop cycle is older than this.",
)
def health(path: str | None, stale_after: float) -> None:
    """Exit 0 while a worker keeps consuming, 1 once it has stopped: a container healthcheck.

    The worker must run pg_transport.ops.health's heartbeat step
    (pg_transport.ops.health.install(app)).
    Fails when the worker is gone, stopped or stuck, not only when its process is.
    """
    from pathlib import Path

    from pg_transport.ops import health as worker_health

    result = worker_health.check(Path(path) if path else worker_health.default_file(), stale_after)
    # The message names the host read from the heartbeat file, which others may write.
    if not result.healthy:
        raise click.ClickException(printable(result.message))
    click.echo(f"healthy: {printable(result.message)}")


if __name__ == "__main__":
    main()
