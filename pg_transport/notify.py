"""LISTEN/NOTIFY wake-ups, plus a self-pipe so an ack can wake the consumer.

A consumer waits here when it has nothing to do: either no message was visible,
or all its prefetch slots are full. It wakes when a publish notifies the channel of
one of its queues, when an ack frees a slot (:meth:`Listener.wake`), or after the
polling interval (delayed messages and expired leases need no notification).

A notification is a hint, never data. Postgres lets every role that can connect
LISTEN and NOTIFY on any channel, so all a consumer takes from one is its channel's
name, as a reason to claim the queue it names; what it then delivers comes from the
rows it claims. pgq's publishes send no payload: one with a payload was sent by
someone else, and is reported (at most once a minute) and dropped
(:class:`Notifications`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from collections.abc import Iterable
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import psycopg
from psycopg import pq

from pg_transport.connection import Connector
from pg_transport.sql import compose_channel, load_queries

__all__ = ["Listener", "Notifications", "Wakeup"]

logger = logging.getLogger("pg_transport.notify")

# Seconds between two warnings about notifications pgq did not send.
FOREIGN_WARN_INTERVAL = 60.0


class Notifications:
    """Takes the channel names out of a session's notifications, and reports the ones
    pgq cannot have sent (a payload)."""

    def __init__(self) -> None:
        self.foreign = 0
        self._reported = 0
        self._next_warning = 0.0

    def collect(self, pgconn: pq.abc.PGconn, into: set[str]) -> None:
        """Move what libpq has parsed so far into ``into`` (channel names)."""
        while (note := pgconn.notifies()) is not None:
            if note.extra:
                self._foreign(note.relname)
                continue
            into.add(note.relname.decode("utf-8", "replace"))

    def _foreign(self, channel: bytes) -> None:
        self.foreign += 1
        now = monotonic()
        if now >= self._next_warning:
            self._next_warning = now + FOREIGN_WARN_INTERVAL
            logger.warning(
                "pgq: dropped %d notification(s) with a payload on channel %r: pgq sends "
                "none, so some other session is notifying its channels (any role that can "
                "connect may); they are ignored", self.foreign - self._reported,
                channel.decode("utf-8", "replace")[:63],
            )
            self._reported = self.foreign


@dataclass
class Wakeup:
    """Why a wait ended: channels notified, and/or a local wake."""

    channels: set[str] = field(default_factory=set)
    local: bool = False


class Listener:
    def __init__(self, connector: Connector, schema: str, *, use_notify: bool) -> None:
        self.connector = connector
        self.listen_query = load_queries(schema)["listen"]
        self.use_notify = use_notify
        self._conn: psycopg.Connection[Any] | None = None
        self._listening: set[str] = set()
        self._notes = Notifications()
        self._pid = os.getpid()
        # The wake-up pipe exists once someone waits: a publishing-only connection
        # (most of Celery's producer pool) never holds its two descriptors.
        self._wake_r = self._wake_w = -1

    def listen(self, channels: Iterable[str]) -> None:
        """LISTEN on ``channels`` too (opening the session if needed)."""
        if not self.use_notify:
            return
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = self.connector.connect()
            self._listening = set()
        for channel in sorted(set(channels) - self._listening):
            conn.execute(compose_channel(self.listen_query, channel))
            self._listening.add(channel)

    def wake(self) -> None:
        """Wake a waiter from any thread; cheap, never blocks."""
        if self._wake_w < 0:
            return  # nobody has waited yet: the next wait begins with a claim anyway
        # A full pipe means a wake-up is already pending.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def wake_fd(self) -> int:
        """The read end of the wake-up pipe, for an event loop to watch."""
        self._ensure_pipe()
        return self._wake_r

    def clear_wakes(self) -> None:
        """Consume pending wake-ups (after the event loop saw the pipe readable)."""
        if self._wake_r >= 0:
            self._drain_pipe()

    def _ensure_pipe(self) -> None:
        if self._wake_r < 0:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wake_r, self._wake_w = read, write

    def wait(self, timeout: float) -> Wakeup:
        """Block up to ``timeout`` seconds; raises psycopg errors if LISTEN died."""
        self._ensure_pipe()
        result = Wakeup()
        fds: list[int] = [self._wake_r]
        conn = self._conn
        if conn is not None and not conn.closed:
            fds.append(conn.pgconn.socket)
            # Notifications may already be buffered from an earlier read.
            self._notes.collect(conn.pgconn, result.channels)
            if result.channels:
                return result
        ready, _, _ = select.select(fds, [], [], max(timeout, 0.0))
        if self._wake_r in ready:
            self._drain_pipe()
            result.local = True
        if conn is not None and len(ready) > (1 if result.local else 0):
            try:
                conn.pgconn.consume_input()
            except psycopg.Error:
                self._conn = None
                conn.close()
                raise
            self._notes.collect(conn.pgconn, result.channels)
        return result

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self._listening = set()
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except psycopg.Error:
                logger.debug("closing the LISTEN connection failed", exc_info=True)
        # Forget the descriptors before closing them, so a late wake() from another
        # thread finds nothing to write to rather than a recycled descriptor number.
        fds = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = -1
        if self._pid == os.getpid():
            for fd in fds:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
