"""The wake-up pipe: how another thread tells the consumer's driver to look again.

An ack made on a pool thread frees a prefetch slot; the driver (Celery's event loop, or
the blocking ``poll()`` loop) is waiting on sockets, so the ack writes a byte here and
the driver, watching the pipe's read end with the session's socket, wakes. One
implementation serves every waiter of pgq: :class:`pg_transport.db.listen.WakePipe`.
"""

from __future__ import annotations

from pg_transport.db.listen import WakePipe

__all__ = ["WakePipe"]
