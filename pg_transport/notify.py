"""LISTEN/NOTIFY wake-ups, plus a self-pipe so an ack can wake the consumer.

A consumer waits here when it has nothing to do: either no message was visible,
or all its prefetch slots are full. It wakes when a publish notifies one of its
queues, when an ack frees a slot (:meth:`Listener.wake`), or after the polling
interval (delayed messages and expired leases need no notification).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pg_transport.connection import Connector
from pg_transport.sql import load_queries

__all__ = ["Listener", "Wakeup"]

logger = logging.getLogger("pg_transport.notify")


@dataclass
class Wakeup:
    """Why a wait ended: queues notified ('' means any), and/or a local wake."""

    queues: set[str] = field(default_factory=set)
    local: bool = False

    def concerns(self, active: set[str] | list[str]) -> bool:
        if self.local or "" in self.queues:
            return True
        return not self.queues.isdisjoint(active)


class Listener:
    def __init__(self, connector: Connector, schema: str, *, use_notify: bool) -> None:
        self.connector = connector
        self.listen_query = load_queries(schema)["listen"]
        self.use_notify = use_notify
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = os.getpid()
        # The wake-up pipe exists once someone waits: a publishing-only connection
        # (most of Celery's producer pool) never holds its two descriptors.
        self._wake_r = self._wake_w = -1

    def start(self) -> None:
        """Open the LISTEN session (idempotent)."""
        if not self.use_notify or (self._conn is not None and not self._conn.closed):
            return
        conn = self.connector.connect()
        conn.execute(self.listen_query)
        self._conn = conn

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
        if self.use_notify:
            self.start()
        self._ensure_pipe()
        result = Wakeup()
        fds: list[int] = [self._wake_r]
        conn = self._conn
        if conn is not None:
            fds.append(conn.pgconn.socket)
            # Notifications may already be buffered from an earlier read.
            self._collect(conn, result)
            if result.queues:
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
            self._collect(conn, result)
        return result

    def _collect(self, conn: psycopg.Connection[Any], result: Wakeup) -> None:
        pgconn = conn.pgconn
        while True:
            note = pgconn.notifies()
            if note is None:
                return
            result.queues.add(note.extra.decode("utf-8", "replace"))

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        conn, self._conn = self._conn, None
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
