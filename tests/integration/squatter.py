"""A role that can merely connect, holding advisory keys pgq might wait on.

Postgres checks no privilege on advisory locks, and pgq's keys are computable from public
strings: any such role can take them first. pgq must not wait on them (DESIGN.md, Trust).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

T = TypeVar("T")

# Only so that a hung run fails instead of hanging the suite; a run that waits on the
# squatter is caught the moment it waits (the watch below), not at this bound.
GIVE_UP = 60.0


@dataclass
class Squatter:
    role: str
    conn: psycopg.Connection[Any]
    admin: psycopg.Connection[Any]

    @property
    def pid(self) -> int:
        return int(self.conn.info.backend_pid)

    def hold(self, *keys: int) -> None:
        """Take ``keys`` for the session (until it ends): what any connecting role can do."""
        for key in keys:
            row = self.conn.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()
            assert row == (True,), f"the squatter could not take key {key}"

    def blocked(self) -> list[tuple[int, str]]:
        """The sessions waiting on a lock this squatter holds, and what they run."""
        rows = self.admin.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            [self.pid],
        ).fetchall()
        return [(int(pid), str(query)) for pid, query in rows]

    def beside(self, what: str, work: Callable[[], T]) -> T:
        """Run ``work`` while the squatter holds its keys; fail the moment anything waits
        on it (then end the squatter's session, so the waiting thread can finish)."""
        outcome: list[Any] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(work())
            except BaseException as exc:  # handed to the test below
                failure.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + GIVE_UP
        waiting: list[tuple[int, str]] = []
        while thread.is_alive() and time.monotonic() < deadline:
            waiting = self.blocked()
            if waiting:
                break
            thread.join(0.02)
        if thread.is_alive():
            self.admin.execute("SELECT pg_terminate_backend(%s)", [self.pid])
            thread.join(GIVE_UP)
            pytest.fail(f"{what} waited on a lock a CONNECT-only role holds: {waiting}")
        if failure:
            raise failure[0]
        return outcome[0]  # type: ignore[no-any-return]


@contextmanager
def squatter(pg_url: str) -> Iterator[Squatter]:
    """A fresh LOGIN role granted nothing but CONNECT on the test database, connected."""
    role = f"pgq_t_squat_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(pg_url)
    ident = sql.Identifier(role)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        try:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test role cannot create roles")
        try:
            admin.execute(
                sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                    sql.Identifier(str(params["dbname"])), ident
                )
            )
            url = make_conninfo(pg_url, user=role, password="", application_name="squatter")
            with psycopg.connect(url, autocommit=True) as conn:
                yield Squatter(role, conn, admin)
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))
