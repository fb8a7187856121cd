"""The consumer's housekeeping thread, alive as long as the consuming process.

Every vt/3 it extends the vt of every message the consumer holds (renewal stops when
the process dies: that is the point). Every cycle it lands acks still waiting for a
claim to ride on. Every few seconds it marks the consumed queues as in use and reaps
queues past their expiry and messages past their TTL, so a SIGKILLed worker's control
queue disappears after its expiry, and looks whether the message table needs a VACUUM
(:meth:`pg_transport.consume.vacuum.Vacuumer.look`; the VACUUM runs on a thread of its
own). The maintenance and the look, one after the other on the same pool, share one
session; renewals and acks go through the consumer's pool (its commits relaxed), so an
idle consumer (nothing held) keeps one session for its housekeeping.

Lease renewal is timely although it shares this thread: what runs beside it is the
acks' DELETE, the maintenance statement (it skips locked messages) and the look (one row
of the statistics views), each milliseconds; nothing here waits for a VACUUM
(tests/integration/test_housekeeping.py times renewals while one runs).

Closing the transport stops the thread and waits for a cycle under way to end
(:meth:`Housekeeper.stop`): once the close returns, the thread sends nothing more to a
database its application may drop next.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

import psycopg

from pg_transport.errors import BrokerUnavailable
from pg_transport.message.rows import Lease

__all__ = ["MAINTAIN_INTERVAL", "Housekeeper"]

logger = logging.getLogger("pg_transport.consume")

# Seconds between marking consumed queues as used and reaping expired ones.
MAINTAIN_INTERVAL = 2.0


class Housekeeper(threading.Thread):
    def __init__(
        self,
        *,
        flush_acks: Callable[[], None],
        held: Callable[[], Sequence[tuple[Lease, float]]],
        renew: Callable[[Sequence[tuple[Lease, float]]], object] | None,
        maintain: Callable[[], None],
        default_vt: float,
        look: Callable[[], object] | None = None,
    ) -> None:
        """``renew``: None when lease renewal is off. ``look``: after each maintenance,
        whether the table needs a VACUUM (None: vacuuming is off)."""
        super().__init__(name="pgq-housekeeping", daemon=True)
        self._flush_acks, self._held, self._renew = flush_acks, held, renew
        self._maintain, self._default_vt, self._look = maintain, default_vt, look
        self._stop_event = threading.Event()

    def stop(self, wait: float = 0.0) -> None:
        """Stop; with ``wait``, wait that long at most for a cycle under way to end."""
        self._stop_event.set()
        if wait > 0 and self.is_alive() and self is not threading.current_thread():
            self.join(wait)

    def run(self) -> None:
        renew_due = maintain_due = monotonic()
        while not self._stop_event.is_set():
            now = monotonic()
            # Acks normally ride on the consumer's next claim within milliseconds; a
            # consumer busy elsewhere must not let them wait past a lease. Landed
            # before renewing, at least every vt/3.
            self._guard("acks", self._flush_acks)
            if now >= renew_due:
                held = self._held()
                if held and self._renew is not None:
                    self._guard("lease renewal", self._renew, held)
                renew_due = now + min((vt for _, vt in held), default=self._default_vt) / 3
            if now >= maintain_due and not self._stop_event.is_set():
                self._guard("queue maintenance", self._maintain)
                if self._look is not None:
                    self._guard("vacuum check", self._look)
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
