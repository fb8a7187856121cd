"""Plumbing between pgq and Postgres: URLs, the connection pool, retries, the wire
layer for per-message statements, and migrations. Nothing here knows kombu or queues.

- :mod:`~pg_transport.db.url`: parsing ``pgq://`` URLs with libpq, masking secrets.
- :mod:`~pg_transport.db.pool`: :class:`Connector`, a capped pool, safe across fork.
- :mod:`~pg_transport.db.retry`: dead connections, and every retry policy.
- :mod:`~pg_transport.db.wire` and :mod:`~pg_transport.db.params`: statements sent
  through libpq directly, parameters written as text.
- :mod:`~pg_transport.db.migrate`: the schema's version and its migrations.
- :mod:`~pg_transport.db.locks`: deterministic advisory-lock keys.
- :mod:`~pg_transport.db.waits`: waiting for sockets at any descriptor number (poll).
"""

from __future__ import annotations

from pg_transport.db.migrate import ensure_schema, migrate
from pg_transport.db.pool import Connector, describe, mask_url, url_to_conninfo
from pg_transport.db.retry import is_dead_connection

__all__ = [
    "Connector",
    "describe",
    "ensure_schema",
    "is_dead_connection",
    "mask_url",
    "migrate",
    "url_to_conninfo",
]
