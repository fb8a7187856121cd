"""pgq's prepared statements survive psycopg's DEALLOCATE ALL on a shared session.

psycopg deallocates every prepared statement of a session where it prepared some of its
own once a DROP, ALTER or ROLLBACK ran there; pgq's statements, prepared through libpq
beside psycopg's, go with them. A process's pools are shared by all its kombu
connections, so a session that prepared pgq's statements may meet such a command.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pg_transport.db.wire import Statement, run_apart


@pytest.fixture
def conn(pg_url: str) -> Any:
    with psycopg.connect(pg_url, autocommit=True, prepare_threshold=0) as c:
        yield c


def deallocate_behind_our_back(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SELECT 1")  # prepared by psycopg (threshold 0)
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS t_gone (x int)")
    conn.execute("DROP TABLE t_gone")  # psycopg: DEALLOCATE ALL with its next query
    conn.execute("SELECT 2")
    rows = conn.execute(
        "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'pgq%'"
    ).fetchone()
    assert rows == (0,)  # pgq's are gone


def test_a_statement_is_prepared_again_when_it_was_deallocated(
    conn: psycopg.Connection[Any],
) -> None:
    plus = Statement("plus", "SELECT %(n)s::int + 1")
    assert plus.execute(conn, {"n": 1}, prepare=True) == [(b"2",)]
    deallocate_behind_our_back(conn)
    assert plus.execute(conn, {"n": 2}, prepare=True) == [(b"3",)]


def test_steps_apart_are_prepared_again_when_they_were_deallocated(
    conn: psycopg.Connection[Any],
) -> None:
    one = Statement("one", "SELECT %(n)s::int")
    two = Statement("two", "SELECT %(n)s::int * 2")
    steps = [(one, {"n": 3}), (two, {"n": 3})]
    assert run_apart(conn, steps, prepare=True) == [[(b"3",)], [(b"6",)]]
    deallocate_behind_our_back(conn)
    assert run_apart(conn, steps, prepare=True) == [[(b"3",)], [(b"6",)]]
