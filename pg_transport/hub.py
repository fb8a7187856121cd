"""Consuming inside Celery's event loop (the hub) without ever blocking it.

Celery runs its worker on an event loop when the transport says it can. The loop
watches three things of ours: the consumer :class:`~pg_transport.session.Session`
(notifications and statement results), the wake-up pipe (an ack from a pool thread
freed a prefetch slot; an ack on the loop's own thread, as the prefork pool makes them,
needs no pipe: the loop's tick, before it next polls, kicks) and a polling timer
(delayed messages falling due, lapsed leases). Each of them ends in
:meth:`EventLoopDrain.kick`, which puts the next statement on the wire and returns: a
LISTEN for queues newly consumed, else the next claim with every buffered ack riding on
it, else the acks alone. Its rows are handed to Celery when they arrive. While a claim
is out, acks pile up for the next one, and a refill waits a moment (``REFILL_DELAY``)
for more slots to free up while the worker still holds a good part of its prefetch
window, so claims grow with the load instead of costing a statement per task. An idle
consumer, or one running low, claims at once.

A notification only names a channel: it makes that channel's queue worth a claim
again, and nothing more (see :mod:`pg_transport.notify`).
"""

from __future__ import annotations

import logging
import threading
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
# Longest a leaving consumer waits for the answer of a statement it has out (seconds).
RETIRE_TIMEOUT = 5.0


@dataclass
class _InFlight:
    """The statement on the wire: a claim for a channel's queues, bare acks, or LISTEN."""

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
        self._loop_thread = 0
        self._kick_due = False

    # -- registration -------------------------------------------------------------
    def register(self, loop: Any) -> None:
        self.unregister()
        self.session.open()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._kick_due = False
        transport = self.transport
        self._fds = [self.session.fileno(), transport.listener.wake_fd()]
        loop.add_reader(self._fds[0], self.on_readable)
        loop.add_reader(self._fds[1], self.on_wake)
        loop.on_tick.add(self.on_tick)
        self._timer = loop.call_repeatedly(transport.polling_interval or 1.0, self.on_poll)
        loop.call_soon(self.kick)

    def unregister(self) -> None:
        """Leave the loop and close the session; acks it had on the wire are put back
        (they are fenced: landing them twice is harmless)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            for fd in self._fds:
                loop.remove(fd)
            loop.on_tick.discard(self.on_tick)
        self._fds = []
        for timer in (self._timer, self._refill_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._refill_timer = None
        self._refill_due = False
        flight = self._in_flight
        if flight is not None:
            # A statement is out: take its answer; a claim's messages are handed back
            # now rather than when their lease lapses (a dead session gives no answer:
            # they lapse, and its acks are landed on another connection).
            reply = self.session.finish(timeout=RETIRE_TIMEOUT)
            if reply is not None and reply.rows is not None:
                flight.acks = []  # landed with the statement
                if flight.channel is not None:
                    self.drain.release([decode_claimed(row) for row in reply.rows])
        self._abandon_in_flight()
        self.session.close()

    # -- events -------------------------------------------------------------------
    def wake(self) -> bool:
        """An ack freed a prefetch slot: kick before the loop next waits. Only from the
        loop's own thread (the prefork and solo pools ack there, in callbacks the loop
        runs), which needs no waking: :meth:`on_tick` kicks before the loop polls.
        False from any other thread, whose caller writes the wake-up pipe."""
        if self._loop is None or threading.get_ident() != self._loop_thread:
            return False
        self._kick_due = True
        return True

    def on_tick(self) -> None:
        """Every turn of the loop, before it polls: the kick acks on its thread asked for
        (every ack of the turn's callbacks in one statement)."""
        if self._kick_due:
            self._kick_due = False
            self.kick()

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
        # The statement's answer first: a NOTIFY read with a claim's empty answer is for
        # a publish that claim did not see.
        if reply.rows is not None:
            self._finished(reply.rows)
        self.drain.notified(reply.notified)
        self.kick()

    def kick(self) -> None:
        """Send the next statement if none is out: a LISTEN for queues newly consumed,
        a claim where slots are free and queues may hold messages, else the buffered
        acks alone."""
        if self._loop is None or self.session.busy:
            return
        drain = self.drain
        session = self.session
        if session.listen:
            # LISTEN before the first claim of a queue: a publish between that claim
            # coming back empty and the LISTEN would otherwise wait for the poll.
            missing = set(drain.channels()) - session.listening
            if missing:
                self._in_flight = _InFlight([])
                session.send_listen(missing)
                return
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
                session.send("claim", claim_params(
                    queues, vts, limit, attempts, acks,
                    max_bytes=self.transport.store.max_message_bytes,
                ))
                self._refill_due = False
                if self._refill_timer is not None:
                    self._refill_timer.cancel()
                    self._refill_timer = None
            elif acks:
                self._in_flight = _InFlight(acks)
                session.send("ack", {
                    "ids": [t.id for t in acks], "leases": [t.lease for t in acks],
                    "queues": [t.queue for t in acks],
                })
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
            return  # bare acks or LISTEN: done
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
