"""SQL of pgq: the schema, numbered migrations and named queries, loaded from files."""

from __future__ import annotations

from pg_transport.sql.loader import (
    Migration,
    compose_handoff,
    handoff_channel,
    handoff_prefix,
    load_migrations,
    load_named,
    load_queries,
    load_schema,
    notify_channel,
    substitute_parameters,
    to_positional,
)

__all__ = [
    "Migration",
    "compose_handoff",
    "handoff_channel",
    "handoff_prefix",
    "load_migrations",
    "load_named",
    "load_queries",
    "load_schema",
    "notify_channel",
    "substitute_parameters",
    "to_positional",
]
