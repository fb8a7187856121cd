"""Broker URL schemes a user may try first for Postgres, answered with the one to use.

``broker_url = "postgresql://…"`` (or ``postgres://``) is a natural first guess; kombu
would answer ``No such transport`` and suggest a transport that is not pgq. These
aliases resolve to a transport that refuses at once, naming ``pgq://``.
"""

from __future__ import annotations

from typing import Any

from pg_transport.errors import ConfigurationError

__all__ = ["SCHEMES", "PostgresSchemeHint"]

#: The schemes answered with a hint; kombu itself has no transport by these names.
SCHEMES = ("postgresql", "postgres")


class PostgresSchemeHint:
    """Stands for ``postgresql://`` / ``postgres://`` broker URLs: refuses, naming pgq's."""

    #: kombu asks before it parses the URL: the URL is left whole (and never shown).
    can_parse_url = True

    def __init__(self, client: Any = None, **_: Any) -> None:
        raise ConfigurationError(
            "a broker URL starting postgresql:// or postgres:// names no kombu transport: "
            "pgq's scheme is pgq:// (broker_url = 'pgq://user:password@host:5432/dbname', "
            "the rest as in a libpq URL)"
        )
