"""Consuming inside Celery's event loop (the hub) without ever blocking it.

Celery runs its worker on an event loop when the transport says it can. The loop
watches three things of ours: the consumer :class:`~pg_transport.session.Session`
(notifications and statement results), the wake-up pipe (an ack from a pool thread
freed a prefetch slot; an ack on the loop's own thread, as the prefork pool makes them,
needs no pipe: the loop's tick, before it next polls, kicks) and a polling timer
(delayed messages falling due, lapsed leases). Each of them ends in
:meth:`EventLoopDrain.kick`, which puts the next claim on the wire with every
buffered ack riding on it, and returns. Its rows are handed to Celery when they
arrive. While a claim is out, acks pile up for the next one, and a refill waits a
moment (``REFILL_DELAY``) for more slots to free up while the worker still holds a good
part of its prefetch window, so claims grow with the load instead of costing a
statement per task. An idle consumer, or one running low, claims at once.

A claim that comes back empty also leaves the consumer waiting on its queues (rows in
the ``waiter`` table, written by the claim itself). A publish to one of them then hands
its message over directly: leased to this consumer and sent on the session's own
channel, it is delivered as soon as the NOTIFY is read, with no claim round trip. A
hand-off ends the wait (the publisher deletes every row of it), and so does a claim
that brings messages: one wait, one hand-off at most, so a consumer busy with a task
run inline (the solo pool) is handed nothing it would not read.

A claim that comes back short brought messages, so it begins no wait. The acks of those
messages then ride on a claim too, though its queues are known to be empty: it finds
nothing and the wait begins, rather than leaving a consumer fed a steady stream waiting
nowhere, to be woken by every publish and claim each message itself.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from pg_transport.acks import Token
from pg_transport.drain import Wanted
from pg_transport.session import Reply, Row, Session
from pg_transport.store import (
    Claimed,
    Waiting,
    claim_params,
    decode_claimed,
    decode_handed,
    unwaited,
)

if TYPE_CHECKING:
    from pg_transport.drain import Drain
    from pg_transport.transport import Channel, Transport

__all__ = ["EventLoopDrain"]

logger = logging.getLogger("pg_transport.hub")

# Longest a refill claim waits for more prefetch slots to free up (seconds).
REFILL_DELAY = 0.002
# Longest a leaving consumer waits for Postgres to confirm it waits no more (seconds).
RETIRE_TIMEOUT = 5.0
# Longest the loop waits for a hand-off known to be committed (its NOTIFY follows the
# claim's answer at once; this only bounds a surprise).
HANDOFF_WAIT = 1.0


@dataclass
class _InFlight:
    """The statement on the wire: a claim for a channel's queues, or bare acks."""

    acks: list[Token]
    channel: Channel | None = None
    queues: list[str] = field(default_factory=list)
    limit: int = 0
    waiting: Waiting | None = None


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
        #: Queues this consumer waits on (a publish may hand it a message).
        self.waiting: set[str] = set()

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
        handed = Reply()
        taken = False
        flight = self._in_flight
        if flight is not None:
            # A statement is out: take its answer; a claim's messages are handed back
            # now rather than when their lease lapses (a dead session gives no answer:
            # they lapse, and its acks are landed on another connection).
            reply = self.session.finish(timeout=RETIRE_TIMEOUT, into=handed)
            if reply is not None and reply.rows is not None:
                flight.acks = []  # landed with the statement
                if flight.channel is not None:
                    self.drain.release([decode_claimed(row) for row in reply.rows])
                taken = self._taken(flight, reply.rows, handed)
                self._track_waiting(flight, reply.rows)
        self._abandon_in_flight()
        self._retire(handed, taken)
        self.session.close()

    def _retire(self, handed: Reply, taken: bool) -> None:
        """Stop waiting, and give back every message handed over meanwhile.

        ``unwait`` returns only once no publisher is handing this consumer a message
        any more. Fewer rows gone than the consumer waits with (or a claim that stopped
        the waiting and found it ``taken``) means a publisher took this consumer: its
        hand-off is committed and its NOTIFY is read before leaving. All of them are
        released (fenced: one already taken back by a lapsed lease is left alone)."""
        waited = len(self.waiting)
        self.waiting.clear()
        session = self.session
        if session.token is not None and session.is_open and not session.busy:
            try:
                session.send("unwait", {"waiter": session.token})
                reply = session.finish(RETIRE_TIMEOUT, into=handed)
                if reply is not None and reply.rows:
                    gone = int(reply.rows[0][0] or 0)
                    if (taken or gone < waited) and not handed.handed:
                        session.await_handed(HANDOFF_WAIT, into=handed)
            except psycopg.Error as exc:
                # Its lock goes with the session: publishers pass it over from now on.
                logger.debug("leaving the waiters failed: %s", exc)
        if handed.handed:
            self.drain.release([decode_handed(text) for text in handed.handed])

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
        flight = self._in_flight
        if reply.rows and flight is not None and self._taken(flight, reply.rows, reply):
            # A publisher took this consumer while the claim stopped its waiting: that
            # hand-off is committed and its NOTIFY is right behind the answer. Read it
            # before delivering anything, so that it is leased (renewed) from now on
            # even if a delivery runs a task inline.
            self.session.await_handed(HANDOFF_WAIT, into=reply)
        handed = self._adopt([decode_handed(text) for text in reply.handed])
        # The statement's answer first: what came with it on the socket came after it.
        # A NOTIFY read with a claim's empty answer is for a publish that claim did not
        # see; a hand-off read with it may have taken the wait that very claim began.
        try:
            if reply.rows is not None:
                self._finished(reply.rows)
        except BaseException:
            # Leased and adopted, never to be delivered now: hand them back.
            self.drain.release([claimed for claimed, _ in handed])
            raise
        if handed:
            self._handed(handed)
        self.drain.notified(reply.notified)
        if reply.rows is not None or reply.notified or not handed:
            self.kick()
        # Hand-offs alone: no claim now. The task just handed over should have the
        # process (and the GIL) to itself to start; the consumer waits nowhere now, so
        # any publish meanwhile wakes it with a NOTIFY, and the task's ack (a wake-up)
        # brings the claim that begins its next wait.

    def _taken(self, flight: _InFlight, rows: list[Row], read: Reply) -> bool:
        """Whether the claim ``flight``, answering ``rows``, stopped this consumer's
        waiting and found its rows gone with no hand-off ``read`` yet (a publisher took
        them: the hand-off follows)."""
        waiting = flight.waiting
        if waiting is None or not waiting.unwait or not rows or read.handed:
            return False
        return unwaited(rows) < len(self.waiting)

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
        if wanted is None and acks and not self.waiting and self.session.token is not None:
            # Every queue came back short, and this consumer waits on none of them (its
            # last claim brought messages). Rather than land the acks alone, let them
            # ride on a claim that begins the wait if it finds nothing: the next publish
            # is then handed over, instead of waking this consumer for a claim of its own.
            wanted = drain.next_wait()
        try:
            if wanted is not None:
                channel, queues, limit = wanted.channel, wanted.queues, wanted.limit
                vts = [channel.visibility_timeout(q) for q in queues]
                attempts = [channel.max_attempts(q) for q in queues]
                waiting = self._waiting(queues, vts)
                self._in_flight = _InFlight(acks, channel, queues, limit, waiting)
                self.session.send(
                    "claim", claim_params(queues, vts, limit, attempts, acks, waiting)
                )
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

    def _waiting(self, queues: list[str], vts: list[float]) -> Waiting | None:
        """What the claim says about waiting: wait on every queue of the claim if it
        comes back empty (while waiting nowhere yet); stop waiting if it does not."""
        token = self.session.token
        if token is None:
            return None
        if self.waiting:
            return Waiting(token, unwait=True)
        return Waiting(token, queues, vts)

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
        self._track_waiting(flight, rows)
        drain.deliver_all(batch, leased=True)

    def _track_waiting(self, flight: _InFlight, rows: list[Row]) -> None:
        """What the claim ``flight`` did to this consumer's waiting, answering ``rows``:
        an empty claim waits on its queues, one that brings messages stops waiting."""
        waiting = flight.waiting
        if waiting is None:
            return
        if not rows:
            self.waiting.update(waiting.queues)
        elif waiting.unwait:
            self.waiting.clear()

    def _adopt(self, batch: list[Claimed]) -> list[tuple[Claimed, Channel | None]]:
        """Messages a publish handed to this consumer, each with the channel consuming
        its queue (None: none does any more), leased like claimed ones until delivered."""
        if not batch:
            return []
        adopted: list[tuple[Claimed, Channel | None]] = []
        for claimed in batch:
            channel = self._consumer_of(claimed.queue)
            if channel is not None:
                self.drain.track(channel, [claimed])
            adopted.append((claimed, channel))
        return adopted

    def _handed(self, adopted: list[tuple[Claimed, Channel | None]]) -> None:
        """Deliver handed messages like claimed ones; release those of queues no longer
        consumed. A hand-off ends the wait it was for: every waiting row is gone."""
        self.waiting.clear()
        drain = self.drain
        for claimed, _ in adopted:
            # The queue is worth a claim again: the consumer waits there no more.
            drain.exhausted.discard(claimed.queue)
        orphans = [claimed for claimed, channel in adopted if channel is None]
        if orphans:
            drain.release(orphans)
        # In order; should a delivery fail, the rest is released (see deliver_all).
        drain.deliver_all([claimed for claimed, channel in adopted if channel], leased=True)

    def _consumer_of(self, queue: str) -> Channel | None:
        for channel in self.transport.consuming_channels():
            acked, _ = channel.consuming()
            if queue in acked:
                return channel
        return None

    def _abandon_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.acks:
            self.drain.land_acks(self.drain.acks.put_back(flight.acks))
