"""Which failures each retry policy sends again: one predicate decides for ONCE and the
fenced policies, differing only in whether an unreachable Postgres is waited out."""

from __future__ import annotations

import psycopg
import pytest

from pg_transport.db.retry import FENCED, ONCE, fenced
from pg_transport.errors import BrokerRefused, BrokerUnreachable

# (failure, sent again by ONCE, by a fenced policy)
CASES = [
    (psycopg.OperationalError("server closed the connection unexpectedly"), True, True),
    (psycopg.errors.AdminShutdown("terminating connection"), True, True),
    (psycopg.InterfaceError("the connection is closed"), True, True),
    (psycopg.errors.SerializationFailure("could not serialize access"), True, True),
    (psycopg.errors.DeadlockDetected("deadlock detected"), True, True),
    (BrokerUnreachable("connection refused"), False, True),
    (BrokerRefused("password authentication failed"), False, False),
    (psycopg.errors.UniqueViolation("duplicate key"), False, False),
    (psycopg.errors.InsufficientPrivilege("permission denied"), False, False),
    (ValueError("not a database failure"), False, False),
]


@pytest.mark.parametrize(("exc", "once", "fenced_too"), CASES, ids=lambda c: type(c).__name__)
def test_once_and_fenced_differ_only_in_waiting_out_an_unreachable_postgres(
    exc: BaseException, once: bool, fenced_too: bool
) -> None:
    assert ONCE.retries(exc) is once
    assert FENCED.retries(exc) is fenced_too
    assert fenced(5.0).retries(exc) is fenced_too
