"""``pgq schedule``: list, add, enable, disable and remove periodic-task entries.

The entries are those ``celery beat -S pgq`` sends (pg_transport.beat): a change here
is seen by the leading beat at its next tick. Entries of ``beat_schedule`` come back
when a beat starts if removed here; disabling one lasts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from pg_transport.ops.cli_common import (
    Group,
    open_store,
    schema_option,
    url_option,
)
from pg_transport.ops.format import json_text, plural, table
from pg_transport.ops.terminal import printable, quoted

if TYPE_CHECKING:
    from pg_transport.beat.store import BeatStore

__all__ = ["schedule"]


@contextmanager
def open_beat(url: str | None, schema: str) -> Iterator[BeatStore]:
    # Imported here: it loads Celery's schedules, which the other commands do not need.
    from pg_transport.beat.store import BeatStore

    with open_store(url, schema) as store:
        yield BeatStore(store.connector, store.schema)


@click.group(cls=Group)
def schedule() -> None:
    """Periodic tasks sent by `celery beat -S pgq`: list, add, enable, disable, remove."""


def _describe(data: Any) -> str:
    from pg_transport.beat.entries import schedule_from_json

    try:
        return schedule_from_json(data).describe()
    except (ValueError, TypeError, KeyError, AttributeError):
        return f"unreadable: {json.dumps(data)}"


@schedule.command("list")
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def schedule_list(url: str | None, schema: str, as_json: bool) -> None:
    """List the entries, and which beat leads."""
    with open_beat(url, schema) as db:
        entries = db.listing()
        lease = db.leader()
    if as_json:
        leader = None
        if lease is not None:
            leader = {
                "holder": lease.holder,
                "term": lease.term,
                "acquired_at": lease.acquired_at,
                "lease_until": lease.lease_until,
                "running": lease.running,
            }
        click.echo(json_text({"entries": entries, "leader": leader}))
        return
    if not entries:
        click.echo("no schedule entries")
    else:
        click.echo(
            table(
                ["NAME", "TASK", "SCHEDULE", "ENABLED", "FROM", "LAST SLOT", "SENT"],
                [
                    [
                        str(e["name"]),
                        str(e["task"]),
                        _describe(e["schedule"]),
                        "yes" if e["enabled"] else "no",
                        "beat_schedule" if e["origin"] == "config" else "pgq schedule",
                        "-" if e["last_due"] is None else e["last_due"].isoformat(),
                        str(e["sent_count"]),
                    ]
                    for e in entries
                ],
                right={6},
            )
        )
    if lease is None:
        click.echo("leader: none yet (no beat has run)")
    else:
        state = "running" if lease.running else "expired: no beat holds it"
        click.echo(
            f"leader: {printable(lease.holder)} (term {lease.term}, since "
            f"{lease.acquired_at.isoformat()}, lease {state})"
        )


def _json_option(value: str | None, option: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not JSON: {exc}", param_hint=option) from None


@schedule.command("add")
@url_option
@schema_option
@click.argument("name")
@click.option("--task", required=True, metavar="TASK", help="The task's name.")
@click.option(
    "--every",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Send every SECONDS, counted from now.",
)
@click.option(
    "--aligned",
    is_flag=True,
    help="With --every: at multiples of SECONDS since the Unix epoch (on the minute, "
    "on the hour...), as Celery's relative=True.",
)
@click.option(
    "--crontab",
    "cron",
    metavar="SPEC",
    help="Send at these minutes: 'minute hour day-of-month month day-of-week', in the "
    "beat's timezone (Celery's `timezone`).",
)
@click.option("--args", "args_json", metavar="JSON", help="Positional arguments, a JSON list.")
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments, a JSON object.")
@click.option("--queue", metavar="QUEUE", help="Send to this queue (else the task's route).")
@click.option(
    "--options",
    "options_json",
    metavar="JSON",
    help="apply_async options, a JSON object (queue, priority, expires...).",
)
@click.option("--disabled", is_flag=True, help="Add it disabled (`pgq schedule enable` later).")
def schedule_add(
    url: str | None,
    schema: str,
    name: str,
    task: str,
    every: float | None,
    aligned: bool,
    cron: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    queue: str | None,
    options_json: str | None,
    disabled: bool,
) -> None:
    """Add entry NAME: TASK sent --every SECONDS or at --crontab SPEC."""
    from pg_transport.beat.entries import Cron, Every, Schedule, check_entry

    if (every is None) == (cron is None):
        raise click.UsageError("give one of --every SECONDS or --crontab SPEC")
    if aligned and every is None:
        raise click.UsageError("--aligned goes with --every")
    sched: Schedule
    if cron is not None:
        try:
            sched = Cron.parse(cron)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--crontab") from None
    else:
        assert every is not None
        sched = Every(every, aligned)
    options = _json_option(options_json, "--options")
    if queue is not None:
        if options is not None and not isinstance(options, dict):
            raise click.BadParameter(
                f"{options_json!r} must be a JSON object", param_hint="--options"
            )
        options = {**(options or {}), "queue": queue}
    entry = check_entry(
        name,
        task,
        sched,
        _json_option(args_json, "--args"),
        _json_option(kwargs_json, "--kwargs"),
        options,
    )
    with open_beat(url, schema) as db:
        if not db.add(entry, enabled=not disabled):
            raise click.ClickException(
                f"schedule entry {quoted(name)} exists already in pgq schema {quoted(schema)}: "
                "remove it first"
            )
    state = " (disabled)" if disabled else ""
    click.echo(f"added {quoted(name)}: {printable(task)} {sched.describe()}{state}")


def _set_enabled(url: str | None, schema: str, name: str, enabled: bool) -> None:
    with open_beat(url, schema) as db:
        found = db.set_enabled(name, enabled)
    if not found:
        raise click.ClickException(
            f"no schedule entry {quoted(name)} in pgq schema {quoted(schema)}"
        )
    click.echo(f"{quoted(name)} {'enabled' if enabled else 'disabled'}")


@schedule.command("enable")
@url_option
@schema_option
@click.argument("name")
def schedule_enable(url: str | None, schema: str, name: str) -> None:
    """Enable entry NAME: its slots start from now."""
    _set_enabled(url, schema, name, True)


@schedule.command("disable")
@url_option
@schema_option
@click.argument("name")
def schedule_disable(url: str | None, schema: str, name: str) -> None:
    """Disable entry NAME (beats restarting keep it disabled)."""
    _set_enabled(url, schema, name, False)


@schedule.command("remove")
@url_option
@schema_option
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
def schedule_remove(url: str | None, schema: str, names: tuple[str, ...]) -> None:
    """Remove entries (one of beat_schedule comes back when a beat starts: disable it)."""
    with open_beat(url, schema) as db:
        removed = {name: db.remove(name) for name in dict.fromkeys(names)}
    missing = [name for name, origin in removed.items() if origin is None]
    done = [name for name, origin in removed.items() if origin is not None]
    if done:
        click.echo(
            f"removed {plural(len(done), 'entry', 'entries')}: {', '.join(map(quoted, done))}"
        )
    if any(origin == "config" for origin in removed.values()):
        click.echo("entries of beat_schedule come back when a beat starts: disable them instead")
    if missing:
        raise click.ClickException(
            f"no schedule entry {', '.join(map(quoted, missing))} in pgq schema {quoted(schema)}"
        )
