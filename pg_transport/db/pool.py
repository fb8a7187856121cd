"""A capped pool of autocommit connections for one conninfo, safe across fork.

:class:`Connector` hands out autocommit connections, reusing healthy ones: at most
``max_size`` at once (a caller waits for one to come back, up to ``wait_timeout``), none
older than ``max_lifetime`` (a server's memory and a pooler's view of a session do not
grow without end), none kept idle longer than ``idle_timeout`` (a process that stopped
publishing gives its sessions back to the server; one reaper thread per process closes
them), and never one whose transaction is not idle, that died, or that this process
inherited across a fork. :func:`shared` hands every user in a process with the same
settings the same connector, so a process holds one pool however many kombu
connections it opens. Dead-connection classification and retries are
:mod:`pg_transport.db.retry`'s; :meth:`Connector.run` runs work under one of its policies.

Why not psycopg_pool (pgq depends on ``psycopg[binary]`` without its ``pool`` extra).
Measured on 2026-11-28 (psycopg_pool 3.3.3, psycopg 3.3.9, a loaded 2-core machine):

* fork: a connection idle in a ``ConnectionPool`` when the process forks is handed to
  the child, which runs its statement on the parent's server session (one socket, two
  processes): a prefork worker's children would corrupt their parent's sessions. Here
  the child's inherited sockets are pointed at /dev/null at fork and the pool starts
  empty in the child (tests/integration/test_pool.py proves it);
* threads: each ``ConnectionPool`` starts four (a scheduler and three workers); a pgq
  process holds several pools (publishing, housekeeping, results, the barrier) and a
  prefork worker has one process per child: here one reaper thread serves every pool
  of a process, and sleeps while none keeps an idle session;
* a checkout and return of an idle connection took 1.6-1.7 times as long there
  (benchmarks/results/2026-11-28-pool-choice.md);
* what pgq needs of a session would be callbacks around it anyway: whose session it
  is (:func:`is_own`), the pinned ``search_path`` checked at connect (a pooler in the
  way: :func:`pooler_detected`), a foreign prepared statement seen as a pooler,
  dead-session eviction of the idle siblings (:meth:`Connector.discard_idle`), a cap
  on idle sessions below the cap on sessions (``max_idle``), and the same ``connect``
  used alone by the listeners. The pool proper (take, give back, reap) is ~150 lines.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import monotonic
from typing import Any, TypeVar

import psycopg
from psycopg import conninfo as pg_conninfo

from pg_transport.db.retry import (
    ONCE,
    ROLLED_BACK,
    Policy,
    attempt,
    is_dead_connection,
    is_refusal,
)
from pg_transport.db.url import mask_url, parse_url
from pg_transport.errors import (
    BrokerRefused,
    BrokerUnavailable,
    BrokerUnreachable,
    PoolerDetected,
)

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_LIFETIME",
    "DEFAULT_MAX_SIZE",
    "PINNED_SEARCH_PATH",
    "Connector",
    "describe",
    "is_own",
    "mask_url",
    "pooler_detected",
    "process_name",
    "set_process_role",
    "shared",
    "url_to_conninfo",
]

logger = logging.getLogger("pg_transport.db")

T = TypeVar("T")

# Built-in names first and only: pgq's tables are always named with their schema.
PINNED_SEARCH_PATH = "-c search_path=pg_catalog,pg_temp"
#: The pinned path as the server shows it (without spaces): else the option never reached it.
PINNED_SHOWN = "pg_catalog,pg_temp"
# What PgBouncer answers a startup option it does not pass on.
_POOLER_REFUSAL = "unsupported startup parameter"
# A prepared statement of this session missing, or one of another session's present:
# the session is not one server session (transaction pooling).
_FOREIGN_SESSION_SQLSTATES = frozenset({"26000", "42P05"})
DEFAULT_CONNECT_TIMEOUT = 10
#: Pooled connections of one Connector at most (in use and idle).
DEFAULT_MAX_SIZE = 16
#: Seconds after which a pooled connection is closed rather than reused.
DEFAULT_MAX_LIFETIME = 1800.0
#: Seconds a pooled connection may stay idle before the reaper closes it.
DEFAULT_IDLE_TIMEOUT = 30.0


def url_to_conninfo(url: str | None) -> str:
    """Turn ``pgq://…`` into a libpq connection string; ``pgq://`` means libpq defaults.

    The URL is parsed by libpq (see :func:`pg_transport.db.url.parse_url`), once:
    what connects is what was checked, and what is shown is built from the same parse.
    """
    params = parse_url(url)
    for key, value in KEEPALIVES.items():
        params.setdefault(key, value)
    return pg_conninfo.make_conninfo("", **params)


#: What every pgq session asks of TCP unless its URL says otherwise: a peer that vanishes
#: without closing (power loss, a partition, a failed-over host) is noticed within about
#: 30 s — an idle session after 15 s of silence and three unanswered probes 5 s apart;
#: a session with data unacknowledged for 30 s — instead of the operating system's
#: default of two hours (idle) or ~15 minutes (retransmissions). Unix sockets ignore them.
KEEPALIVES: dict[str, str] = {
    "keepalives": "1",
    "keepalives_idle": "15",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


# --- fork safety -----------------------------------------------------------
# A child process must never talk on, or close, a socket it inherited: closing
# sends a Terminate message that ends the parent's session. After fork we point
# every inherited connection's descriptor at /dev/null, so whatever the child
# does with those objects later cannot reach the server.
#: What this process is to pgq (``worker:<node name>``), appended to the
#: application_name of the sessions it opens from then on; None for a publisher.
_process_role: str | None = None


def set_process_role(role: str, node: str = "") -> None:
    """Name this process's new sessions ``<name>:<pid>:<role>:<node>``, so that an
    operator (the console's processes page) sees which worker node a session is of."""
    global _process_role
    _process_role = f"{role}:{node}" if node else role


def process_name(name: str) -> str:
    """The application_name of a session this process opens for ``name`` (``pgq``,
    ``pgq-results``, …): ``<name>:<pid>``, then ``:<role>:<node>`` once set. Postgres
    keeps 63 bytes of it and shows any other character than printable ASCII as ``?``."""
    base = f"{name}:{os.getpid()}"
    return f"{base}:{_process_role}" if _process_role else base


_live: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
_inherited: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()


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
            _inherited.add(conn)
    finally:
        os.close(devnull)
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_inherited)


