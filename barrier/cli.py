"""``pgq barrier``: the barrier's own CLI group, added to ``pgq`` through its plugin
(:mod:`barrier.plugin`).

Values read from rows (ids, task names, reasons) were written by whoever could publish:
they are printed through :func:`~pg_transport.ops.terminal.printable`, never raw.
"""

from __future__ import annotations

import click

from barrier.inspect import show
from pg_transport.ops.cli_common import Group, open_store, schema_option, url_option
from pg_transport.ops.format import json_text, table
from pg_transport.ops.terminal import printable, quoted

__all__ = ["barrier"]


@click.group(cls=Group)
def barrier() -> None:
    """Inspect fan-in barriers."""


@barrier.command("show")
@url_option
@schema_option
@click.argument("barrier_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def barrier_show(url: str | None, schema: str, barrier_id: str, as_json: bool) -> None:
    """Show one barrier: status, parts done, callback, timestamps."""
    with open_store(url, schema) as store:
        found = show(store.connector, store.schema, barrier_id)
    if found is None:
        raise click.ClickException(
            f"no barrier {quoted(barrier_id)} in pgq schema {quoted(schema)}"
        )
    if as_json:
        click.echo(json_text(found))
        return
    parts = found.pop("parts", [])
    for key, value in found.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        click.echo(f"{key + ':':<16}{'-' if value is None else printable(value)}")
    if parts:
        click.echo(
            table(
                ["PART", "OUTCOME", "TASK ID", "FINISHED"],
                [
                    [
                        str(p["index"]),
                        str(p["outcome"]),
                        str(p.get("task_id") or "-"),
                        str(p["finished_at"]),
                    ]
                    for p in parts
                ],
                right={0},
            )
        )
