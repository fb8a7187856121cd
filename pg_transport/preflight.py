"""A pgq worker or beat with a bad setting stops at start-up with one line, not a traceback.

Celery builds the transport deep inside the worker's start-up; a
:class:`~pg_transport.errors.ConfigurationError` raised there ends the worker with ~60
lines of traceback around the one line that says what is wrong. Receivers
(:mod:`pg_transport.kombu.hooks`) check pgq's settings first (``celeryd_init`` for a
worker; ``import_modules``, which Celery's loader sends as a worker or beat starts,
before beat shows its banner): a bad one is written as ``pgq: <what is wrong>`` on
stderr and the process exits with status 1.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from pg_transport.config import Options
from pg_transport.db.url import parse_url, scheme_of
from pg_transport.errors import ConfigurationError
from pg_transport.message.limits import task_limits

__all__ = ["check", "check_or_stop", "stop"]


def stop(exc: ConfigurationError) -> NoReturn:
    """Say what is wrong in one line and end the process (status 1)."""
    sys.stderr.write(f"pgq: {exc}\n")
    sys.stderr.flush()
    raise SystemExit(1)


def _urls(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split(";")
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return []


def check(app: Any) -> None:
    """Raise ConfigurationError if ``app``'s pgq settings are bad (nothing if not on pgq)."""
    conf = app.conf
    brokers = _urls(conf.broker_write_url or conf.broker_url)
    if brokers and all((scheme_of(u) or "").lower() == "pgq" for u in brokers):
        for url in brokers:
            parse_url(url)
        Options.from_sources(conf.broker_transport_options, os.environ)
        # The flow limits its tasks define (pg_transport.message.limits), as far as they
        # are registered yet (read without finalizing the app).
        for task in list(getattr(app, "_tasks", {}).values()):
            task_limits(task)
    backend = conf.result_backend
    if isinstance(backend, str) and (scheme_of(backend) or "").lower() == "pgq":
        from pg_transport.results.options import ResultOptions

        parse_url(backend)
        ResultOptions.from_sources(conf.result_backend_transport_options, os.environ)


def check_or_stop(app: Any) -> None:
    """:func:`check` ``app``; a bad setting ends the process (:func:`stop`)."""
    try:
        check(app)
    except ConfigurationError as exc:
        stop(exc)
