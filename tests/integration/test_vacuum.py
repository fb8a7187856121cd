"""pgq vacuums its message table itself once dead rows pile up (autovacuum may lag or
be off), and leaves it alone when it does not own it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from pg_transport.consume.vacuum import Vacuumer
from pg_transport.db.pool import Connector
from pg_transport.store import Store
from tests.integration.conftest import Peek


def dead_rows(peek: Peek, count: int) -> None:
    """``count`` messages through the table, then the statistics made current."""
    peek(
        "INSERT INTO {schema}.message (queue, payload)"
        " SELECT 'q', '{{}}' FROM generate_series(1, %s)",
        count,
    )
    peek("DELETE FROM {schema}.message")
    # The deleting session reports its statistics at the end of its next transaction.
    peek("SELECT pg_stat_force_next_flush()")
    peek("SELECT 1")


def heap_pages(peek: Peek, table: str = "message") -> int:
    ((pages,),) = peek("SELECT pg_relation_size(%s::regclass) / 8192", f"{peek.schema}.{table}")
    return int(pages)


def test_vacuums_once_the_threshold_is_reached(store: Store, peek: Peek) -> None:
    vacuumer = Vacuumer(store.connector, store.schema, threshold=5000)
    dead_rows(peek, 4000)
    assert vacuumer.check() is True
    assert vacuumer.vacuums == 0, "below the threshold: left to autovacuum"
    assert heap_pages(peek) > 0
    dead_rows(peek, 2000)
    assert vacuumer.check() is True
    assert vacuumer.vacuums == 1
    # The table's own count of manual VACUUMs (reported when the VACUUM ends). Not its
    # heap's size: what a VACUUM may remove and give back depends on every other
    # session's snapshot in the database (a suite's neighbour test once kept 137 pages).
    assert vacuum_count(peek) == 1


def vacuum_count(peek: Peek) -> int:
    """The message table's manual VACUUMs, once the statistics show one (Postgres 15
    and later report it as the VACUUM ends; earlier ones within their collector's
    interval, 0.5 s)."""
    deadline = time.monotonic() + 30
    while True:
        ((count,),) = peek(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
            f"{peek.schema}.message",
        )
        if count or time.monotonic() > deadline:
            return int(count)
        time.sleep(0.05)


@pytest.fixture
def stranger(pg_url: str, schema: str, store: Store) -> Iterator[str]:
    """A role with every right on the queue tables but not their owner."""
    role = f"{schema}_stranger"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
        admin.execute(
            sql.SQL("GRANT ALL ON ALL TABLES IN SCHEMA {} TO {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
    yield role
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_role_that_does_not_own_the_table_leaves_it_to_autovacuum(
    pg_url: str, store: Store, peek: Peek, stranger: str, caplog: pytest.LogCaptureFixture
) -> None:
    connector = Connector(psycopg.conninfo.make_conninfo(pg_url, user=stranger))
    try:
        vacuumer = Vacuumer(connector, store.schema, threshold=10)
        dead_rows(peek, 100)
        with caplog.at_level(logging.INFO, logger="pg_transport.vacuum"):
            assert vacuumer.check() is False
        assert vacuumer.vacuums == 0
        assert "cannot vacuum it" in caplog.text and stranger in caplog.text
        assert heap_pages(peek) > 0
    finally:
        connector.close()
