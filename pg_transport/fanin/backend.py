"""The database side of the barrier for one Celery app: connections, store, queries.

An app's barrier state lives in the same database and schema as its queue (the
broker URL and the ``schema`` transport option), which is what lets a part's
completion and the callback's message commit in one transaction.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from pg_transport.config import Options
from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.db.retry import TRANSIENT, attempt
from pg_transport.db.url import mask_url, scheme_of
from pg_transport.errors import ConfigurationError
from pg_transport.fanin.settings import BarrierSettings
from pg_transport.publish.publisher import Publisher
from pg_transport.sql import load_named
from pg_transport.store import Store

__all__ = ["Backend", "backend_for", "broker_url", "forget", "uses_pgq"]

logger = logging.getLogger("pg_transport.fanin")

T = TypeVar("T")


def broker_url(app: Any) -> str:
    url = app.conf.broker_write_url or app.conf.broker_url or ""
    return str(url)


def uses_pgq(app: Any) -> bool:
    """Whether the app's broker is pgq (the barrier needs it; other apps are left alone)."""
    return broker_url(app).lower().startswith("pgq://")


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying in a worker hook (see pg_transport.db.retry.TRANSIENT)."""
    return TRANSIENT.retries(exc)


@dataclass(frozen=True, eq=False)
class Backend:
    app: Any
    schema: str
    connector: Connector
    store: Store
    publisher: Publisher
    q: Mapping[str, str]
    settings: BarrierSettings
    native_delayed_delivery: bool = True

    def run(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run idempotent ``work`` on a pooled connection, retrying transient failures
        with backoff for a while (the TRANSIENT policy, up to 30 s: worker hooks have no
        caller to report to; past it the stuck sweep gives the barrier up)."""

        def once() -> T:
            with self.connector.connection() as conn:
                return work(conn)

        return attempt(TRANSIENT, once)

    def close(self) -> None:
        self.connector.close()


# Apps live as long as their process; a backend is dropped only by forget().
_backends: dict[Any, Backend] = {}
_lock = threading.Lock()


def _build(app: Any, environ: Mapping[str, str]) -> Backend:
    url = broker_url(app)
    if not uses_pgq(app):
        scheme = scheme_of(url)
        uses = f"a {scheme}:// broker" if scheme else "a broker URL without a scheme"
        raise ConfigurationError(f"the barrier needs a pgq:// broker, app {app.main!r} uses {uses}")
    options = Options.from_sources(app.conf.broker_transport_options, environ)
    # Behind a transaction pooler (use_notify off), as the transport's: no session
    # state, nothing prepared (the barrier's SQL names every table and function by schema).
    own = options.use_notify
    connector = Connector(
        url_to_conninfo(url),
        display_url=mask_url(url),
        application_name="pgq-barrier",
        prepare_threshold=5 if own else None,
        pin_search_path=own,
        idle_timeout=options.pool_idle_timeout,  # (as the transport's pools)
    )
    ensure_schema(connector, options.schema, auto_migrate=options.auto_migrate)
    return Backend(
        app=app,
        schema=options.schema,
        connector=connector,
        store=Store(connector, options.schema),
        publisher=Publisher(connector, options.schema, unique_wait=options.unique_wait),
        q=load_named("fanin.sql", options.schema, "pg_transport.fanin"),
        settings=BarrierSettings.from_app(app),
        native_delayed_delivery=options.native_delayed_delivery,
    )


def backend_for(app: Any) -> Backend:
    """The app's backend, built on first use (connecting, migrating if allowed)."""
    backend = _backends.get(app)
    if backend is not None:
        return backend
    with _lock:
        backend = _backends.get(app)
        if backend is None:
            backend = _backends[app] = _build(app, os.environ)
        return backend


def forget(app: Any) -> None:
    """Close and drop the app's backend (tests, or an app reconfigured at runtime)."""
    with _lock:
        backend = _backends.pop(app, None)
    if backend is not None:
        backend.close()
