"""A thread of its own holding one LISTEN session, and the wake-up pipe.

pgq listens in the background in two places: behind a pooler, the consumer's direct
session that only LISTENs for the queues consumed (``listen_url``:
:mod:`pg_transport.consume.listener`), and the result backend's session that learns when
the results its callers wait for are stored (:mod:`pg_transport.results.listener`). Both
are a :class:`ListenThread`: one daemon thread per object, started on first use (again
in a forked child, where the parent's thread does not exist), stopped and joined on
close, waiting on its session's socket and on a :class:`WakePipe` that other threads
write to when they want it to look again (a queue or a task to listen to, a stop). What
the thread does with a session is the subclass's :meth:`ListenThread._run`.

:class:`WakePipe` is also how another thread wakes the consumer's driver (an ack on a
pool thread frees a prefetch slot): the driver watches its read end with its session's
socket. Writing never blocks: a full pipe means a wake-up is pending already.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Literal

import psycopg

from pg_transport.db import waits

__all__ = ["ListenThread", "WakePipe", "Woken"]

#: What ended a :meth:`ListenThread._wait`.
Woken = Literal["socket", "poke", "timeout"]


class WakePipe:
    """Created on first use; a process that only publishes never holds its descriptors."""

    def __init__(self) -> None:
        self._read = self._write = -1
        self._pid = os.getpid()

    def fileno(self) -> int:
        """The read end, for a waiter to watch."""
        if self._read < 0 or self._pid != os.getpid():
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._read, self._write, self._pid = read, write, os.getpid()
        return self._read

    def wake(self) -> None:
        """Wake the waiter, from any thread; cheap, never blocks."""
        if self._write < 0:
            return  # nobody watches yet: the next wait begins with a look anyway
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def clear(self) -> None:
        """Consume pending wake-ups (after the waiter saw the pipe readable)."""
        if self._read < 0:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        # Forget the descriptors before closing them, so a late wake() from another
        # thread finds nothing to write to rather than a recycled descriptor number.
        fds, (self._read, self._write) = (self._read, self._write), (-1, -1)
        if self._pid == os.getpid():
            for fd in fds:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)


class ListenThread:
    """The thread, its stop and its wake-up pipe; the subclass's :meth:`_run` is the
    thread's body, which returns once :attr:`_stop` is set (it waits through
    :meth:`_wait`, which a stop or :meth:`_poke` cuts short)."""

    #: The thread's name (seen in a debugger, a thread dump).
    thread_name = "pgq-listen"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._pipe = WakePipe()
        # Notifications psycopg read during a statement (it takes them out of libpq's
        # list and hands them to the session's handlers): on this thread only.
        self._heard: list[psycopg.Notify] = []

    def _ensure_thread(self) -> None:
        """Start the thread unless it runs (or this object was stopped)."""
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._thread, self._pid = None, os.getpid()
        thread = self._thread
        if (thread is None or not thread.is_alive()) and not self._stop.is_set():
            self._pipe.fileno()  # before the thread waits: a poke from now on wakes it
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def _poke(self) -> None:
        """Have the thread look again now (from any thread; never blocks)."""
        self._pipe.wake()

    def _halt(self, timeout: float) -> bool:
        """Stop the thread and wait for it, ``timeout`` seconds at most; whether it is
        gone (then the pipe is closed too)."""
        self._stop.set()
        self._poke()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return False
        if thread is not threading.current_thread():
            self._pipe.close()
        return True

    @property
    def running(self) -> bool:
        """Whether the thread is alive (in this process)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._pid == os.getpid()

    def _attach(self, conn: psycopg.Connection[Any]) -> None:
        """Keep what ``conn`` (a new session of this thread) is notified of during its
        statements: :meth:`_notes` hands it out with what came while waiting."""
        self._heard = []
        conn.add_notify_handler(self._heard.append)

    def _notes(self, conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
        """Every notification read since the last call, (channel, payload): those
        psycopg took during statements and those libpq parsed since."""
        found = [(note.channel, note.payload) for note in self._heard]
        self._heard.clear()
        pgconn = conn.pgconn
        while (pgnote := pgconn.notifies()) is not None:
            found.append(
                (pgnote.relname.decode("utf-8", "replace"), pgnote.extra.decode("utf-8", "replace"))
            )
        return found

    def _wait(self, conn: psycopg.Connection[Any], timeout: float | None) -> Woken:
        """Wait until the session's socket is readable (its input is consumed then: the
        notifications are in libpq's list), a poke, or ``timeout``; which came first."""
        socket = conn.pgconn.socket
        ready = waits.readable((socket, self._pipe.fileno()), timeout)
        if not ready:
            return "timeout"
        self._pipe.clear()
        if socket not in ready:
            return "poke"
        conn.pgconn.consume_input()
        return "socket"

    def _run(self) -> None:
        raise NotImplementedError
