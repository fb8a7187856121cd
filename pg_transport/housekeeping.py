"""The consumer's housekeeping thread, alive as long as the consuming process.

Every vt/3 it extends the vt of every message the consumer holds (renewal stops when
the process dies: that is the point). Every cycle it lands acks still waiting for a
claim to ride on. Every few seconds it marks the consumed queues as in use and reaps
queues past their expiry and messages past their TTL, so a SIGKILLed worker's control
queue disappears after its expiry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

import psycopg

from pg_transport.errors import BrokerUnavailable

if TYPE_CHECKING:
    from pg_transport.transport import Transport

__all__ = ["MAINTAIN_INTERVAL", "Housekeeper"]

logger = logging.getLogger("pg_transport.housekeeping")

# Seconds between marking consumed queues as used and reaping expired ones.
MAINTAIN_INTERVAL = 2.0


class Housekeeper(threading.Thread):
    def __init__(self, transport: Transport) -> None:
        super().__init__(name="pgq-housekeeping", daemon=True)
        self.transport = transport
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        transport = self.transport
        default = transport.options.visibility_timeout
        renew_due = maintain_due = monotonic()
        while not self._stop_event.is_set():
            now = monotonic()
            # Acks normally ride on the consumer's next claim within milliseconds; a
            # consumer busy elsewhere must not let them wait past a lease. Landed
            # before renewing, at least every vt/3.
            self._guard("acks", transport.drain.flush_acks)
            if now >= renew_due:
                held = transport.held()
                if held and transport.options.lease_renewal:
                    self._guard("lease renewal", transport.store.renew, held)
                renew_due = now + min((vt for _, vt in held), default=default) / 3
            if now >= maintain_due:
                self._guard("queue maintenance", transport.maintain)
                maintain_due = now + MAINTAIN_INTERVAL
            if self._stop_event.wait(max(min(renew_due, maintain_due) - monotonic(), 0.05)):
                return

    @staticmethod
    def _guard(what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except (psycopg.Error, BrokerUnavailable) as exc:
            # Nothing is lost: a lapsed lease means a redelivery, a late reap a
            # queue that lives a little longer.
            logger.warning("%s failed: %s", what, exc)
