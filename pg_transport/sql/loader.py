"""Load the ``.sql`` files of this package and compose the schema name into them."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

from pg_transport.locks import lock_space

_NAME = re.compile(r"^-- name: (\w+)\s*$")
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_MIGRATION = re.compile(r"^(\d{4})_\w+\.sql$")


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def parse_named(text: str) -> dict[str, str]:
    """Split ``-- name: x`` blocks into {name: statement}; comments are dropped."""
    queries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            if match.group(1) in queries:
                raise ValueError(f"query {match.group(1)!r} is defined twice")
            current = queries[match.group(1)] = []
        elif current is not None and not line.lstrip().startswith("--"):
            current.append(line)
    return {name: "\n".join(lines).strip() for name, lines in queries.items()}


def to_positional(query: str) -> tuple[str, tuple[str, ...]]:
    """A rendered query with ``%(name)s`` placeholders as libpq's ``$n``, and the
    parameter names in ``$n`` order (for statements sent without psycopg's cursor)."""
    names: list[str] = []

    def number(name: str) -> str:
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return substitute_parameters(query, number), tuple(names)


def substitute_parameters(query: str, render: Callable[[str], str]) -> str:
    """A rendered query with each ``%(name)s`` placeholder as ``render(name)`` and each
    ``%%`` as ``%``: the query in another client's notation for its parameters."""
    return _PLACEHOLDER.sub(
        lambda match: "%" if match.group(1) is None else render(match.group(1)), query
    )


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a schema."""
    return f"pgq_{schema}"


def handoff_prefix(schema: str) -> str:
    """The start of a consumer's own channel (the consumer's token completes it).

    Channel names have 63 bytes at most, and a schema name may take all of them: the
    schema is in it as its lock space, in hex."""
    return f"pgq_h{lock_space(schema) & 0xFFFFFFFF:08x}_"


def handoff_channel(schema: str, token: int) -> str:
    """The channel where publishes hand messages to the consumer holding ``token``."""
    return f"{handoff_prefix(schema)}{token}"


def compose(text: str, schema: str) -> sql.Composed:
    """Compose ``{schema}`` and ``{channel}`` into ``text`` as identifiers.

    ``{handoff}`` (a consumer's own channel) is left in place, for :func:`compose_handoff`
    once the session knows its token."""
    return sql.SQL(text).format(
        schema=sql.Identifier(schema),
        channel=sql.Identifier(notify_channel(schema)),
        handoff=sql.SQL("{handoff}"),
    )


def compose_handoff(rendered: str, channel: str) -> sql.Composed:
    """A rendered query with a consumer's own channel composed in as an identifier."""
    return sql.SQL(rendered).format(handoff=sql.Identifier(channel))


@cache
def _raw_named(filename: str) -> dict[str, str]:
    return parse_named(_read(filename))


@cache
def load_named(filename: str, schema: str) -> dict[str, str]:
    """The named queries of one ``.sql`` file of this package, ``schema`` composed in.

    Rendered to text once per schema, so psycopg's query cache (and server-side
    prepared statements) see the same string every time.
    """
    return {
        name: compose(text, schema).as_string(None)
        for name, text in _raw_named(filename).items()
    }


def load_queries(schema: str) -> dict[str, str]:
    """The queue queries (``queries.sql``)."""
    return load_named("queries.sql", schema)


def load_schema(schema: str) -> sql.Composed:
    """The whole current schema (``schema.sql``)."""
    return compose(_read("schema.sql"), schema)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    def composed(self, schema: str) -> sql.Composed:
        return compose(self.text, schema)


@cache
def load_migrations() -> tuple[Migration, ...]:
    """Numbered migrations in order; numbering must be contiguous from 1."""
    found: list[Migration] = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            text = entry.read_text(encoding="utf-8")
            found.append(Migration(int(match.group(1)), entry.name, text))
    found.sort(key=lambda m: m.version)
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise ValueError(f"migration {migration.name} breaks the numbering at {expected}")
    return tuple(found)
