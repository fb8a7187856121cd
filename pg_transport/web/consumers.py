"""Which workers consume each queue: asked of the workers themselves.

Postgres does not say which session listens on which channel, so the console asks the
workers, as ``celery inspect active_queues`` does: a broadcast on their remote-control
mailboxes, answered by each worker within a second. The answer is kept for a while (one
broadcast per ``ttl``, not per page view). A worker started without remote control
(``--without-control``) does not answer; a role that may not publish cannot ask."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Consumers", "Seen"]

logger = logging.getLogger("pg_transport.web")


@dataclass(frozen=True)
class Seen:
    """Each queue's consuming worker nodes, when asked; ``error`` when asking failed."""

    by_queue: dict[str, list[str]] = field(default_factory=dict)
    workers: int = 0
    at: float | None = None
    error: str | None = None


def invert(replies: dict[str, Any] | None) -> dict[str, list[str]]:
    """``active_queues`` replies ({node: [queue declaration, …]}) as {queue: [node, …]};
    anything malformed in a reply (a worker's answer is not trusted) is skipped."""
    by_queue: dict[str, list[str]] = {}
    for node, queues in (replies or {}).items():
        if not isinstance(queues, list):
            continue
        for queue in queues:
            name = queue.get("name") if isinstance(queue, dict) else None
            if isinstance(name, str):
                by_queue.setdefault(name, []).append(str(node))
    return {q: sorted(set(nodes)) for q, nodes in by_queue.items()}


class Consumers:
    """Asks at most once per ``ttl`` seconds; the last answer meanwhile."""

    def __init__(self, url: str, schema: str, *, ttl: float, timeout: float = 1.0) -> None:
        self.url = url
        self.schema = schema
        self.ttl = ttl
        self.timeout = timeout
        self._lock = threading.Lock()
        self._seen = Seen()
        self._app: Any = None

    def _ask(self) -> Seen:
        from celery import Celery

        if self._app is None:
            app = Celery("pgq-web", broker=self.url, set_as_current=False)
            app.conf.broker_transport_options = {"schema": self.schema}
            app.conf.broker_connection_retry_on_startup = False
            self._app = app
        try:
            replies = self._app.control.inspect(timeout=self.timeout).active_queues()
        except Exception as exc:  # a role that may not publish, Postgres down: say so
            logger.warning("cannot ask the workers for their queues: %s", exc)
            return Seen(at=time.monotonic(), error=f"{type(exc).__name__}: {exc}")
        return Seen(invert(replies), len(replies or {}), time.monotonic())

    def seen(self) -> Seen:
        """The workers' queues, asked now if the last answer is older than ``ttl``."""
        with self._lock:
            at = self._seen.at
            if at is None or time.monotonic() - at > self.ttl:
                self._seen = self._ask()
            return self._seen
