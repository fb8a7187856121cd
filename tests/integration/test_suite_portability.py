"""The suite runs on any Postgres it is pointed at, as any superuser, in a database of its own.

A pytest run in a subprocess gets ``PGQ_TEST_URL`` naming a superuser that is not
``postgres`` and a database that is not ``test``; the tests that name the owner of a schema
pass there, the run works in a database it created and leaves none behind, and it reports
how many sessions it held at once.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.pg import database_prefix, with_database

ROOT = Path(__file__).resolve().parents[2]


def as_user(pg_url: str, user: str, password: str) -> str:
    parts = urlsplit(pg_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{quote(user)}:{quote(password)}@{host}"))


@pytest.fixture
def superuser(pg_url: str) -> Iterator[tuple[str, str]]:
    """A superuser of another name: its name and a libpq URL as it to this session's database."""
    name = "pgq_t_su_" + uuid.uuid4().hex[:8]
    password = secrets.token_hex(8)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} SUPERUSER LOGIN PASSWORD {}").format(
                sql.Identifier(name), sql.Literal(password)
            )
        )
    try:
        yield name, as_user(pg_url, name, password)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            for (db,) in admin.execute(
                "SELECT datname FROM pg_database WHERE pg_get_userbyid(datdba) = %s", [name]
            ).fetchall():
                admin.execute(
                    sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(str(db)))
                )
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def databases_of(pg_url: str, owner: str) -> list[Any]:
    with psycopg.connect(pg_url) as conn:
        return conn.execute(
            "SELECT datname FROM pg_database WHERE pg_get_userbyid(datdba) = %s", [owner]
        ).fetchall()


def test_the_session_database_is_its_own(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    assert row[0] != "test"
    assert str(row[0]).startswith(database_prefix())


def test_another_superuser_and_database_pass_and_leave_no_database(
    pg_url: str, superuser: tuple[str, str]
) -> None:
    name, url = superuser
    # The run is pointed at a database that exists but is not the one it works in.
    given = with_database(url, "postgres")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(PGQ_TEST_URL=given, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:xdist",  # in this process: its meter's report is the one read below
            "tests/integration/test_bad_input.py",
            "-k",
            "foreign_schema",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert re.search(r"\b2 passed\b", out), out
    meter = re.search(r"pgq: at most (\d+) sessions on the test database at once, within", out)
    assert meter, out
    # At most the budget. (Not "at least one": the meter samples every 50 ms, and two tests
    # done in under a second may open and close their sessions between two samples.)
    assert int(meter.group(1)) <= 30, out
    assert databases_of(pg_url, name) == []
