"""One session per process that learns when the results its callers wait for are stored.

Every caller waiting on a result (``AsyncResult.get()``, ``join_native``, a group's
``get()``) subscribes its task id here; however many there are, the process holds one
listening connection and one thread. A stored result notifies the task's own channel
(:func:`result_channel`: a digest of the schema and the task id) with an empty payload,
so a notification wakes only the process waiting on that task and says nothing but
"look": the thread then reads the rows of every task whose channel was notified in one
statement (``task_id = ANY(…)``) and hands each subscriber what it read. A forged
notification costs one indexed lookup and delivers nothing that is not in the table.

LISTEN is sent before the first read of a newly subscribed task, so a result stored
between a caller's first look and its subscription is never missed. While nobody waits,
the thread blocks on the socket and sends nothing. With ``use_notify`` off (transaction
pooling: LISTEN needs a session of its own) the thread reads every subscribed task in
one statement per ``polling_interval``: the statements a second do not grow with the
number of waiters. After a lost connection it reconnects, listens again and reads every
subscribed task once, which covers what was stored while it was away.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from hashlib import blake2b
from typing import Any, Protocol

import psycopg
from psycopg import sql

from pg_transport.db.listen import ListenThread
from pg_transport.db.pool import Connector
from pg_transport.db.retry import TRANSIENT, attempt, is_dead_connection
from pg_transport.errors import BrokerUnavailable
from pg_transport.sql import channel_prefix, load_named

__all__ = ["Listener", "Row", "Subscriber", "listener_for", "result_channel", "stop_listeners"]

logger = logging.getLogger("pg_transport.results")

# Longest wait for the socket when nothing else bounds it: a stop is noticed by then.
IDLE_WAKE = 3600.0


def result_channel(schema: str, task_id: str) -> str:
    """The channel where the waiters of ``task_id`` are woken, with no payload."""
    digest = blake2b(task_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{channel_prefix(schema)}r{digest}"


@dataclass(frozen=True)
class Row:
    """A stored result as read, still encoded."""

    task_id: str
    status: str
    content_type: str
    content_encoding: str
    meta: bytes
    updated_at: datetime


class Subscriber(Protocol):
    def deliver(self, row: Row) -> None:
        """Take a row read for one of the subscribed tasks (called on the listener's thread)."""


class Listener(ListenThread):
    """The waiting side of one (database, schema) in this process."""

    thread_name = "pgq-results"

    def __init__(
        self, connector: Connector, schema: str, *, use_notify: bool, polling_interval: float
    ) -> None:
        super().__init__()
        self.connector = connector
        self.schema = schema
        self.use_notify = use_notify
        self.polling_interval = polling_interval
        self._q = load_named("results.sql", schema, "pg_transport.results")
        # Reentrant: Celery's AsyncResult.__del__ unsubscribes its task (cancel_for), and
        # the garbage collector runs it at any allocation, on any thread, so also inside
        # this lock on a thread that holds it (a plain Lock hung that thread for good).
        # What runs there is an unsubscribe of a task nobody waits for any more: another
        # task than the one the section is about (a subscribe is for a task with a
        # waiter), so each section's own state holds.
        self._lock = threading.RLock()
        # task id -> its subscribers (by identity: a consumer per thread's backend).
        self._subs: dict[str, dict[int, Subscriber]] = {}
        self._channels: dict[str, str] = {}  # channel -> task id
        self._fresh: set[str] = set()  # subscribed, not yet listened to and read
        self._gone: set[str] = set()  # channels to UNLISTEN
        self._seen: dict[str, datetime] = {}  # last row version delivered per task
        # Subscribers (by id) of a task that have been handed nothing yet.
        self._first: dict[str, set[int]] = {}
        self._listening: set[str] = set()
        self._conn: psycopg.Connection[Any] | None = None
        # Channels notified, filled on this listener's thread only (from what psycopg
        # read during a statement and what libpq read while idle: ListenThread._notes).
        self._notified: set[str] = set()
        #: Statements this listener sent (for tests and benchmarks).
        self.statements = 0

    # -- subscribers' side (any thread) -------------------------------------------------
    def subscribe(self, task_id: str, subscriber: Subscriber) -> None:
        with self._lock:
            subs = self._subs.setdefault(task_id, {})
            subs[id(subscriber)] = subscriber
            # Read again for every new subscriber: it has seen nothing yet (the others
            # are not handed the same row twice).
            self._first.setdefault(task_id, set()).add(id(subscriber))
            self._fresh.add(task_id)
            channel = result_channel(self.schema, task_id)
            self._channels[channel] = task_id
            self._gone.discard(channel)
            self._ensure_thread()
        self._poke()

    def unsubscribe(self, task_id: str, subscriber: Subscriber) -> None:
        with self._lock:
            subs = self._subs.get(task_id)
            if subs is None:
                return
            subs.pop(id(subscriber), None)
            self._first.get(task_id, set()).discard(id(subscriber))
            if subs:
                return
            del self._subs[task_id]
            self._fresh.discard(task_id)
            self._seen.pop(task_id, None)
            self._first.pop(task_id, None)
            channel = result_channel(self.schema, task_id)
            self._channels.pop(channel, None)
            if channel in self._listening:
                self._gone.add(channel)
        # UNLISTEN rides on the thread's next statement: no wake-up just for it.

    def waiting(self) -> int:
        """How many task ids are subscribed."""
        with self._lock:
            return len(self._subs)

    def stop(self) -> None:
        """Stop the thread and close the session; the process's next waiter of this
        database and schema gets a new listener."""
        with _listeners_lock:
            for key, found in list(_listeners.items()):
                if found is self:
                    del _listeners[key]
        self._halt(5)
        self._close()

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._cycle()
            except (psycopg.Error, BrokerUnavailable) as exc:
                if not is_dead_connection(exc, self._conn) and not isinstance(
                    exc, BrokerUnavailable
                ):
                    logger.exception("pgq results: reading results failed")
                else:
                    logger.warning("pgq results: lost the waiting session (%s): reconnecting", exc)
                self._close()
                self._stop.wait(0.2)
            except Exception:  # a bug: log it, keep serving the waiters
                logger.exception("pgq results: listener failed")
                self._close()
                self._stop.wait(1.0)

    def _open(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        conn = attempt(TRANSIENT, self.connector.connect)
        conn.prepare_threshold = None
        self._attach(conn)
        self._conn = conn
        with self._lock:
            self._listening = set()
            self._gone = set()
            # Everything may have been stored while we were away: read it all again.
            self._fresh = set(self._subs)
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except psycopg.Error:
                logger.debug("closing the results session failed", exc_info=True)

    def _take_notes(self, conn: psycopg.Connection[Any]) -> None:
        # A payload means someone other than pgq notified: the channel is all we take.
        self._notified.update(channel for channel, _ in self._notes(conn))

    def _cycle(self) -> None:
        conn = self._open()
        with self._lock:
            fresh, self._fresh = self._fresh, set()
            gone, self._gone = self._gone, set()
            polling = not self.use_notify and bool(self._subs)
        # LISTEN (and UNLISTEN) before reading: nothing stored after the read is missed.
        self._listen(conn, fresh, gone)
        if fresh:
            self._read(conn, fresh)
        self._take_notes(conn)
        if self._notified:
            notified, self._notified = self._notified, set()
            with self._lock:
                ids = {self._channels[c] for c in notified if c in self._channels}
            if ids:
                self._read(conn, ids)
        self._take_notes(conn)
        with self._lock:
            # Notifications that came in with the answers above are in _notified, not
            # on the socket: the next cycle takes them before waiting again.
            if self._fresh or self._notified or self._stop.is_set():
                return
            polling = not self.use_notify and bool(self._subs)
        timeout = self.polling_interval if polling else IDLE_WAKE
        woken = self._wait(conn, timeout)
        if woken == "socket":
            self._take_notes(conn)
            if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
                raise psycopg.OperationalError("the results session was closed by the server")
        if woken == "timeout" and polling:
            with self._lock:
                everyone = set(self._subs)
            self._read(conn, everyone)

    def _listen(self, conn: psycopg.Connection[Any], fresh: Iterable[str], gone: set[str]) -> None:
        if not self.use_notify:
            return
        wanted = {result_channel(self.schema, t) for t in fresh} - self._listening
        parts = [sql.SQL("LISTEN {}").format(sql.Identifier(c)) for c in sorted(wanted)]
        parts += [sql.SQL("UNLISTEN {}").format(sql.Identifier(c)) for c in sorted(gone)]
        if not parts:
            return
        # One round trip for all of them (simple protocol: nothing is prepared).
        conn.execute(sql.SQL("; ").join(parts), prepare=False)
        self.statements += 1
        self._listening |= wanted
        self._listening -= gone

    def _read(self, conn: psycopg.Connection[Any], ids: set[str]) -> None:
        """Read ``ids`` in one statement; hand a row to every subscriber of its task if it
        changed since it was last handed out, else to the subscribers that have none yet."""
        rows = conn.execute(self._q["result_get_many"], {"ids": sorted(ids)}).fetchall()
        self.statements += 1
        for task_id, status, ctype, cenc, meta, updated_at in rows:
            row = Row(task_id, status, ctype, cenc, bytes(meta), updated_at)
            with self._lock:
                subs = self._subs.get(task_id)
                if not subs:
                    continue
                first = self._first.pop(task_id, set())
                if self._seen.get(task_id) != updated_at:
                    subscribers = list(subs.values())
                else:
                    subscribers = [s for key, s in subs.items() if key in first]
                self._seen[task_id] = updated_at
            for subscriber in subscribers:
                subscriber.deliver(row)


_listeners: dict[tuple[str, str, bool, float, int], Listener] = {}
# Reentrant, as Listener._lock: an AsyncResult finalized by the garbage collector while
# this thread holds it asks for its listener too (cancel_for), here.
_listeners_lock = threading.RLock()


def listener_for(
    connector: Connector, schema: str, *, use_notify: bool, polling_interval: float
) -> Listener:
    """The process's listener for this database and schema (a new one after a fork)."""
    key = (connector.conninfo, schema, use_notify, polling_interval, os.getpid())
    with _listeners_lock:
        found = _listeners.get(key)
    if found is not None:
        return found
    # Made outside the lock (a finalizer run while it is made may ask for it, and make
    # one): the first one registered is everyone's.
    made = Listener(
        Connector(
            connector.conninfo,
            display_url=connector.display_url,
            application_name="pgq-results",
            max_size=1,
            prepare_threshold=connector.prepare_threshold,
            pin_search_path=connector.pin_search_path,
        ),
        schema,
        use_notify=use_notify,
        polling_interval=polling_interval,
    )
    with _listeners_lock:
        return _listeners.setdefault(key, made)


def stop_listeners() -> None:
    """Stop every listener of this process (its waiters wait on without wake-ups)."""
    with _listeners_lock:
        found = list(_listeners.values())
    for listener in found:
        listener.stop()
