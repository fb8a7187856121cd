"""``pg_transport.transport:Transport``, the name the install hook and users give kombu."""

from __future__ import annotations

from pg_transport.kombu.transport import Transport

__all__ = ["Transport"]
