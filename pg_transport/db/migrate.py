"""Creating and upgrading the pgq schema, safely from many processes at once."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from pg_transport.db.pool import Connector
from pg_transport.db.retry import CREATED_MEANWHILE, attempt
from pg_transport.errors import SchemaError
from pg_transport.sql import load_migrations, load_queries

__all__ = ["current_version", "ensure_schema", "latest_version", "migrate"]

_checked: set[tuple[str, str]] = set()
_checked_lock = threading.Lock()


def latest_version() -> int:
    return len(load_migrations())


def current_version(conn: psycopg.Connection[Any], schema: str) -> int | None:
    """Applied version, or None when the schema has never been migrated."""
    queries = load_queries(schema)
    row = conn.execute(queries["has_version_table"], {"schema": schema}).fetchone()
    if not row or not row[0]:
        return None
    row = conn.execute(queries["applied_version"]).fetchone()
    return int(row[0]) if row else 0


def migrate(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """Apply pending migrations; return the names applied.

    Safe from many processes at once, and from any role that can merely connect: an
    upgrade holds a lock on the schema's version table that only a role allowed to
    write it can take (never an advisory key, which any session can squat), and the
    processes creating a schema at once race on the catalog's unique names, the losers
    looking again once the winner committed. Either way the loser applies nothing.
    """
    queries = load_queries(schema)
    try:
        return attempt(CREATED_MEANWHILE, lambda: _apply_pending(conn, schema, queries))
    except psycopg.errors.InsufficientPrivilege as exc:
        user = conn.info.user
        owner = _owner(conn, schema)
        remedy = (
            "grant this role CREATE on the database, or run `pgq migrate` as a role that has it"
            if owner is None
            else f"schema {schema!r} belongs to {owner!r}: run `pgq migrate` as {owner!r}, "
            f"or GRANT USAGE, CREATE ON SCHEMA {schema} TO {user}"
        )
        raise SchemaError(
            f"role {user!r} cannot create or upgrade the pgq schema {schema!r}: "
            f"{exc.diag.message_primary or exc}. To fix: {remedy}"
        ) from exc


def _apply_pending(
    conn: psycopg.Connection[Any], schema: str, queries: dict[str, str]
) -> list[str]:
    applied: list[str] = []
    with conn.transaction():
        version = current_version(conn, schema)
        if version is None:
            # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when
            # the schema exists: only ask for it when the schema is missing.
            if _owner(conn, schema) is None:
                conn.execute(queries["create_schema"])
            version = 0
        elif version < latest_version():
            # Only an upgrade locks (a role that may not write the version table can
            # still see that there is nothing to do); read again once it holds the lock.
            conn.execute(queries["migrate_lock"])
            version = current_version(conn, schema) or 0
        for migration in load_migrations()[version:]:
            conn.execute(migration.composed(schema))
            conn.execute(queries["record_version"], {"version": migration.version})
            applied.append(migration.name)
    return applied


def _owner(conn: psycopg.Connection[Any], schema: str) -> str | None:
    row = conn.execute(load_queries(schema)["schema_owner"], {"schema": schema}).fetchone()
    return str(row[0]) if row else None


def ensure_schema(connector: Connector, schema: str, *, auto_migrate: bool) -> None:
    """Make sure ``schema`` is at the latest version, once per process and database."""
    key = (connector.conninfo, schema)
    if key in _checked:
        return
    with _checked_lock:
        if key in _checked:
            return
        with connector.connection() as conn:
            try:
                version = current_version(conn, schema)
            except psycopg.errors.InsufficientPrivilege as exc:
                raise SchemaError(
                    f"role {conn.info.user!r} cannot read the pgq schema {schema!r}: "
                    f"{exc.diag.message_primary or exc}. Grant USAGE on the schema and DML "
                    "on its tables to this role"
                ) from exc
            if version != latest_version():
                if not auto_migrate:
                    state = "does not exist" if version is None else f"is at version {version}"
                    raise SchemaError(
                        f"pgq schema {schema!r} {state}, this pgq needs version "
                        f"{latest_version()}: run `pgq migrate` (auto_migrate is off)"
                    )
                migrate(conn, schema)
        _checked.add(key)
