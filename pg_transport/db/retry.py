"""Which failures are worth another try, and how many: every retry policy of pgq.

One place decides what a dead connection is (:func:`is_dead_connection`): an
``OperationalError`` or ``InterfaceError`` whose connection is gone (a restart, a pooler
reaping idle sessions, ``pg_terminate_backend``), or a server going away. A refusal
(wrong password, missing database) is not: retrying cannot help. Each policy is a named
tenacity ``Retrying`` factory, and :func:`attempt` is the one way to run work under one
(the first try outside tenacity, whose bookkeeping costs more than a publish's Python).

- :data:`ONCE`: idempotent work (or work a key makes so), once more on a fresh
  connection after a dead one.
- :func:`fenced` (:data:`FENCED` with the default window): ack, release and renew,
  through an outage as long as a failover: they are safe to land late (the lease fences
  them), and an ack given up on is a duplicate run later. The window follows the
  deployment (the ``fenced_retry_window`` option, never shorter than the leases).
- :data:`TRANSIENT`: work in a worker's hooks (a barrier's), which has no caller to
  report to: with backoff, for a while.
- :data:`CREATED_MEANWHILE`: creating the schema, which another process created first
  (its commit made ours a duplicate): look again, now that it exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import psycopg
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from pg_transport.errors import BrokerUnavailable, BrokerUnreachable

__all__ = [
    "CREATED_MEANWHILE",
    "FENCED",
    "FENCED_RETRY_SECONDS",
    "ONCE",
    "ROLLED_BACK",
    "TRANSIENT",
    "Policy",
    "attempt",
    "fenced",
    "is_dead_connection",
    "is_refusal",
    "rolled_back",
]

T = TypeVar("T")

# SQLSTATEs of a server that is going away or not accepting us any more.
_DEAD_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})

# Connection-phase errors carry no SQLSTATE (libpq reports them as text), so a
# refusal is recognised by the server's own words. Anything not recognised counts
# as transient: a localised server message then means "retry", as before.
_REFUSALS = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "does not exist",  # database or role
    "is not permitted to log in",
    "permission denied for database",
)


def is_dead_connection(exc: BaseException, conn: psycopg.Connection[Any] | None = None) -> bool:
    """True when ``exc`` means the connection is gone and a fresh one may succeed."""
    if conn is not None and conn.closed:
        return True
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate
        return state is None or state.startswith("08") or state in _DEAD_SQLSTATES
    return False


def is_refusal(exc: BaseException) -> bool:
    """True when the server answered a connection attempt with a permanent no."""
    text = str(exc)
    return "FATAL" in text and any(words in text for words in _REFUSALS)


def rolled_back(exc: BaseException) -> bool:
    """True when the server rolled the statement's transaction back whole (a deadlock
    with another session, a serialization failure: SQLSTATE class 40): nothing of it
    took effect and the session is still usable, so sending it again is safe."""
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("40")


def _send_again(exc: BaseException, *, unreachable: bool) -> bool:
    """A dead connection, or a transaction the server rolled back whole: the work may be
    sent again on a fresh (or the same) session. With ``unreachable``, also a Postgres
    that did not answer at all (:class:`BrokerUnreachable`): worth waiting out for work
    that keeps trying through an outage, not for work tried once more."""
    return (
        is_dead_connection(exc)
        or rolled_back(exc)
        or (unreachable and isinstance(exc, BrokerUnreachable))
    )


_dead_or_rolled_back = partial(_send_again, unreachable=False)
_dead_or_unreachable = partial(_send_again, unreachable=True)


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, BrokerUnavailable) or is_dead_connection(exc)


@dataclass(frozen=True)
class Policy:
    """A named retry policy: which failures, and a tenacity ``Retrying`` for them."""

    name: str
    retries: Callable[[BaseException], bool]
    make: Callable[[], Retrying]


ONCE = Policy(
    "once",
    _dead_or_rolled_back,
    lambda: Retrying(
        retry=retry_if_exception(_dead_or_rolled_back),
        stop=stop_after_attempt(1),
        reraise=True,
    ),
)

# How long an ack, release or renewal keeps trying through an outage, by default. A
# restart is over in well under a second; a failover is not: a failover manager promotes
# a standby only once the primary's leader key expired and it next looked (Patroni's
# defaults, ttl 30 s and loop_wait 10 s: up to about 40 s after the crash). A fenced
# statement landing late is safe (its lease fences it); one given up on is a duplicate
# run. The transport never uses less than its visibility timeout (the lease): a
# promotion within the lease never costs a duplicate.
FENCED_RETRY_SECONDS = 60.0


def fenced(seconds: float = FENCED_RETRY_SECONDS) -> Policy:
    """The policy of fenced statements, retrying dead connections for ``seconds``."""
    return Policy(
        f"fenced-{seconds:g}s",
        _dead_or_unreachable,
        lambda: Retrying(
            retry=retry_if_exception(_dead_or_unreachable),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(seconds),
            reraise=True,
        ),
    )


FENCED = fenced()

# A statement rolled back by a deadlock or a serialization failure (one transaction of
# its own, so nothing of it took effect): tried again at once, a few times.
ROLLED_BACK = Policy(
    "rolled back",
    rolled_back,
    lambda: Retrying(
        retry=retry_if_exception(rolled_back),
        wait=wait_exponential(multiplier=0.01, max=0.2),
        stop=stop_after_attempt(4),
        reraise=True,
    ),
)

TRANSIENT_RETRY_SECONDS = 30.0
TRANSIENT = Policy(
    "transient",
    _transient,
    lambda: Retrying(
        retry=retry_if_exception(_transient),
        stop=stop_after_delay(TRANSIENT_RETRY_SECONDS),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        reraise=True,
    ),
)


# Two first connects create the schema at once: the loser waits on the catalog's unique
# index for the winner's commit, then fails as a duplicate. Once the winner committed,
# the next look finds its work; a few more cover a third process or a partial schema.
_DUPLICATES = (
    psycopg.errors.UniqueViolation,
    psycopg.errors.DuplicateSchema,
    psycopg.errors.DuplicateTable,
    psycopg.errors.DuplicateObject,
)


def _created_meanwhile(exc: BaseException) -> bool:
    return isinstance(exc, _DUPLICATES)


CREATED_MEANWHILE = Policy(
    "created-meanwhile",
    _created_meanwhile,
    lambda: Retrying(
        retry=retry_if_exception(_created_meanwhile),
        stop=stop_after_attempt(3),
        reraise=True,
    ),
)


def attempt(policy: Policy | None, work: Callable[[], T]) -> T:
    """Run ``work``; under ``policy`` (None: no retry), try again as it says when a try
    fails with one of its failures. The first try runs outside tenacity: nearly every
    statement succeeds the first time, and building tenacity's state costs more than a
    publish's Python does."""
    if policy is None:
        return work()
    try:
        return work()
    except BaseException as exc:
        if not policy.retries(exc):
            raise
    for retrying in policy.make():
        with retrying:
            return work()
    raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover
