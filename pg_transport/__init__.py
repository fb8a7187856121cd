"""pgq: PostgreSQL as a first-class Celery broker.

Installing the package registers the ``pgq://`` scheme with kombu (through a
``.pth`` hook, so apps need not import anything); importing this package
registers it too. The same goes for the ``pgq`` result backend alias
(``result_backend = "pgq://…"``): it is added to Celery's table when Celery loads it.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from pg_transport import hints as _hints
from pg_transport.atomic import AtomicTask, Completion, LeaseLost
from pg_transport.config import Options
from pg_transport.errors import (
    BrokerRefused,
    BrokerUnavailable,
    BrokerUnreachable,
    ConfigurationError,
    DuplicateTask,
    InvalidMessage,
    LimitError,
    MessageTooLarge,
    NotPermitted,
    NotYetCommitted,
    PgqError,
    PoolerDetected,
    SchemaError,
    TransactionRefused,
    UniqueBusy,
)
from pg_transport.kombu import hooks as _hooks
from pg_transport.kombu.unique_task import UniqueTask
from pg_transport.message.ordering import OrderingError
from pg_transport.message.unique import UniqueError
from pg_transport.publish.batching import batch
from pg_transport.publish.joined import transaction
from pg_transport.results import hooks as _results_hooks

# Celery's signals: a task's ordering defaults become headers as it is sent; a worker or
# beat with a bad pgq setting stops with one line; a worker's sessions carry its node
# name; a pgq worker's consumer hands tasks to its pool under the delivery guard.
_hooks.connect()
# A task a worker on pgq dead-letters ends FAILURE in its app's result backend, and a
# worker on pgq's result backend reaps expired results (pg_transport.results.hooks).
_results_hooks.connect()

try:
    # Installed (wheel or editable): the hook's module sits at the top of site-packages,
    # where the .pth file imported it; the one copy, whose finder is already in place.
    import _pgq_kombu_alias as _alias
except ImportError:  # a source tree on sys.path, never installed
    from pg_transport._hook import _pgq_kombu_alias as _alias

__all__ = [
    "TRANSPORT",
    "AtomicTask",
    "BrokerRefused",
    "BrokerUnavailable",
    "BrokerUnreachable",
    "Completion",
    "ConfigurationError",
    "DuplicateTask",
    "InvalidMessage",
    "LeaseLost",
    "LimitError",
    "MessageTooLarge",
    "NotPermitted",
    "NotYetCommitted",
    "Options",
    "OrderingError",
    "PgqError",
    "PoolerDetected",
    "SchemaError",
    "TransactionRefused",
    "UniqueBusy",
    "UniqueError",
    "UniqueTask",
    "batch",
    "transaction",
]

TRANSPORT = "pg_transport.transport:Transport"
TRANSPORT_ALIASES.setdefault("pgq", TRANSPORT)
# postgresql:// and postgres:// (a first guess) are answered with pgq:// (pg_transport.hints).
for _scheme in _hints.SCHEMES:
    TRANSPORT_ALIASES.setdefault(_scheme, "pg_transport.hints:PostgresSchemeHint")
# Celery's backend aliases: now if Celery's table is loaded, else when it is.
_alias.install()