def is_inherited(conn: psycopg.Connection[Any]) -> bool:
    return conn in _inherited


def is_own(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn`` is a session pgq opened (a :class:`Connector`'s) in this process,
    not an application's: pgq sets nothing on an application's session, not even a
    prepared statement, that outlives its statement."""
    return conn in _live


class Connector:
    """Autocommit connections for one conninfo, reused while they are healthy."""

    def __init__(
        self,
        conninfo: str,
        *,
        display_url: str = "",
        max_idle: int = 8,
        max_size: int = DEFAULT_MAX_SIZE,
        max_lifetime: float = DEFAULT_MAX_LIFETIME,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        wait_timeout: float = DEFAULT_CONNECT_TIMEOUT,
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
        self.max_size = max_size
        self.max_lifetime = max_lifetime
        self.idle_timeout = idle_timeout
        self.wait_timeout = wait_timeout
        self.prepare_threshold = prepare_threshold
        self.setup = setup
        self.pin_search_path = pin_search_path
        given = pg_conninfo.conninfo_to_dict(conninfo)
        self._application_name = None if "application_name" in given else application_name
        self._kwargs: dict[str, Any] = {}
        if "connect_timeout" not in given:
            self._kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT
        if pin_search_path:
            own = str(given.get("options") or "")
            self._kwargs["options"] = f"{own} {PINNED_SEARCH_PATH}".strip()
        self._idle: list[psycopg.Connection[Any]] = []
        # Pooled connections out and idle, and when each was opened.
        self._size = 0
        self._born: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        # When each idle connection was given back.
        self._idle_since: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._pid = os.getpid()
        self.closed = False

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        """A new connection; failures become :class:`BrokerUnavailable` naming the problem."""
        try:
            kwargs = dict(self._kwargs)
            if self._application_name:
                # The pid tells an operator (and pg_terminate_backend) whose session it is.
                kwargs["application_name"] = process_name(self._application_name)
            conn = psycopg.connect(self.conninfo, autocommit=autocommit, **kwargs)
        except psycopg.Error as exc:
            if self.pin_search_path and _POOLER_REFUSAL in str(exc):
                raise pooler_detected(self.display_url, describe(exc)) from exc
            kind = BrokerRefused if is_refusal(exc) else BrokerUnreachable
            raise kind(
                f"cannot connect to Postgres at {self.display_url}: {describe(exc)}"
            ) from exc
        conn.prepare_threshold = self.prepare_threshold
        _live.add(conn)
        try:
            if self.pin_search_path:
                self._check_pinned(conn)
            for statement in self.setup:
                conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_pinned(self, conn: psycopg.Connection[Any]) -> None:
        """The pinned ``search_path`` is in effect, or something between pgq and the
        server dropped the startup option that set it: a pooler (PgBouncer accepts
        ``options`` only to ignore it), whose sessions are not pgq's own."""
        row = conn.execute("SHOW search_path").fetchone()
        shown = str(row[0]) if row else ""
        if shown.replace(" ", "") != PINNED_SHOWN:
            raise pooler_detected(
                self.display_url,
                f"the search_path pgq sets at connect did not reach the server (it is {shown!r})",
            )

    def _take(self) -> psycopg.Connection[Any]:
        deadline = monotonic() + self.wait_timeout
        with self._lock:
            if self._pid != os.getpid():
                # Inherited: detached at fork, never reused, and not ours to count.
                self._idle.clear()
                self._size = 0
                self._pid = os.getpid()
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.closed and not is_inherited(conn):
                        return conn
                    self._size -= 1
                if self._size < self.max_size:
                    self._size += 1  # taken now, opened below (outside the lock)
                    break
                left = deadline - monotonic()
                if left <= 0 or not self._returned.wait(left):
                    raise BrokerUnavailable(
                        f"all {self.max_size} connections to {self.display_url} of this "
                        f"process's pool were in use for {self.wait_timeout:.0f} s"
                    )
        try:
            conn = self.connect()
        except BaseException:
            self._forget(None)
            raise
        self._born[conn] = monotonic()
        return conn

    def _give_back(self, conn: psycopg.Connection[Any]) -> None:
        born = self._born.get(conn, 0.0)
        healthy = (
            not conn.closed
            and not is_inherited(conn)
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            and conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
            and monotonic() - born < self.max_lifetime
        )
        if healthy and not self.closed:
            with self._lock:
                kept = len(self._idle) < self.max_idle and self._pid == os.getpid()
                if kept:
                    self._idle.append(conn)
                    self._idle_since[conn] = monotonic()
                    self._returned.notify()
            if kept:
                _reaper.watch(self)  # (outside the pool's lock: the reaper takes it)
                return
        if not is_inherited(conn):
            conn.close()
        self._forget(conn)

    def _forget(self, conn: psycopg.Connection[Any] | None) -> None:
        """A pooled connection (or the place taken for one) is gone: room for another."""
        with self._lock:
            if self._pid == os.getpid():
                self._size = max(self._size - 1, 0)
            self._returned.notify()
        if conn is not None:
            self._born.pop(conn, None)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self._take()
        try:
            yield conn
        except BaseException as exc:
            if (
                self.prepare_threshold is not None
                and isinstance(exc, psycopg.Error)
                and exc.sqlstate in _FOREIGN_SESSION_SQLSTATES
            ):
                # A statement pgq prepared on this session is gone, or one it is about
                # to prepare is there already: statements of one session run on
                # different server sessions. That is a transaction pooler.
                conn.close()
                self._give_back(conn)
                raise pooler_detected(self.display_url, describe(exc)) from exc
            if is_dead_connection(exc, conn):
                if not conn.closed:
                    conn.close()
                # Whatever killed this one (a restart, a pooler reaping idle
                # sessions) most likely killed its idle siblings too: the retry
                # must get a fresh connection, not the next corpse.
                self.discard_idle()
            self._give_back(conn)
            raise
        self._give_back(conn)

    def run(
        self,
        work: Callable[[psycopg.Connection[Any]], T],
        *,
        idempotent: bool,
        retry: Policy | None = None,
        statement: bool = False,
    ) -> T:
        """Run ``work`` on a pooled connection: idempotent work under ``retry`` (default:
        the ``ONCE`` policy; fenced work, ack, release and renew, under its ``fenced``
        policy: :mod:`pg_transport.db.retry`); other work that is one statement in a
        transaction of its own (``statement``) again only when the server rolled it back
        whole (``ROLLED_BACK``: a deadlock); anything else once."""
        if idempotent:
            policy: Policy | None = retry or ONCE
        else:
            policy = ROLLED_BACK if statement else None

        def once() -> T:
            with self.connection() as conn:
                return work(conn)

        return attempt(policy, once)

    def discard_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            if not is_inherited(conn):
                conn.close()
            self._forget(conn)

    @property
    def idle_count(self) -> int:
        """Connections kept idle in the pool now."""
        with self._lock:
            return len(self._idle)

    def reap(self) -> None:
        """Close the idle connections kept past ``idle_timeout`` or ``max_lifetime``."""
        now = monotonic()
        with self._lock:
            if self._pid != os.getpid():
                return
            stale = [
                c
                for c in self._idle
                if now - self._idle_since.get(c, now) >= self.idle_timeout
                or now - self._born.get(c, now) >= self.max_lifetime
            ]
            self._idle = [c for c in self._idle if c not in stale]
        for conn in stale:
            if not is_inherited(conn):
                conn.close()
            self._forget(conn)

    def close(self) -> None:
        self.closed = True
        self.discard_idle()


class _Reaper:
    """One daemon thread per process that closes pooled connections idle too long.

    It sleeps while no pool keeps an idle connection, and starts again (in a forked
    child too, where the parent's thread does not exist) when one does. A give-back to a
    pool it already watches costs no lock and wakes nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: weakref.WeakSet[Connector] = weakref.WeakSet()
        self._wake = threading.Event()
        self._pid = 0
        self._parked = False

    def watch(self, connector: Connector) -> None:
        if self._pid == os.getpid() and not self._parked and connector in self._pools:
            return
        with self._lock:
            new = connector not in self._pools
            self._pools.add(connector)
            if self._pid != os.getpid():
                self._pid, self._parked = os.getpid(), False
                self._wake = threading.Event()
                thread = threading.Thread(target=self._run, name="pgq-pool-reaper", daemon=True)
                thread.start()
            elif self._parked or new:
                # Parked, or asleep for longer than this pool's idle_timeout may allow.
                self._parked = False
                self._wake.set()

    def _run(self) -> None:
        wake = self._wake
        while True:
            with self._lock:
                waiting = [p for p in self._pools if not p.closed and p.idle_count]
                if not waiting:
                    self._parked = True
                    wake.clear()
            if not waiting:
                wake.wait()  # until a pool keeps an idle connection again
                continue
            step = min(p.idle_timeout for p in waiting) / 4
            if wake.wait(min(max(step, 0.05), 10.0)):
                wake.clear()  # (woken for a new pool: the next turn takes it in)
                continue
            for pool in waiting:
                pool.reap()


_reaper = _Reaper()

_shared: dict[tuple[Any, ...], Connector] = {}
_shared_lock = threading.Lock()


def shared(conninfo: str, **settings: Any) -> Connector:
    """This process's connector for ``conninfo`` with these settings (``Connector``'s
    keyword arguments), made on first use: every kombu connection of a process shares
    one pool, so the process's sessions are capped by ``max_size`` however many it opens."""
    key = (os.getpid(), conninfo, tuple(sorted(settings.items())))
    with _shared_lock:
        found = _shared.get(key)
        if found is None or found.closed:
            found = _shared[key] = Connector(conninfo, **settings)
        return found


def pooler_detected(display_url: str, detail: str) -> PoolerDetected:
    """The one error for a pooler in the way of a session pgq needs as its own."""
    return PoolerDetected(
        f"{display_url} is not a Postgres session of pgq's own: {detail}. A connection "
        f"pooler is in between (PgBouncer, say, in pool_mode = transaction or session). "
        f"Set the transport option use_notify=false (or PGQ_USE_NOTIFY=false): "
        f"pgq then keeps no session state (no LISTEN, no prepared statements, no session "
        f"settings) and idle workers poll; or connect pgq to Postgres directly"
    )


def describe(exc: BaseException) -> str:
    """A one-line description of a driver error, without the conninfo in it."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # libpq reports one "connection to server … failed: reason" line per host tried.
    return "; ".join(dict.fromkeys(lines))
