"""Wake-ups behind a pooler: one direct session per process that only LISTENs.

Behind a transaction pooler (``use_notify`` off) the consumer's statements go through the
pooler and its idle consumers poll. With ``listen_url`` set, a :class:`Listener` keeps one
connection straight to Postgres (bypassing the pooler) on which it LISTENs on the
channels of the queues consumed, in a thread of its own: a notification only marks its
channel, and the consumer's driver is woken (the engine's wake-up pipe) to claim that
queue through the pooler at once. Nothing else runs on that connection.

A notification is a hint, never data (as on the consumer's own session, see
:mod:`pg_transport.consume.session`): a channel's name is all that is taken from one.

When the connection is lost the consumer goes on polling, with a warning; the listener
connects again (every :data:`RECONNECT_INTERVAL` seconds) and, once it listens again,
marks every channel as notified: what was published meanwhile is claimed at once. A
refusal (``listen_url`` leading to a pooler, a wrong password) is said at every try, with
what is wrong, and the tries back off (doubling, at most :data:`MAX_REFUSED_INTERVAL`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from pg_transport.consume.session import Notifications
from pg_transport.db.listen import ListenThread
from pg_transport.db.pool import Connector
from pg_transport.errors import BrokerRefused, PgqError, PoolerDetected
from pg_transport.sql import compose_channel, load_queries

__all__ = ["RECONNECT_INTERVAL", "Listener"]

logger = logging.getLogger("pg_transport.consume")

#: Seconds between two attempts to open the listening connection again.
RECONNECT_INTERVAL = 2.0
#: The longest wait between two attempts after refusals (doubling from RECONNECT_INTERVAL).
MAX_REFUSED_INTERVAL = 60.0
# Longest wait on the socket when nothing wakes the thread (a poke cuts it short).
IDLE_WAKE = 60.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Listener(ListenThread):
    """A thread holding one LISTEN-only session; ``wake`` is called (from that thread)
    when a channel was notified (or may have been, after a reconnection)."""

    thread_name = "pgq-listener"

    def __init__(self, connector: Connector, schema: str, wake: Callable[[], None]) -> None:
        super().__init__()
        self.connector = connector
        self.wake = wake
        self._listen = load_queries(schema)["listen"]
        self._lock = threading.Lock()
        self._wanted: set[str] = set()
        self._notified: set[str] = set()
        # Channels notified since the driver last called want() (handed out again then).
        self._recent: set[str] = set()
        #: Whether the session is up and listening on every channel wanted.
        self.listening = False
        #: Times the connection was lost (or could not be opened) since the start.
        self.losses = 0
        #: Refusals in a row (a pooler, a password): each doubles the wait.
        self.refusals = 0

    def want(self, channels: set[str]) -> None:
        """Listen on ``channels`` too (from the driver's thread, each time it decides
        what to send next: never waits).

        The channels notified since the driver's previous call are handed to it once
        more (:meth:`take` after a wake-up): the driver may have taken them while a
        claim was out, whose answer, read after, marked their queues empty although its
        snapshot predates the publish; now that the answer is in they bring a claim.
        Without this the consumer would wait for its poll (the consumer's own session
        reads a notification with the statement's answer, and takes it after the answer:
        no such race)."""
        with self._lock:
            again, self._recent = self._recent, set()
            self._notified |= again
            new = not channels <= self._wanted
            self._wanted |= channels
        if again:
            self.wake()
        if new:
            self._ensure_thread()
            self._poke()  # LISTEN now, not at the thread's next look

    def take(self) -> set[str]:
        """The channels notified since the last call."""
        with self._lock:
            found, self._notified = self._notified, set()
        return found

    def close(self) -> None:
        self._halt(RECONNECT_INTERVAL + 5)

    def _mark(self, channels: set[str]) -> None:
        if not channels:
            return
        with self._lock:
            self._notified |= channels
            self._recent |= channels
        self.wake()

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                conn = self.connector.connect()
            except (psycopg.Error, PgqError) as exc:
                self._stop.wait(self._lost(exc))
                continue
            self.refusals = 0
            try:
                self._serve(conn, announce=not first)
            except psycopg.Error as exc:
                self._lost(exc)
            finally:
                self.listening = False
                conn.close()
            first = False
            self._stop.wait(RECONNECT_INTERVAL)

    def _lost(self, exc: BaseException) -> float:
        """Say what happened (when it is news); the seconds to wait before the next try."""
        self.losses += 1
        if isinstance(exc, BrokerRefused):
            # The same answer every time (a pooler, a password): back off, one line a step.
            self.refusals += 1
            delay = float(min(RECONNECT_INTERVAL * 2 ** (self.refusals - 1), MAX_REFUSED_INTERVAL))
            if isinstance(exc, PoolerDetected):
                why = (
                    f"listen_url {self.connector.display_url} leads to a connection pooler, "
                    "not to Postgres itself: LISTEN needs a session of its own. Point "
                    "listen_url at Postgres directly (use_notify=false stays right for the "
                    "other connections)"
                )
            else:
                why = f"listen_url refused: {_first_line(exc)}"
            logger.warning(
                "pgq: %s; idle consumers poll every polling_interval meanwhile; next try in "
                "%gs (refused %d times in a row)",
                why,
                delay,
                self.refusals,
            )
            return delay
        if self.losses == 1 or self.listening:
            logger.warning(
                "pgq: the listening connection (listen_url) is lost (%s): idle consumers "
                "poll every polling_interval until it is back",
                _first_line(exc),
            )
        return RECONNECT_INTERVAL

    def _serve(self, conn: psycopg.Connection[Any], *, announce: bool) -> None:
        notes = Notifications()
        listening: set[str] = set()
        self._attach(conn)  # a notification read with a LISTEN's answer is kept too
        while not self._stop.is_set():
            with self._lock:
                missing = self._wanted - listening
            if missing:
                for channel in sorted(missing):
                    conn.execute(compose_channel(self._listen, channel))
                listening |= missing
                if not self.listening:
                    self.listening = True
                    if announce:
                        logger.warning("pgq: the listening connection (listen_url) is back")
                    # Anything published while nobody listened: claim it now.
                    self._mark(set(listening))
                else:
                    self._mark(missing)
            self._mark(self._channels(conn, notes))
            # Until a notification, a channel wanted anew (a poke) or a stop.
            if self._wait(conn, IDLE_WAKE) == "socket":
                self._mark(self._channels(conn, notes))

    def _channels(self, conn: psycopg.Connection[Any], notes: Notifications) -> set[str]:
        """The channels notified since the last look; one with a payload is not pgq's
        (dropped, and said)."""
        found: set[str] = set()
        for channel, payload in self._notes(conn):
            if payload:
                notes.dropped(channel)
            else:
                found.add(channel)
        return found
