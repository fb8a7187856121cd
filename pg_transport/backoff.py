"""A worker the broker refuses backs off, exponentially, and says so.

A refusal (:class:`~pg_transport.errors.BrokerRefused`: a wrong password, a missing
database, a transaction pooler where pgq needs a session of its own, ``PoolerDetected``)
fails the same way on every try. Celery's consumer restarts at once after an error on a
connection it opened, about seven times a second, an ERROR line each time. In a worker
(:func:`enable`, from the worker's init) the next connection after a refusal waits first:
1 s, then twice as long each time, at most :data:`MAX_DELAY`; one WARNING line per step
says what was refused and when the next try comes, and the worker's heartbeat file says it
is refused (``pgq health`` fails) until a connection succeeds: the heartbeat
(:mod:`pg_transport.ops.health`) watches the back-off (:meth:`Backoff.watch`), which
knows nothing of it.

Only in the worker's own process: an application publishing (or a pool's child process)
gets the refusal at once, as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["BACKOFF", "MAX_DELAY", "Backoff", "Watcher", "enable"]

logger = logging.getLogger("pg_transport.backoff")

#: The longest wait between two tries after refusals (seconds).
MAX_DELAY = 60.0
#: The first wait (seconds); each refusal after it doubles it.
FIRST_DELAY = 1.0
# The wait is cut in slices this long, to see a worker shutdown.
_SLICE = 0.25

#: Told when the broker starts refusing this process (since when, wall clock, and why)
#: and when it stops (None, None).
Watcher = Callable[[float | None, str | None], None]


def _stopping() -> bool:
    """Whether the Celery worker of this process was asked to stop."""
    try:
        from celery.worker import state
    except ImportError:  # pragma: no cover - Celery is a dependency
        return False
    return bool(state.should_stop is not None or state.should_terminate is not None)


class Backoff:
    """Consecutive refusals of one process, and the wait they call for."""

    def __init__(
        self,
        *,
        first: float = FIRST_DELAY,
        cap: float = MAX_DELAY,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.first, self.cap, self._sleep = first, cap, sleep
        self._lock = threading.Lock()
        self._pid: int | None = None
        self.refusals = 0
        self.since: float | None = None
        self._next_at = 0.0
        self._watchers: list[Watcher] = []

    def watch(self, watcher: Watcher) -> None:
        """Tell ``watcher`` each refusal and the connection that ends them (once, however
        often it is given)."""
        with self._lock:
            if watcher not in self._watchers:
                self._watchers.append(watcher)

    def _tell(self, since: float | None, why: str | None) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher(since, why)

    def enable(self) -> None:
        """This process is a worker: refusals make it wait (not its children)."""
        self._pid = os.getpid()

    @property
    def enabled(self) -> bool:
        return self._pid == os.getpid()

    def delay(self) -> float:
        """The wait after the refusals so far."""
        if not self.refusals:
            return 0.0
        return float(min(self.first * 2 ** (self.refusals - 1), self.cap))

    def wait(self) -> None:
        """Before a connection: wait out the back-off the last refusal set (if any)."""
        if not self.enabled:
            return
        while not _stopping():
            with self._lock:
                left = self._next_at - time.monotonic()
            if left <= 0:
                return
            self._sleep(min(left, _SLICE))

    def refused(self, exc: BaseException) -> None:
        """A connection was refused: one line, the next wait, the heartbeat says so."""
        if not self.enabled:
            return
        with self._lock:
            self.refusals += 1
            if self.since is None:
                self.since = time.time()
            delay = self.delay()
            self._next_at = time.monotonic() + delay
            n, since = self.refusals, self.since
        logger.warning(
            "pgq: refused by the broker (%d in a row): %s; next try in %gs",
            n,
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            delay,
        )
        self._tell(since, str(exc))

    def connected(self) -> None:
        """A connection succeeded: the back-off starts over."""
        if not self.enabled or not self.refusals:
            return
        with self._lock:
            n, self.refusals, self.since, self._next_at = self.refusals, 0, None, 0.0
        logger.warning("pgq: connected to the broker after %d refusals", n)
        self._tell(None, None)


#: The process's back-off (one per process: Celery reconnects with new transports).
BACKOFF = Backoff()


def enable() -> None:
    """This process is a pgq worker: back off after refusals."""
    BACKOFF.enable()
