"""The wake-up pipe: how another thread tells the consumer's driver to look again.

An ack made on a pool thread frees a prefetch slot; the driver (Celery's event loop, or
the blocking ``poll()`` loop) is waiting on sockets, so the ack writes a byte here and
the driver, watching the pipe's read end with the session's socket, wakes. Writing never
blocks: a full pipe means a wake-up is pending already.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["WakePipe"]


class WakePipe:
    """Created on first use; a process that only publishes never holds its descriptors."""

    def __init__(self) -> None:
        self._read = self._write = -1
        self._pid = os.getpid()

    def fileno(self) -> int:
        """The read end, for a driver to watch."""
        if self._read < 0 or self._pid != os.getpid():
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._read, self._write, self._pid = read, write, os.getpid()
        return self._read

    def wake(self) -> None:
        """Wake the driver, from any thread; cheap, never blocks."""
        if self._write < 0:
            return  # nobody watches yet: the next wait begins with a kick anyway
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def clear(self) -> None:
        """Consume pending wake-ups (after the driver saw the pipe readable)."""
        if self._read < 0:
            return
        with contextlib.suppress(BlockingIOError):
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
