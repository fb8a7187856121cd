"""Finding a Postgres for the tests: PGQ_TEST_URL, the local server, or an embedded one."""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

import psycopg

LOCAL = "postgresql://postgres@127.0.0.1:5432/test"
_embedded: Any = None


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def find_postgres() -> str:
    """A libpq URL of a server the tests may create schemas and roles in."""
    url = os.environ.get("PGQ_TEST_URL")
    if url:
        return url.replace("pgq://", "postgresql://", 1)
    if _answers(LOCAL):
        return LOCAL
    global _embedded
    if _embedded is None:
        import pgserver  # the embedded fallback for machines without Postgres

        data_dir = tempfile.mkdtemp(prefix="pgq-embedded-")
        _embedded = pgserver.get_server(data_dir, cleanup_mode="delete")
    return str(_embedded.get_uri())


def to_broker_url(pg_url: str) -> str:
    return "pgq://" + pg_url.split("://", 1)[1]


def new_schema_name() -> str:
    return "pgq_t_" + uuid.uuid4().hex[:12]


def drop_schema(pg_url: str, schema: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                psycopg.sql.Identifier(schema)
            )
        )
