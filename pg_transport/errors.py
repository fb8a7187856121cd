"""Exceptions pgq raises. Driver errors are translated into these at the boundary."""

from __future__ import annotations

__all__ = [
    "BrokerRefused",
    "BrokerUnavailable",
    "BrokerUnreachable",
    "ConfigurationError",
    "DuplicateTask",
    "InvalidMessage",
    "LimitError",
    "MessageTooLarge",
    "NotPermitted",
    "PgqError",
    "PoolerDetected",
    "SchemaError",
    "TransactionRefused",
    "UniqueBusy",
]


class PgqError(Exception):
    """Base of every error pgq raises on purpose."""


class ConfigurationError(PgqError, ValueError):
    """A transport option, environment variable or URL is invalid."""


class LimitError(ConfigurationError):
    """A flow limit (rate, burst, concurrency, limiter name or key) is invalid: the
    message names the option and the value (docs/flow-control.md)."""


class BrokerUnavailable(PgqError, ConnectionError):
    """Postgres could not be reached, or refused us (host, password, database)."""


class BrokerUnreachable(BrokerUnavailable):
    """Postgres did not answer, or is starting or stopping: worth retrying."""


class BrokerRefused(BrokerUnavailable):
    """Postgres answered and refused us (password, role, database, pg_hba): retrying
    the same URL cannot help, so it is not a recoverable connection error."""


class SchemaError(PgqError):
    """The pgq schema is missing, outdated, or cannot be created with our rights."""


class InvalidMessage(PgqError, ValueError):
    """A message holds a value pgq cannot store (a NaN, an infinity, an expiration past
    any date): the error names the field; it was not published."""


class MessageTooLarge(PgqError, ValueError):
    """A message is larger than ``max_message_bytes``: it was not published."""


class NotPermitted(PgqError, PermissionError):
    """The role may not do this (a publisher-only role declaring a queue, say): the
    message says which role may, or how to do without."""


class DuplicateTask(PgqError):
    """A publish with ``unique_conflict="raise"`` found its unique key held by another
    task (``existing_id``): nothing was published."""

    def __init__(self, message: str, *, key: str, existing_id: str) -> None:
        super().__init__(message)
        self.key = key
        self.existing_id = existing_id


class UniqueBusy(PgqError):
    """A unique publish waited ``unique_wait`` seconds for a transaction that inserted the
    same key and had not ended (an application's transaction left open): nothing was
    published."""


class TransactionRefused(PgqError):
    """pgq will not publish in this transaction (another database or server than the
    broker's, another driver, no transaction open, the transaction lost): the message
    names both sides. Nothing was published, in the transaction or apart from it."""


class NotYetCommitted(PgqError):
    """A task's result was asked for inside the transaction that published it: no worker
    can see the task before that transaction commits, so the wait could only time out."""


class PoolerDetected(BrokerRefused):
    """A transaction pooler (PgBouncer's ``pool_mode = transaction``, say) stands between
    pgq and Postgres while pgq counts on a session of its own (``use_notify`` on): the
    message names ``use_notify=false``, the setting that makes pgq work behind one."""
