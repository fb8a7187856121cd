"""``from pg_transport import identity`` (contract): the task identity registry, kept in
:mod:`pg_transport.message.identity`; these are its functions, on its one registry."""

from __future__ import annotations

from pg_transport.message.identity import clear, recover, register, registered, watch, watched

__all__ = ["clear", "recover", "register", "registered", "watch", "watched"]
