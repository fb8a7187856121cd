"""Django: publishes made inside ``transaction.atomic()`` join its transaction.

Opt-in, once per process (in the module that builds the Celery app, or an
``AppConfig.ready()``)::

    from pg_transport.integrations.django import join_atomic

    join_atomic()               # the "default" database holds the broker's schema

From then on, in every thread, a ``task.delay()``, ``apply_async()``, canvas or barrier
dispatch made inside ``transaction.atomic()`` on that database is written in its
transaction: it exists when the outermost block commits, and is gone if the block, or
the inner ``atomic()`` (a savepoint) it was made in, rolls back. Outside ``atomic()``
publishing is as before (``delay_on_commit`` and ``transaction.on_commit`` go on working,
after the commit, apart from it). A database that is not the broker's is refused at the
first publish (:class:`~pg_transport.errors.TransactionRefused`), never published apart.
"""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.connection import ConnectionProxy

from pg_transport.publish import joined
from pg_transport.publish.callers import Caller, caller_for

__all__ = ["join_atomic", "leave_atomic"]

_joiners: dict[str, joined.Joiner] = {}


def join_atomic(using: str = DEFAULT_DB_ALIAS) -> None:
    """Join ``transaction.atomic()`` blocks on database ``using`` (its backend must be
    ``postgresql`` on psycopg 3: anything else is refused here, at once)."""
    if using in _joiners:
        return
    # The proxy stands for the publishing thread's own connection of the alias.
    caller = caller_for(ConnectionProxy(connections, using))

    def joiner() -> Caller | None:
        return caller if connections[using].in_atomic_block else None

    _joiners[using] = joiner
    joined.join(joiner)


def leave_atomic(using: str = DEFAULT_DB_ALIAS) -> None:
    """Stop joining ``atomic()`` blocks on ``using``."""
    joiner = _joiners.pop(using, None)
    if joiner is not None:
        joined.leave(joiner)
