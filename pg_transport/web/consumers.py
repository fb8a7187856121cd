"""Which workers consume each queue: asked of the workers themselves.

Postgres does not say which session listens on which channel, so the console asks the
workers, as ``celery inspect active_queues`` does: a broadcast on their remote-control
mailboxes, answered by each worker within a second. The answer is kept for a while (one
broadcast per ``ttl``, not per page view). A worker started without remote control
(``worker_enable_remote_control = False``) does not answer; a role that may not publish
cannot ask.

What Postgres does know is which worker nodes are connected: their sessions are named
``pgq:<pid>:worker:<node>`` (the processes page). A node connected before the question
that did not answer it is named on the queues page, so that a consumer the answers
leave out is not silently missing from the count."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pg_transport.web.reads import ProcessRow

__all__ = ["Consumers", "Seen", "connected", "silent"]

logger = logging.getLogger("pg_transport.web")


@dataclass(frozen=True)
class Seen:
    """Each queue's consuming worker nodes, when asked; ``error`` when asking failed."""

    by_queue: dict[str, list[str]] = field(default_factory=dict)
    workers: int = 0
    at: float | None = None
    error: str | None = None
    #: The nodes that answered, and when they were asked (the database's clock is
    #: compared with it: the sessions' start).
    answered: frozenset[str] = frozenset()
    asked: datetime | None = None


def silent(seen: Seen, processes: Iterable[ProcessRow]) -> list[str]:
    """The worker nodes connected to the database since before ``seen`` asked that did
    not answer it (none when it could not ask). A node started since is not one: it was
    not asked yet."""
    if seen.asked is None or seen.error is not None:
        return []
    first: dict[str, datetime] = {}
    for p in processes:
        if p.node is not None:
            first[p.node] = min(first.get(p.node, p.since), p.since)
    return sorted(n for n, since in first.items() if since < seen.asked and n not in seen.answered)


def connected(processes: Iterable[ProcessRow]) -> list[str]:
    """The worker nodes whose sessions are connected (of any pgq schema in the database)."""
    return sorted({p.node for p in processes if p.node is not None})


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

    def _ask(self, clock: Callable[[], datetime]) -> Seen:
        from celery import Celery

        if self._app is None:
            app = Celery("pgq-web", broker=self.url, set_as_current=False)
            app.conf.broker_transport_options = {"schema": self.schema}
            app.conf.broker_connection_retry_on_startup = False
            self._app = app
        asked = clock()
        try:
            replies = self._app.control.inspect(timeout=self.timeout).active_queues()
        except Exception as exc:  # a role that may not publish, Postgres down: say so
            logger.warning("cannot ask the workers for their queues: %s", exc)
            return Seen(at=time.monotonic(), error=f"{type(exc).__name__}: {exc}", asked=asked)
        return Seen(
            invert(replies),
            len(replies or {}),
            time.monotonic(),
            answered=frozenset(str(node) for node in (replies or {})),
            asked=asked,
        )

    def seen(self, clock: Callable[[], datetime] | None = None) -> Seen:
        """The workers' queues, asked now if the last answer is older than ``ttl``;
        ``clock`` says when (the database's, which the sessions' start is on; this
        host's by default)."""
        with self._lock:
            at = self._seen.at
            if at is None or time.monotonic() - at > self.ttl:
                self._seen = self._ask(clock or (lambda: datetime.now(timezone.utc)))
            return self._seen
