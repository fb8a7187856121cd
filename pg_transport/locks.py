"""Deterministic 64-bit advisory-lock keys.

Python's ``hash()`` is randomised per process; two workers must compute the same
key for the same id, so keys come from blake2b.
"""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["advisory_key", "lock_space"]


def advisory_key(*parts: str) -> int:
    """A signed 64-bit key (Postgres ``bigint``) for ``parts`` joined by NUL."""
    digest = blake2b("\x00".join(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def lock_space(schema: str, purpose: str = "consumers") -> int:
    """A signed 32-bit key naming ``schema`` (and what the lock is for) in two-key
    advisory locks: the first key; the second is a consumer's token.

    ``consumers``: a consumer's session holds its lock while it lives. ``handoff``: a
    publisher holds a consumer's lock while it hands that consumer a message."""
    digest = blake2b(f"pgq:{purpose}\x00{schema}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)
