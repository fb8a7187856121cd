"""A worker with atomic tasks that cannot hold their promise stops at start-up, in one
line (``pgq: …``), or says once what holds less (a result backend that is not pgq's)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from pg_transport.db.url import scheme_of
from pg_transport.errors import ConfigurationError

__all__ = ["check", "check_or_stop"]

logger = logging.getLogger("pg_transport.atomic")


def _atomic_tasks(app: Any) -> list[Any]:
    return [
        task
        for name, task in sorted(app.tasks.items())
        if getattr(task, "pgq_completes_delivery", False) is True
    ]


def _urls(value: Any) -> list[str]:
    if isinstance(value, str):
        return [u for u in value.split(";") if u]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return []


def check(app: Any) -> list[str]:
    """Raise ConfigurationError for an atomic task ``app``'s worker cannot run with its
    guarantee; the warnings to give (what holds only at least once)."""
    tasks = _atomic_tasks(app)
    if not tasks:
        return []
    conf = app.conf
    first = tasks[0].name
    brokers = _urls(conf.broker_write_url or conf.broker_url)
    if not brokers or any((scheme_of(u) or "").lower() != "pgq" for u in brokers):
        schemes = ", ".join(sorted({f"{scheme_of(u) or '?'}://" for u in brokers})) or "none"
        raise ConfigurationError(
            f"atomic task {first} needs a pgq:// broker (its message is deleted in the "
            f"task's own transaction), and the broker is {schemes}"
        )
    for task in tasks:
        if not task.acks_late:
            raise ConfigurationError(
                f"atomic task {task.name} has acks_late=False: its message would be "
                "acknowledged before the transaction it belongs to; leave AtomicTask's "
                "acks_late=True"
            )
    backend = conf.result_backend
    warnings = []
    if backend and (not isinstance(backend, str) or (scheme_of(backend) or "").lower() != "pgq"):
        kind = f"{scheme_of(backend)}://" if isinstance(backend, str) else repr(backend)
        warnings.append(
            f"atomic tasks ({first}, ...) store their results on a {kind} result backend, "
            "outside their transaction: results are stored at least once (a reader may "
            "see SUCCESS for a run whose writes rolled back and are redone); use pgq's "
            "result backend for results in the same commit"
        )
    return warnings


def check_or_stop(app: Any) -> None:
    from pg_transport.preflight import stop

    try:
        warnings = check(app)
    except ConfigurationError as exc:
        stop(exc)
    for warning in warnings:
        # (Before Celery sets up its logging: written as preflight writes its errors.)
        sys.stderr.write(f"pgq: WARNING: {warning}\n")
        logger.warning("pgq: %s", warning)
