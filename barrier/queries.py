"""The barrier add-on's own named queries (``barrier.sql``, beside this module); the
counting core's are :mod:`pg_transport.fanin`'s ``fanin.sql``."""

from __future__ import annotations

from pg_transport.sql import load_named

__all__ = ["queries"]


def queries(schema: str) -> dict[str, str]:
    """``barrier.sql``'s queries with ``schema`` composed in (rendered once per schema)."""
    return load_named("barrier.sql", schema, "barrier")
