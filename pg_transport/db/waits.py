"""Waiting for descriptors to be ready, whatever their number.

``select.select`` refuses a descriptor of 1024 or more (``FD_SETSIZE``): in a process
holding more than about a thousand files (a gevent or eventlet server, an ASGI front end,
a busy worker) every socket pgq opens gets such a number. Every wait of pgq on a socket
or a pipe goes through here instead, on ``poll(2)``: no limit on the number, one system
call and no descriptor of its own (a selector's epoll costs three more calls a wait).

The module ``select`` is looked up at each call, never bound at import: gevent's
monkey-patching replaces ``select.poll`` with its own (which blocks only the greenlet),
also when it runs after pgq was imported. Where there is no ``select.poll`` (Windows;
eventlet's patching removes it), ``selectors.DefaultSelector`` waits instead (eventlet
patches that one to wait through its hub).

A descriptor in error, hung up or closed counts as ready (poll(2) reports those unasked):
its reader then finds out what happened (psycopg raises ``OperationalError``).
"""

from __future__ import annotations

import math
import select
import selectors
from collections.abc import Collection

__all__ = ["readable", "writable"]

# poll(2)'s events (where it exists; the same numbers under gevent), and its longest
# timeout in milliseconds (an int).
_IN = getattr(select, "POLLIN", 1)
_OUT = getattr(select, "POLLOUT", 4)
_LONGEST_MS = 2**31 - 1


def readable(fds: Collection[int], timeout: float | None) -> set[int]:
    """Wait until one of ``fds`` can be read (or is in trouble), ``timeout`` seconds at
    most (None: no limit); the ones that can."""
    poll = getattr(select, "poll", None)  # (at each call: gevent may have patched it since)
    if poll is None:
        return _wait_selector(fds, timeout, write=False)
    poller = poll()
    for fd in fds:
        poller.register(fd, _IN)
    return {fd for fd, _ in poller.poll(_ms(timeout))}


def writable(fd: int, timeout: float | None) -> bool:
    """Wait until ``fd`` can be written (or is in trouble), ``timeout`` seconds at most
    (None: no limit); whether it can."""
    poll = getattr(select, "poll", None)
    if poll is None:
        return bool(_wait_selector((fd,), timeout, write=True))
    poller = poll()
    poller.register(fd, _OUT)
    return bool(poller.poll(_ms(timeout)))


def _ms(timeout: float | None) -> int | None:
    """poll's timeout: milliseconds, rounded up (a wait cut shorter than asked would
    spin to its deadline), none below 0 or past what it takes."""
    if timeout is None:
        return None
    if timeout <= 0:
        return 0
    return min(math.ceil(timeout * 1000), _LONGEST_MS)


def _wait_selector(fds: Collection[int], timeout: float | None, *, write: bool) -> set[int]:
    if timeout is not None:
        timeout = max(timeout, 0.0)
    events = selectors.EVENT_WRITE if write else selectors.EVENT_READ
    with selectors.DefaultSelector() as selector:
        for fd in set(fds):  # (a selector takes each one once)
            selector.register(fd, events)
        return {key.fd for key, _ in selector.select(timeout)}
