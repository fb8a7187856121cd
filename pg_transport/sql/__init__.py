"""SQL of pgq: the schema, numbered migrations and named queries, loaded from files."""

from __future__ import annotations

from pg_transport.sql.loader import (
    Migration,
    channel_prefix,
    compose_channel,
    load_migrations,
    load_named,
    load_queries,
    load_schema,
    queue_channel,
    substitute_parameters,
    to_positional,
)

__all__ = [
    "Migration",
    "channel_prefix",
    "compose_channel",
    "load_migrations",
    "load_named",
    "load_queries",
    "load_schema",
    "queue_channel",
    "substitute_parameters",
    "to_positional",
]
