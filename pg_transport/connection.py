"""Connecting to Postgres, recognising dead connections, and retrying on them.

One place decides what a dead connection is (:func:`is_dead_connection`); the
retry policy for idempotent statements (:data:`retry_idempotent`) is tenacity's,
and :class:`Connector` hands out autocommit connections, discarding broken ones
instead of trusting them again.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import conninfo as pg_conninfo
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from pg_transport.errors import BrokerRefused, BrokerUnreachable
from pg_transport.secrets import mask_url, parse_url

__all__ = [
    "Connector",
    "is_dead_connection",
    "mask_url",  # re-exported from pg_transport.secrets, where it lives
    "retry_idempotent",
    "url_to_conninfo",
]

logger = logging.getLogger("pg_transport.connection")

T = TypeVar("T")

# Built-in names first and only: pgq's tables are always named with their schema.
PINNED_SEARCH_PATH = "-c search_path=pg_catalog,pg_temp"
DEFAULT_CONNECT_TIMEOUT = 10

# SQLSTATEs of a server that is going away or not accepting us any more.
_DEAD_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})


def url_to_conninfo(url: str | None) -> str:
    """Turn ``pgq://…`` into a libpq connection string; ``pgq://`` means libpq defaults.

    The URL is parsed by libpq (see :func:`pg_transport.secrets.parse_url`), once:
    what connects is what was checked, and what is shown is built from the same parse.
    """
    return pg_conninfo.make_conninfo("", **parse_url(url))


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


def is_refusal(exc: BaseException) -> bool:
    """True when the server answered a connection attempt with a permanent no."""
    text = str(exc)
    return "FATAL" in text and any(words in text for words in _REFUSALS)


def retry_idempotent() -> Retrying:
    """After a first attempt failed on a dead connection: once more, on a fresh one."""
    return Retrying(
        retry=retry_if_exception(is_dead_connection),
        stop=stop_after_attempt(1),
        reraise=True,
    )


# A server restart refuses connections for well under a second ("the database system
# is shutting down", then "connection refused"); one immediate retry lands inside it.
FENCED_RETRY_SECONDS = 5.0


def _dead_or_unreachable(exc: BaseException) -> bool:
    return is_dead_connection(exc) or isinstance(exc, BrokerUnreachable)


def retry_fenced() -> Retrying:
    """Retry fenced statements (ack, release, renew) through a short outage.

    They are safe to land late: the read_ct fence keeps a stale one from touching a
    redelivery. An ack given up on, instead, is a duplicate run once the lease lapses.
    """
    return Retrying(
        retry=retry_if_exception(_dead_or_unreachable),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        stop=stop_after_delay(FENCED_RETRY_SECONDS),
        reraise=True,
    )


# --- fork safety -----------------------------------------------------------
# A child process must never talk on, or close, a socket it inherited: closing
# sends a Terminate message that ends the parent's session. After fork we point
# every inherited connection's descriptor at /dev/null, so whatever the child
# does with those objects later cannot reach the server.
_live: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()


def _detach_inherited() -> None:
    conns = list(_live)
    if not conns:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for conn in conns:
            try:
                fd = conn.pgconn.socket
            except psycopg.OperationalError:
                continue
            os.dup2(devnull, fd)
            conn._pgq_inherited = True  # type: ignore[attr-defined]
    finally:
        os.close(devnull)
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_inherited)


def is_inherited(conn: psycopg.Connection[Any]) -> bool:
    return bool(getattr(conn, "_pgq_inherited", False))


class Connector:
    """Autocommit connections for one conninfo, reused while they are healthy."""

    def __init__(
        self,
        conninfo: str,
        *,
        display_url: str = "",
        max_idle: int = 8,
        application_name: str = "pgq",
        prepare_threshold: int | None = 5,
        setup: tuple[str, ...] = (),
        pin_search_path: bool = True,
    ) -> None:
        """``setup``: statements every new session runs first (session settings).

        ``pin_search_path``: every session starts with ``search_path`` set to
        ``pg_catalog, pg_temp`` (a startup parameter: no round trip), whatever the
        role's own setting, so that no function or operator someone created in
        ``public`` can stand in for a built-in one in pgq's statements (they also name
        their functions by schema: a transaction pooler, which refuses startup options
        and shares sessions, must not be given this)."""
        self.conninfo = conninfo
        self.display_url = display_url or "pgq://"
        self.max_idle = max_idle
        self.prepare_threshold = prepare_threshold
        self.setup = setup
        given = pg_conninfo.conninfo_to_dict(conninfo)
        self._application_name = None if "application_name" in given else application_name
        self._kwargs: dict[str, Any] = {}
        if "connect_timeout" not in given:
            self._kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT
        if pin_search_path:
            own = str(given.get("options") or "")
            self._kwargs["options"] = f"{own} {PINNED_SEARCH_PATH}".strip()
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.closed = False

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        """A new connection; failures become :class:`BrokerUnavailable` naming the problem."""
        try:
            kwargs = dict(self._kwargs)
            if self._application_name:
                # The pid tells an operator (and pg_terminate_backend) whose session it is.
                kwargs["application_name"] = f"{self._application_name}:{os.getpid()}"
            conn = psycopg.connect(self.conninfo, autocommit=autocommit, **kwargs)
        except psycopg.Error as exc:
            kind = BrokerRefused if is_refusal(exc) else BrokerUnreachable
            raise kind(
                f"cannot connect to Postgres at {self.display_url}: {describe(exc)}"
            ) from exc
        conn.prepare_threshold = self.prepare_threshold
        _live.add(conn)
        try:
            for statement in self.setup:
                conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    def _take(self) -> psycopg.Connection[Any]:
        with self._lock:
            if self._pid != os.getpid():
                self._idle.clear()  # inherited: detached at fork, never reused
                self._pid = os.getpid()
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and not is_inherited(conn):
                    return conn
        return self.connect()

    def _give_back(self, conn: psycopg.Connection[Any]) -> None:
        healthy = (
            not conn.closed
            and not is_inherited(conn)
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        )
        if healthy and not self.closed:
            with self._lock:
                if len(self._idle) < self.max_idle and self._pid == os.getpid():
                    self._idle.append(conn)
                    return
        if not is_inherited(conn):
            conn.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self._take()
        try:
            yield conn
        except BaseException as exc:
            if is_dead_connection(exc, conn):
                if not conn.closed:
                    conn.close()
                # Whatever killed this one (a restart, a pooler reaping idle
                # sessions) most likely killed its idle siblings too: the retry
                # must get a fresh connection, not the next corpse.
                self._discard_idle()
            self._give_back(conn)
            raise
        self._give_back(conn)

    def run(
        self,
        work: Callable[[psycopg.Connection[Any]], T],
        *,
        idempotent: bool,
        fenced: bool = False,
    ) -> T:
        """Run ``work`` on a pooled connection; idempotent work is retried once,
        fenced work (see :func:`retry_fenced`) through a short outage."""
        if not idempotent:
            with self.connection() as conn:
                return work(conn)
        # The first attempt outside tenacity: building its retry state costs more than
        # a publish's Python does, and nearly every statement succeeds the first time.
        try:
            with self.connection() as conn:
                return work(conn)
        except BaseException as exc:
            if not (_dead_or_unreachable(exc) if fenced else is_dead_connection(exc)):
                raise
        for attempt in retry_fenced() if fenced else retry_idempotent():
            with attempt, self.connection() as conn:
                return work(conn)
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    def _discard_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            if not is_inherited(conn):
                conn.close()

    def close(self) -> None:
        self.closed = True
        self._discard_idle()


def describe(exc: BaseException) -> str:
    """A one-line description of a driver error, without the conninfo in it."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # libpq reports one "connection to server … failed: reason" line per host tried.
    return "; ".join(dict.fromkeys(lines))
