"""SQL of pgq: the loader every package's ``.sql`` goes through, and the queue's own
files (``queries.sql``, ``schema.sql``, numbered ``migrations/``)."""

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
