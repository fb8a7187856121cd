"""pgq: PostgreSQL as a first-class Celery broker.

Installing the package registers the ``pgq://`` scheme with kombu (through a
``.pth`` hook, so apps need not import anything); importing this package
registers it too.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from pg_transport.config import Options
from pg_transport.errors import (
    BrokerRefused,
    BrokerUnavailable,
    BrokerUnreachable,
    ConfigurationError,
    MessageTooLarge,
    NotPermitted,
    PgqError,
    SchemaError,
    TransactionRefused,
)
from pg_transport.publish.batching import batch
from pg_transport.publish.joined import transaction

__all__ = [
    "TRANSPORT",
    "BrokerRefused",
    "BrokerUnavailable",
    "BrokerUnreachable",
    "ConfigurationError",
    "MessageTooLarge",
    "NotPermitted",
    "Options",
    "PgqError",
    "SchemaError",
    "TransactionRefused",
    "batch",
    "transaction",
]

TRANSPORT = "pg_transport.transport:Transport"
TRANSPORT_ALIASES.setdefault("pgq", TRANSPORT)
