"""The schema: schema.sql and the migrations agree, and first connects may race."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pg_transport.db.locks import advisory_key
from pg_transport.db.migrate import current_version, ensure_schema, latest_version, migrate
from pg_transport.db.pool import Connector
from pg_transport.sql import channel_prefix, load_migrations, load_queries, load_schema
from tests.integration.conftest import Peek
from tests.integration.squatter import squatter
from tests.integration.test_cli import invoke
from tests.pg import drop_schema, new_schema_name


def catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Columns, constraints, indexes, functions and triggers of a schema, with its name
    (and its channel prefix, a digest of the name) blanked out."""
    prefix = channel_prefix(schema)

    def rows(query: str) -> list[tuple[Any, ...]]:
        found = conn.execute(query, {"s": schema}).fetchall()
        return sorted(
            tuple(str(v).replace(prefix, "<prefix>").replace(schema, "<s>") for v in row)
            for row in found
        )

    return {
        "columns": rows(
            "SELECT table_name, column_name, data_type, is_nullable, column_default,"
            " is_identity, ordinal_position FROM information_schema.columns"
            " WHERE table_schema = %(s)s"
        ),
        "constraints": rows(
            "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)"
            " FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
            " WHERE n.nspname = %(s)s"
        ),
        "indexes": rows("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(s)s"),
        "options": rows(
            "SELECT c.relname, c.relkind, coalesce(c.reloptions::text, '') FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(s)s"
        ),
        "functions": rows(
            "SELECT p.proname, p.prosrc, p.prosecdef, coalesce(p.proconfig::text, ''),"
            " coalesce(p.proacl::text, '') FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(s)s"
        ),
        "triggers": rows(
            "SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t"
            " JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %(s)s AND NOT t.tgisinternal"
        ),
    }


@pytest.fixture
def two_schemas(pg_url: str) -> Iterator[tuple[str, str]]:
    names = (new_schema_name(), new_schema_name())
    yield names
    for name in names:
        drop_schema(pg_url, name)


def test_schema_sql_equals_all_migrations(pg_url: str, two_schemas: tuple[str, str]) -> None:
    from_file, from_migrations = two_schemas
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(psycopg.sql.Identifier(from_file)))
        conn.execute(load_schema(from_file))
        applied = migrate(conn, from_migrations)
        assert len(applied) == latest_version()
        assert catalog(conn, from_file)["columns"], "schema.sql created nothing"
        assert catalog(conn, from_file) == catalog(conn, from_migrations)


def test_migrate_is_idempotent(pg_url: str, schema: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert current_version(conn, schema) is None
        assert migrate(conn, schema)
        assert migrate(conn, schema) == []
        assert current_version(conn, schema) == latest_version()


def _first_connect(url: str, schema: str, start: Any, errors: Any) -> None:
    connector = Connector(url)
    start.wait()
    try:
        ensure_schema(connector, schema, auto_migrate=True)
    except Exception as exc:  # reported to the parent, which fails the test
        errors.put(repr(exc))
    finally:
        connector.close()


@pytest.mark.sessions(13)
def test_eight_processes_connecting_first_time_at_once(pg_url: str, schema: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(8)
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_first_connect, args=(pg_url, schema, start, errors)) for _ in range(8)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    reported = []
    while not errors.empty():
        reported.append(errors.get())
    assert reported == []
    with psycopg.connect(pg_url) as conn:
        assert current_version(conn, schema) == latest_version()
        versions = conn.execute(
            psycopg.sql.SQL("SELECT version FROM {}.schema_version ORDER BY 1").format(
                psycopg.sql.Identifier(schema)
            )
        ).fetchall()
    assert [v[0] for v in versions] == list(range(1, latest_version() + 1))


def at_version(conn: psycopg.Connection[Any], schema: str, version: int) -> None:
    """``schema`` as a pgq of ``version`` migrations left it."""
    s = psycopg.sql.Identifier(schema)
    with conn.transaction():
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(s))
        for migration in load_migrations()[:version]:
            conn.execute(migration.composed(schema))
            conn.execute(
                psycopg.sql.SQL("INSERT INTO {}.schema_version (version) VALUES (%s)").format(s),
                [migration.version],
            )


@pytest.mark.parametrize("start", ["nothing", "one migration behind"])
def test_migrate_waits_on_no_lock_a_connect_only_role_can_hold(
    pg_url: str, broker_url: str, schema: str, start: str
) -> None:
    with squatter(pg_url) as squat, psycopg.connect(pg_url, autocommit=True) as conn:
        version = 0 if start == "nothing" else latest_version() - 1
        if version:
            at_version(conn, schema, version)
        # The key a migration waited on in earlier pgq versions, taken first by a role
        # that can only connect (it is computed from public strings).
        squat.hold(advisory_key("pgq:migrate", schema))
        result = squat.beside(
            f"`pgq migrate` from {start}",
            lambda: invoke("migrate", "--url", broker_url, "--schema", schema),
        )
        assert result.exit_code == 0, result.output
        names = [m.name for m in load_migrations()[version:]]
        assert f"({', '.join(names)}); now at version {latest_version()}" in result.output
        assert current_version(conn, schema) == latest_version()
        # What an upgrade does lock, the squatter cannot take.
        for mode in ("SHARE ROW EXCLUSIVE", "ACCESS SHARE"):
            statement = psycopg.sql.SQL("LOCK TABLE {}.schema_version IN {} MODE").format(
                psycopg.sql.Identifier(schema), psycopg.sql.SQL(mode)
            )
            with pytest.raises(psycopg.errors.InsufficientPrivilege), squat.conn.transaction():
                squat.conn.execute(statement)


def test_an_upgrade_waits_for_another_upgrade(pg_url: str, schema: str) -> None:
    """Two upgrades of one schema run one after the other: the second, once the first
    committed, finds nothing left to apply."""
    with (
        psycopg.connect(pg_url, autocommit=True) as first,
        psycopg.connect(pg_url, autocommit=True) as second,
    ):
        at_version(first, schema, latest_version() - 1)
        applied: list[list[str]] = []
        with first.transaction():
            first.execute(load_queries(schema)["migrate_lock"])  # the first upgrade's lock
            thread = threading.Thread(target=lambda: applied.append(migrate(second, schema)))
            thread.start()
            peek = Peek(pg_url, schema)
            peek.wait_for_lock(second.info.backend_pid, "the second upgrade did not wait")
            peek.conn.close()
            for migration in load_migrations()[latest_version() - 1 :]:
                first.execute(migration.composed(schema))
                first.execute(
                    load_queries(schema)["record_version"], {"version": migration.version}
                )
        thread.join(10)
        assert applied == [[]]
        assert current_version(first, schema) == latest_version()
