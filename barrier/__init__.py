"""Postgres-native fan-in barrier and terminal-status guards.

``Barrier(app).dispatch(id, parts, callback, errback)`` arms a barrier and queues
its parts in one transaction. Each part carries the barrier id and its index in
message headers (``pgq_barrier``, ``pgq_barrier_part``), never in its kwargs. The
last part to succeed flips the barrier to FIRED and inserts the callback message
in the same transaction (:mod:`pg_transport.fanin.state`): the callback gets the parts'
results in part order, ``TRANSPORT_MARKER=True`` in its kwargs, and the barrier id
in its ``pgq_barrier`` header, which :func:`barrier_callback` reads to skip a
redelivery once the barrier is COMPLETED.

Importing this package connects the worker-side hooks (:mod:`barrier.hooks`): a
worker imports its app module, and an app module using barriers imports
``barrier``, so nothing else is needed. Settings: :mod:`pg_transport.fanin.settings`.
Inspection for the CLI: :mod:`barrier.inspect`. Guards: :mod:`barrier.guards`.
"""

from __future__ import annotations

from barrier import hooks as _hooks
from barrier.callback import barrier_callback, current_connection
from barrier.dispatch import Barrier, Dispatched
from barrier.guards import Claim, Guards, lock_id, transition, try_lock_id
from barrier.signals import barrier_stranded
from barrier.sweep import sweep
from pg_transport.fanin.errors import BarrierError, BarrierExists, LockHeld
from pg_transport.fanin.protocol import TRANSPORT_MARKER

__all__ = [
    "TRANSPORT_MARKER",
    "Barrier",
    "BarrierError",
    "BarrierExists",
    "Claim",
    "Dispatched",
    "Guards",
    "LockHeld",
    "barrier_callback",
    "barrier_stranded",
    "current_connection",
    "lock_id",
    "sweep",
    "transition",
    "try_lock_id",
]

_hooks.connect()
