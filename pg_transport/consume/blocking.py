"""Driving the consumer engine from kombu's blocking ``drain_events``.

Consumers that run no event loop (Celery's gevent and eventlet pools, plain kombu
consumers, ``SimpleQueue``) call ``drain_events(timeout)``: deliver what comes, or wait
for it. This driver runs the same engine Celery's event loop runs, so they claim, ack,
wake and dead-letter alike: it kicks the engine, then waits (``poll``) on the
engine's descriptors and on its own timers (the poll, a refill's short wait) until a
message has been handed to kombu or the timeout is up.

A worker shutting down (:meth:`BlockingDriver.interrupt`) must not wait for that timeout:
Celery's gevent and eventlet loops look for a shutdown between two drains (of up to 2 s,
and run one more after they saw it), so the drain under way ends at once, and every
later one waits :data:`STOPPING_WAIT` at most.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from time import monotonic

from pg_transport.consume.engine import Engine
from pg_transport.db import waits

__all__ = ["STOPPING_WAIT", "BlockingDriver"]

#: The longest a drain waits once its worker is shutting down: short, but a wait all the
#: same (a green thread draining in a loop must let the others run).
STOPPING_WAIT = 0.05


class _Timer:
    def __init__(self, due: float, fn: Callable[[], None]) -> None:
        self.due, self.fn, self.cancelled = due, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class BlockingDriver:
    def __init__(self, engine: Engine, polling_interval: float) -> None:
        self.engine = engine
        self.polling_interval = polling_interval or 1.0
        self._timers: list[tuple[float, int, _Timer]] = []
        self._order = itertools.count()
        self._fds: list[int] = []
        self._next_poll = 0.0
        self._stopping = False

    def interrupt(self) -> None:
        """The worker is shutting down: end the drain under way, and wait no longer than
        :data:`STOPPING_WAIT` in the next ones. Safe in a signal handler (a write to the
        wake-up pipe)."""
        self._stopping = True
        self.engine.poke()

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(monotonic() + delay, fn)
        heapq.heappush(self._timers, (timer.due, next(self._order), timer))
        return timer

    def drain(self, timeout: float | None) -> None:
        """Deliver what the engine claims, else wait for a wake-up, a timer or the
        timeout (:class:`TimeoutError`)."""
        engine = self.engine
        # (started afresh, too, once the session died: a drain after the connection error
        # it raised reconnects)
        if engine.timers is not self or not self._fds or not engine.session.is_open:
            self._fds = engine.start(self)
            self._next_poll = 0.0
        engine.looping(True)
        try:
            self._drain(timeout)
        finally:
            # Past this call nothing lands a buffered ack soon: the caller lands its own.
            engine.looping(False)

    def _drain(self, timeout: float | None) -> None:
        engine = self.engine
        start = monotonic()
        seen = engine.delivered
        while True:
            if self._stopping:
                timeout = STOPPING_WAIT if timeout is None else min(timeout, STOPPING_WAIT)
            now = monotonic()
            if now >= self._next_poll:
                self._next_poll = now + self.polling_interval
                engine.on_poll()
            self._run_due(now)
            engine.on_tick()
            engine.kick()
            if engine.delivered != seen:
                return
            now = monotonic()
            if timeout is not None and now - start >= timeout:
                raise TimeoutError()
            wait = min(self._next_poll, self._timers[0][0] if self._timers else self._next_poll)
            wait -= now
            if timeout is not None:
                wait = min(wait, timeout - (now - start))
            ready = waits.readable(self._fds, wait)
            if self._fds[1] in ready:
                engine.on_wake()
            if self._fds[0] in ready:
                engine.on_readable()
            if engine.delivered != seen:
                return

    def _run_due(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.fn()

    def stop(self) -> None:
        self._timers.clear()
        self._fds = []
        self.engine.stop()
