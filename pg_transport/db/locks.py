"""Deterministic 64-bit advisory-lock keys.

Python's ``hash()`` is randomised per process; two workers must compute the same
key for the same id, so keys come from blake2b.
"""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["advisory_key"]


def advisory_key(*parts: str) -> int:
    """A signed 64-bit key (Postgres ``bigint``) for ``parts`` joined by NUL."""
    digest = blake2b("\x00".join(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
