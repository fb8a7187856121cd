"""Load pgq's ``.sql`` files and compose the schema name into them.

One rule: a package owns its SQL and keeps it beside its modules (``beat/beat.sql``,
``ops/status.sql``, ``results/results.sql``, ``web/web.sql``), naming its own package
when it loads it: ``load_named("beat.sql", schema, "pg_transport.beat")``. This package
holds the queue's ``queries.sql``, ``schema.sql`` and ``migrations/``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from hashlib import blake2b, md5
from importlib import resources

from psycopg import sql

_NAME = re.compile(r"^-- (name|part): (\w+)\s*$")
_PART = re.compile(r"\{part:(\w+)\}")
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_MIGRATION = re.compile(r"^(\d{4})_\w+\.sql$")


#: The package of the queue's queries, the schema and the migrations.
_OWN = "pg_transport.sql"


def _read(name: str, package: str) -> str:
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def parse_named(text: str) -> dict[str, str]:
    """Split ``-- name: x`` blocks into {name: statement}; comments are dropped.

    A ``-- part: y`` block is a named fragment of statements, not a statement: each
    ``{part:y}`` in a statement (or in another part) is replaced by its text, so a long
    statement reads as named parts, each with its comment beside it, and still goes to
    the server as one statement. A part that is not defined, that no statement uses, or
    that uses itself is an error."""
    blocks: dict[str, dict[str, list[str]]] = {"name": {}, "part": {}}
    current: list[str] | None = None
    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            kind, name = match.groups()
            if name in blocks["name"] or name in blocks["part"]:
                raise ValueError(f"query {name!r} is defined twice")
            current = blocks[kind][name] = []
        elif current is not None and not line.lstrip().startswith("--"):
            current.append(line)
    parts = {name: "\n".join(lines).strip() for name, lines in blocks["part"].items()}
    used: set[str] = set()

    def expand(body: str, within: tuple[str, ...]) -> str:
        def one(match: re.Match[str]) -> str:
            part = match.group(1)
            if part not in parts:
                raise ValueError(f"part {part!r} is not defined")
            if part in within:
                raise ValueError(f"part {part!r} uses itself")
            used.add(part)
            return expand(parts[part], (*within, part))

        return _PART.sub(one, body)

    queries = {name: expand("\n".join(lines).strip(), ()) for name, lines in blocks["name"].items()}
    if unused := sorted(parts.keys() - used):
        raise ValueError(f"parts {unused} are used by no query")
    return queries


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


@lru_cache(maxsize=64)
def channel_prefix(schema: str) -> str:
    """The start of every wake-up channel of a schema (:func:`queue_channel` ends it).

    Channel names have 63 bytes at most and a schema name may take all of them: the
    schema is in it as a digest."""
    return f"pgq_{blake2b(schema.encode('utf-8'), digest_size=4).hexdigest()}_"


@lru_cache(maxsize=4096)
def queue_channel(schema: str, queue: str) -> str:
    """The channel where publishes to ``queue`` wake its consumers, with no payload.

    The SQL computes the same name (``md5(convert_to(queue, 'UTF8'))`` after the prefix)
    for queues it routes to. Anyone who can connect may NOTIFY it: a wake-up is only ever
    a reason to claim."""
    return channel_prefix(schema) + md5(queue.encode("utf-8")).hexdigest()


def compose(text: str, schema: str) -> sql.Composed:
    """Compose ``{schema}`` into ``text`` as an identifier.

    ``{channel}`` (a queue's channel, in LISTEN) is left in place, for
    :func:`compose_channel` once the queue is known. ``{channel_prefix}`` is the schema's
    :func:`channel_prefix` as a literal (SQL that notifies a queue computes the rest)."""
    return sql.SQL(text).format(
        schema=sql.Identifier(schema),
        channel=sql.SQL("{channel}"),
        channel_prefix=sql.Literal(channel_prefix(schema)),
    )


def compose_channel(rendered: str, channel: str) -> sql.Composed:
    """A rendered query with a channel composed in as an identifier."""
    return sql.SQL(rendered).format(channel=sql.Identifier(channel))


@cache
def _raw_named(filename: str, package: str) -> dict[str, str]:
    return parse_named(_read(filename, package))


@cache
def load_named(filename: str, schema: str, package: str) -> dict[str, str]:
    """The named queries of ``filename`` in ``package`` (the dotted name of the package
    that owns the file, the caller's own), ``schema`` composed in.

    Rendered to text once per schema, so psycopg's query cache (and server-side
    prepared statements) see the same string every time.
    """
    return {
        name: compose(text, schema).as_string(None)
        for name, text in _raw_named(filename, package).items()
    }


def load_queries(schema: str) -> dict[str, str]:
    """The queue queries (``queries.sql``)."""
    return load_named("queries.sql", schema, _OWN)


def load_schema(schema: str) -> sql.Composed:
    """The whole current schema (``schema.sql``)."""
    return compose(_read("schema.sql", _OWN), schema)


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
    for entry in resources.files(_OWN).joinpath("migrations").iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            text = entry.read_text(encoding="utf-8")
            found.append(Migration(int(match.group(1)), entry.name, text))
    found.sort(key=lambda m: m.version)
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise ValueError(f"migration {migration.name} breaks the numbering at {expected}")
    return tuple(found)
