"""``pgq limit``: the flow limits (docs/flow-control.md) shown and set at run time."""

from __future__ import annotations

import click

from pg_transport.message.limits import parse_burst, parse_concurrency, parse_rate
from pg_transport.ops.cli_common import Group, open_store, schema_option, url_option
from pg_transport.ops.format import json_text, table
from pg_transport.ops.limits import Limits, LimitState
from pg_transport.ops.terminal import quoted

__all__ = ["limit"]


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _rows(states: list[LimitState]) -> str:
    return table(
        ["NAME", "RATE", "BURST", "TOKENS", "CONCURRENCY", "IN FLIGHT", "WAITING", "KEYS",
         "ORIGIN"],
        [
            [s.name, _dash(s.rate), str(s.burst) if s.rate else "-", _dash(s.tokens),
             _dash(s.concurrency), str(s.in_flight), str(s.waiting), str(s.keys), s.origin]
            for s in states
        ],
        right={2, 3, 4, 5, 6, 7},
    )  # fmt: skip


@click.group(cls=Group)
def limit() -> None:
    """Flow limits: global rates and concurrency per key, shown and set at run time.

    NAME is task:<task name>, queue:<queue name>, or a limiter of your own that tasks
    name (pgq_rate_limiter, concurrency_limiter). Every worker obeys a change from its
    next claim on: no restart.
    """


@limit.command("list")
@url_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def limit_list(url: str | None, schema: str, as_json: bool) -> None:
    """Every limit: its definition, the tokens of its keyless bucket now, the messages
    holding one of its slots (IN FLIGHT) and parked for one (WAITING)."""
    with open_store(url, schema) as store:
        states = Limits(store).states()
    if as_json:
        click.echo(json_text({"limits": [s.as_json() for s in states]}))
    elif not states:
        click.echo("no flow limits")
    else:
        click.echo(_rows(states))


@limit.command("set")
@url_option
@schema_option
@click.argument("name")
@click.option("--rate", metavar="RATE", help="Count per s, m or h: 10/s, 600/m, 3600/h.")
@click.option("--burst", metavar="N", help="Starts allowed at once after an idle spell.")
@click.option(
    "--concurrency",
    metavar="N",
    help="At most N in flight per key (for queue:<name>, in the whole queue).",
)
@click.option("--no-rate", is_flag=True, help="Remove the rate.")
@click.option("--no-concurrency", is_flag=True, help="Remove the concurrency limit.")
def limit_set(
    url: str | None,
    schema: str,
    name: str,
    rate: str | None,
    burst: str | None,
    concurrency: str | None,
    no_rate: bool,
    no_concurrency: bool,
) -> None:
    """Define or change limit NAME (kept over configuration until `pgq limit reset`)."""
    if rate is None and burst is None and concurrency is None and not (no_rate or no_concurrency):
        raise click.UsageError("give --rate, --burst, --concurrency, --no-rate or --no-concurrency")
    parsed_rate = None if rate is None else parse_rate("--rate", rate)
    parsed_burst = None if burst is None else parse_burst("--burst", burst)
    cap = None if concurrency is None else parse_concurrency("--concurrency", concurrency)
    with open_store(url, schema) as store:
        state = Limits(store).set(
            name,
            rate=parsed_rate,
            burst=parsed_burst,
            concurrency=cap,
            clear_rate=no_rate,
            clear_concurrency=no_concurrency,
        )
    click.echo(_rows([state]))


@limit.command("show")
@url_option
@schema_option
@click.argument("name")
@click.option(
    "--keys",
    "n",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Show this many keys, those with most waiting first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def limit_show(url: str | None, schema: str, name: str, n: int, as_json: bool) -> None:
    """Limit NAME and its keys with most waiting (keys are your application's values:
    a role that may not read them, such as the monitor, gets the limit's counts only)."""
    with open_store(url, schema) as store:
        limits = Limits(store)
        states = limits.states(name)
        if not states:
            raise click.ClickException(f"no flow limit named {quoted(name)}")
        keys = limits.keys(name, n)
    if as_json:
        shown = None if keys is None else [k.as_json() for k in keys]
        click.echo(json_text({"limit": states[0].as_json(), "keys": shown}))
        return
    click.echo(_rows(states))
    if keys is None:
        click.echo("")
        click.echo(
            "keys not shown: they are your application's values, which this role may not "
            "read (SELECT on flow_state): run `pgq limit show` as the workers' role to see them"
        )
    elif keys:
        click.echo("")
        click.echo(
            table(
                ["KEY", "TOKENS", "IN FLIGHT", "WAITING"],
                [
                    [k.key or "(none)", _dash(k.tokens), str(k.in_flight), str(k.waiting)]
                    for k in keys
                ],
                right={1, 2, 3},
            )
        )


@limit.command("reset")
@url_option
@schema_option
@click.argument("name")
@click.option("--any-origin", is_flag=True, help="Remove it even if configuration wrote it.")
def limit_reset(url: str | None, schema: str, name: str, any_origin: bool) -> None:
    """Remove limit NAME set by `pgq limit set`: configuration's own (if any) is written
    again at the next worker start."""
    with open_store(url, schema) as store:
        origin = Limits(store).reset(name, every_origin=any_origin)
    if origin is None:
        raise click.ClickException(
            f"no flow limit {quoted(name)} set by a command (--any-origin removes one "
            "configuration wrote)"
        )
    click.echo(f"removed flow limit {quoted(name)} (origin {origin})")
