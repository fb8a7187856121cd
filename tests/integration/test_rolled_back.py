"""A statement the server rolls back whole (SQLSTATE class 40: a deadlock with another
session, a serialization failure) took no effect, so pgq sends it again: acks, releases
and renewals (fenced), idempotent work, and the claim, a statement of its own. Other
work that is not known to be one statement is not retried. The errors here are raised
by the server itself, with the SQLSTATE a deadlock victim gets."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pg_transport.db.pool import Connector
from pg_transport.db.retry import fenced, rolled_back

DEADLOCK = (
    "DO $$ BEGIN RAISE EXCEPTION 'deadlock detected (test)' "
    "USING ERRCODE = 'deadlock_detected'; END $$"
)
SERIALIZATION = (
    "DO $$ BEGIN RAISE EXCEPTION 'could not serialize (test)' "
    "USING ERRCODE = 'serialization_failure'; END $$"
)


def flaky(fail_with: str, failures: int, calls: list[int]) -> Any:
    def work(conn: psycopg.Connection[Any]) -> int:
        calls.append(1)
        if len(calls) <= failures:
            conn.execute(fail_with)
        row = conn.execute("SELECT 42").fetchone()
        assert row is not None
        return int(row[0])

    return work


@pytest.mark.parametrize("error", [DEADLOCK, SERIALIZATION], ids=["deadlock", "serialization"])
@pytest.mark.parametrize(
    "kind",
    [
        {"idempotent": True},
        {"idempotent": True, "retry": fenced(5.0)},
        {"idempotent": False, "statement": True},
    ],
    ids=["idempotent", "fenced", "statement"],
)
def test_work_rolled_back_whole_is_sent_again(
    pg_url: str, error: str, kind: dict[str, Any]
) -> None:
    connector = Connector(pg_url)
    calls: list[int] = []
    try:
        assert connector.run(flaky(error, 1, calls), **kind) == 42
    finally:
        connector.close()
    assert len(calls) == 2


def test_other_work_is_not_retried(pg_url: str) -> None:
    connector = Connector(pg_url)
    calls: list[int] = []
    try:
        with pytest.raises(psycopg.errors.DeadlockDetected) as raised:
            connector.run(flaky(DEADLOCK, 1, calls), idempotent=False)
    finally:
        connector.close()
    assert len(calls) == 1 and rolled_back(raised.value)


def test_a_statement_rolled_back_again_and_again_gives_up(pg_url: str) -> None:
    connector = Connector(pg_url)
    calls: list[int] = []
    try:
        with pytest.raises(psycopg.errors.DeadlockDetected):
            connector.run(flaky(DEADLOCK, 100, calls), idempotent=False, statement=True)
    finally:
        connector.close()
    assert len(calls) == 5  # the first try, then ROLLED_BACK's four
