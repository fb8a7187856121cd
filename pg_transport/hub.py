"""Consuming inside Celery's event loop (the hub) without ever blocking it.

Celery runs its worker on an event loop when the transport says it can. The loop
watches three things of ours: the consumer :class:`~pg_transport.session.Session`
(notifications and statement results), the wake-up pipe (an ack freed a prefetch slot)
and a polling timer (delayed messages falling due, lapsed leases). Each of them ends
in :meth:`EventLoopDrain.kick`, which puts the next claim on the wire with every
buffered ack riding on it, and returns. Its rows are handed to Celery when they
arrive. While a claim is out, acks pile up for the next one, and a refill waits a
moment (``REFILL_DELAY``) for more slots to free up while the worker still holds a good
part of its prefetch window, so claims grow with the load instead of costing a
statement per task. An idle consumer, or one running low, claims at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pg_transport.acks import Token
from pg_transport.drain import Wanted
from pg_transport.session import Row, Session
from pg_transport.store import Claimed, claim_params, decode_claimed

if TYPE_CHECKING:
    from pg_transport.drain import Drain
    from pg_transport.transport import Channel, Transport

__all__ = ["EventLoopDrain"]

logger = logging.getLogger("pg_transport.hub")

# Longest a refill claim waits for more prefetch slots to free up (seconds).
REFILL_DELAY = 0.002


@dataclass
class _InFlight:
    """The statement on the wire: a claim for a channel's queues, or bare acks."""

    acks: list[Token]
    channel: Channel | None = None
    queues: list[str] = field(default_factory=list)
    limit: int = 0


class EventLoopDrain:
    def __init__(self, transport: Transport, drain: Drain) -> None:
        self.transport = transport
        self.drain = drain
        options = transport.options
        self.session = Session(
            transport.relaxed, options.schema,
            listen=options.use_notify, prepare=options.use_notify,
        )
        self._loop: Any = None
        self._timer: Any = None
        self._fds: list[int] = []
        self._in_flight: _InFlight | None = None
        self._refill_timer: Any = None
        self._refill_due = False

    # -- registration -------------------------------------------------------------
    def register(self, loop: Any) -> None:
        self.unregister()
        self.session.open()
        self._loop = loop
        transport = self.transport
        self._fds = [self.session.fileno(), transport.listener.wake_fd()]
        loop.add_reader(self._fds[0], self.on_readable)
        loop.add_reader(self._fds[1], self.on_wake)
        self._timer = loop.call_repeatedly(transport.polling_interval or 1.0, self.on_poll)
        loop.call_soon(self.kick)

    def unregister(self) -> None:
        """Leave the loop and close the session; acks it had on the wire are put back
        (they are fenced: landing them twice is harmless)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            for fd in self._fds:
                loop.remove(fd)
        self._fds = []
        for timer in (self._timer, self._refill_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._refill_timer = None
        self._refill_due = False
        if self._in_flight is not None and self._in_flight.channel is not None:
            # A claim is out: take its answer and hand its messages back now rather
            # than when their lease lapses (a dead session gives no answer: they lapse).
            reply = self.session.finish(timeout=5.0)
            if reply is not None and reply.rows is not None:
                self._in_flight.acks = []  # landed with the claim
                released = [decode_claimed(row) for row in reply.rows]
                self.drain.release(released)
        self._abandon_in_flight()
        self.session.close()

    # -- events -------------------------------------------------------------------
    def on_wake(self) -> None:
        self.transport.listener.clear_wakes()
        self.kick()

    def on_poll(self) -> None:
        self.drain.exhausted.clear()
        self.kick()

    def on_readable(self) -> None:
        try:
            reply = self.session.read()
        except BaseException:
            self._abandon_in_flight()
            raise
        self.drain.notified(reply.notified)
        if reply.rows is not None:
            self._finished(reply.rows)
        self.kick()

    def kick(self) -> None:
        """Send the next statement if none is out: a claim where slots are free and
        queues may hold messages, else the buffered acks alone."""
        if self._loop is None or self.session.busy:
            return
        drain = self.drain
        wanted = drain.next_claim()
        if wanted is not None and not self._worth_claiming(wanted):
            return  # the acks wait too: they ride on that claim, a moment later
        acks = drain.acks.take()
        try:
            if wanted is not None:
                channel, queues, limit = wanted.channel, wanted.queues, wanted.limit
                vts = [channel.visibility_timeout(q) for q in queues]
                attempts = [channel.max_attempts(q) for q in queues]
                self._in_flight = _InFlight(acks, channel, queues, limit)
                self.session.send("claim", claim_params(queues, vts, limit, attempts, acks))
                self._refill_due = False
                if self._refill_timer is not None:
                    self._refill_timer.cancel()
                    self._refill_timer = None
            elif acks:
                self._in_flight = _InFlight(acks)
                params = {"ids": [t[0] for t in acks], "read_cts": [t[1] for t in acks]}
                self.session.send("ack", params)
        except BaseException:
            self._abandon_in_flight()
            raise

    def _worth_claiming(self, wanted: Wanted) -> bool:
        """Claim now, or let more slots free up first (up to REFILL_DELAY)?

        A claim per freed slot costs a statement per task. While the consumer still
        holds a good part of its prefetch window (running or queued in the pool) a
        refill can wait for a few more acks; a consumer running low, or all but idle,
        claims at once."""
        window = wanted.channel.qos.prefetch_count or 0
        if self._refill_due or window <= 1:
            return True
        held = window - wanted.limit
        if wanted.limit * 2 >= window or held * 4 <= window:
            return True
        if self._refill_timer is None:
            self._refill_timer = self._loop.call_later(REFILL_DELAY, self._refill)
        return False

    def _refill(self) -> None:
        self._refill_timer = None
        self._refill_due = True
        self.kick()

    def _finished(self, rows: list[Row]) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None or flight.channel is None:
            return  # bare acks: landed
        batch: list[Claimed] = [decode_claimed(row) for row in rows]
        drain = self.drain
        drain.track(flight.channel, batch)
        if len(batch) < flight.limit:
            drain.exhausted.update(flight.queues)
        drain.deliver_all(batch, leased=True)

    def _abandon_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.acks:
            self.drain.land_acks(self.drain.acks.put_back(flight.acks))
