"""``pgq dead``: list, requeue, purge dead-lettered messages, and re-run their hooks."""

from __future__ import annotations

from datetime import timezone

import click

from pg_transport.ops.cli_common import (
    Group,
    hooks,
    open_store,
    schema_option,
    url_option,
)
from pg_transport.ops.dead import DeadLetters, NotFound, import_app, parse_duration
from pg_transport.ops.format import identity_text, json_text, plural, table
from pg_transport.ops.terminal import printable, quoted

__all__ = ["dead"]


@click.group(cls=Group)
def dead() -> None:
    """Dead-lettered messages: list, requeue, purge, and re-run their hooks."""


@dead.command("list")
@url_option
@schema_option
@click.option("--queue", metavar="QUEUE", help="Only rows of this queue.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Show at most this many rows, newest first.",
)
def dead_list(url: str | None, schema: str, queue: str | None, as_json: bool, limit: int) -> None:
    """List dead-letter rows, newest first."""
    with open_store(url, schema) as store:
        rows, total = DeadLetters(store).rows(queue=queue, limit=limit)
    if as_json:
        click.echo(json_text({"total": total, "dead_letters": [r.as_json() for r in rows]}))
        return
    if not rows:
        click.echo("no dead-letter rows" + (f" in queue {quoted(queue)}" if queue else ""))
        return
    click.echo(
        table(
            ["ID", "QUEUE", "TASK", "TASK ID", "IDENTITY", "READS", "DEAD AT", "HOOKS", "REASON"],
            [
                [
                    str(r.id),
                    r.queue,
                    r.task_name or "-",
                    r.task_id or "-",
                    identity_text(r.identity),
                    str(r.read_ct),
                    r.dead_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
                    hooks(r),
                    r.reason,
                ]
                for r in rows
            ],
            right={0, 5},
        )
    )
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
    with open_store(url, schema) as store:
        moved = DeadLetters(store).requeue(ids, every=all_, queue=queue)
    count = sum(len(v) for v in moved.values())
    missing = sorted(set(ids) - {i for v in moved.values() for i in v})
    if count or not missing:
        detail = ", ".join(f"{len(v)} to queue {quoted(q)}" for q, v in moved.items())
        click.echo(
            f"{plural(count, 'dead-letter row')} requeued" + (f": {detail}" if detail else "")
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
    "--older-than",
    metavar="DURATION",
    help="Only rows dead for longer than this: 90s, 30m, 12h, 7d. Default: every row.",
)
@click.option("--queue", metavar="QUEUE", help="Only rows of this queue.")
@click.option("-y", "--yes", is_flag=True, help="Purge without asking (for scripts and cron).")
def dead_purge(
    url: str | None, schema: str, older_than: str | None, queue: str | None, yes: bool
) -> None:
    """Delete dead-letter rows for good, and print how many.

    Asks first unless --yes: whatever the filters, `--older-than 0s` deletes as much as
    no filter does.
    """
    # Checked before connecting: a typo must not wait for (or depend on) the server.
    seconds = parse_duration(older_than) if older_than is not None else None
    with open_store(url, schema) as store:
        if not yes:
            click.confirm(
                (
                    "Delete every dead-letter row"
                    if seconds is None
                    else "Delete the dead-letter rows"
                )
                + (f" of queue {quoted(queue)}" if queue else "")
                + (f" dead for longer than {older_than}" if older_than else "")
                + f" in pgq schema {store.schema!r} at {store.connector.display_url}?",
                abort=True,
            )
        count = DeadLetters(store).purge(older_than=seconds, queue=queue)
    click.echo(
        f"{plural(count, 'dead-letter row')} purged"
        + (f" from queue {quoted(queue)}" if queue else "")
        + (f" (dead for longer than {older_than})" if older_than else "")
    )


@dead.command("rehook")
@url_option
@schema_option
@click.argument("dead_letter_id", type=int, metavar="ID")
@click.option(
    "-A",
    "--app",
    metavar="MODULE",
    help="Module that connects your message_poisoned handlers (as for celery -A).",
)
def dead_rehook(url: str | None, schema: str, dead_letter_id: int, app: str | None) -> None:
    """Send message_poisoned again for dead-letter row ID and record each handler's outcome.

    Exits 1 when a handler fails; its error is recorded on the row.
    """
    if app:
        import_app(app)
    with open_store(url, schema) as store:
        result = DeadLetters(store).rehook(dead_letter_id)
    click.echo(
        f"dead-letter row {result.dead_letter_id} of queue {quoted(result.queue)}: task "
        + printable(
            f"{result.task_name or '-'} {result.task_id or '-'}, identity "
            f"{identity_text(result.identity)}"
        )
    )
    for outcome in result.outcomes:
        if outcome["ok"]:
            click.echo(f"  ok      {printable(outcome['receiver'])}")
        else:
            click.echo(f"  FAILED  {printable(outcome['receiver'])}: {printable(outcome['error'])}")
    if not result.recorded:
        raise click.ClickException(
            f"dead-letter row {dead_letter_id} was requeued or purged while the hooks ran: "
            "outcomes not recorded"
        )
    if result.failed:
        raise click.ClickException(
            f"{len(result.failed)} of {plural(len(result.outcomes), 'handler')} failed; "
            f"outcomes recorded on dead-letter row {dead_letter_id}"
        )
