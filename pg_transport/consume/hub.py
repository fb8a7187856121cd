"""Driving the consumer engine from Celery's event loop (kombu's ``Hub``).

Celery runs its worker on an event loop when the transport says it can (prefork, solo
and threads pools). The loop watches the engine's two descriptors (the session's socket,
the wake-up pipe), runs its tick before every wait, and keeps a repeating timer for the
poll; each of them ends in the engine, which puts the next statement on the wire and
returns. Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pg_transport.consume.engine import Engine
from pg_transport.consume.source import Handle

__all__ = ["HubDriver"]


class HubDriver:
    """The engine registered with one loop; :meth:`unregister` takes it off again."""

    def __init__(self, engine: Engine, polling_interval: float) -> None:
        self.engine = engine
        self.polling_interval = polling_interval or 1.0
        self._loop: Any = None
        self._fds: list[int] = []
        self._poll: Any = None

    @property
    def registered(self) -> bool:
        return self._loop is not None

    def register(self, loop: Any) -> None:
        self.unregister()
        engine = self.engine
        self._fds = engine.start(self)
        self._loop = loop
        loop.add_reader(self._fds[0], engine.on_readable)
        loop.add_reader(self._fds[1], engine.on_wake)
        loop.on_tick.add(engine.on_tick)
        self._poll = loop.call_repeatedly(self.polling_interval, engine.on_poll)
        loop.call_soon(engine.kick)

    def unregister(self) -> None:
        """Leave the loop; the engine stops (its session is closed)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        for fd in self._fds:
            loop.remove(fd)
        loop.on_tick.discard(self.engine.on_tick)
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        self._fds = []
        self.engine.stop()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Handle:
        assert self._loop is not None, "not registered"
        timer: Handle = self._loop.call_later(delay, fn)
        return timer
