"""The consumer: one engine, whichever pool or loop drives it.

One non-blocking Postgres session (:class:`~pg_transport.consume.session.Session`)
carries a consumer's LISTENs and its statements, one at a time: a LISTEN for queues newly
consumed, a pop for queues consumed without acks, a claim (the acks buffered since the
last one riding on it), or those acks alone. The engine decides what to send next
(:meth:`Engine.kick`) and takes what comes back (:meth:`Engine.on_readable`), handing
messages to kombu. It never waits and never runs the application's code beyond kombu's
delivery callback: a driver waits for it — Celery's event loop
(:mod:`~pg_transport.consume.hub`) or a ``poll()`` loop for kombu's blocking
``drain_events`` (:mod:`~pg_transport.consume.blocking`) — and calls it when the session's
socket or the wake-up pipe is readable, or a timer is due.

Three things keep it cheap:

* Acks ride on claims: a finished task's ack waits in an
  :class:`~pg_transport.consume.acks.AckBuffer` and the next claim deletes it.
* Queues known to be empty are not asked again: a claim that comes back short marks the
  queues that gave less than their share exhausted until a notification names them (a
  publish) or the poll (delayed messages falling due and lapsed leases send none). Over
  many queues a claim names at most as many as it has room for, asking each for a share
  (:meth:`Engine._claimable`): it locks about as many rows as it takes. LISTEN comes
  before a queue's first claim, and a notification read with a claim's answer is taken
  after it, so no wake-up is lost.
* An idle consumer knows when it next has work without a notification: after a claim
  comes back short (and at every poll) it asks when the first message of its queues that
  is not visible yet — a delayed one, or one whose lease runs out — becomes visible
  (``next_due``), and claims at that moment (:meth:`Engine.on_due`). A delayed publish
  wakes the queue's consumers too, so they ask again.
* A refill waits a moment (``REFILL_DELAY``) for more prefetch slots to free up while the
  worker still holds a good part of its window, so claims grow with the load instead of
  costing a statement per task; an idle consumer, or one running low, claims at once.

Claimed messages not handed to kombu yet are leased like delivered ones (:meth:`held`).
A message that cannot be delivered goes to :mod:`~pg_transport.consume.undeliverable`,
which dead-letters it and sends ``message_poisoned`` on a thread of its own.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic

import psycopg

from pg_transport import fencing
from pg_transport.consume import follows
from pg_transport.consume.acks import AckBuffer
from pg_transport.consume.listener import Listener
from pg_transport.consume.session import Row, Session
from pg_transport.consume.settles import Settles
from pg_transport.consume.source import Handle, Source, Statements, Timers, Want
from pg_transport.consume.undeliverable import Undeliverable
from pg_transport.consume.wakeup import WakePipe
from pg_transport.db.retry import rolled_back
from pg_transport.errors import BrokerUnavailable
from pg_transport.message import envelope, ordering
from pg_transport.message.rows import FOLLOWS_MISSING, Claimed, Lease
from pg_transport.store import Store, claim_featured, claim_limits, claim_params, read_claim

__all__ = ["UNLIMITED_BATCH", "Engine"]

logger = logging.getLogger("pg_transport.consume")

# Claim batch when the consumer set no prefetch limit; the pop batch of no-ack queues.
UNLIMITED_BATCH = 100
# Longest a refill claim waits for more prefetch slots to free up (seconds).
REFILL_DELAY = 0.002
# Delivered messages of ordering keys remembered at most (their acks fetch the next).
MAX_KEYED = 100_000
# Longest a stopping consumer waits for the answer of a statement it has out (seconds).
RETIRE_TIMEOUT = 5.0
# Added to the time since the last claim was sent when next_due looks back for messages
# that fell due after it (seconds): the two statements' trips to the server differ.
DUE_SLACK = 0.002


@dataclass
class _InFlight:
    """The statement on the wire."""

    kind: str
    acks: list[Lease] = field(default_factory=list)
    queues: Sequence[str] = ()
    limit: int = 0
    sent: float = 0.0
    #: Most candidates a claim took of each queue (a queue that gave fewer is empty).
    per_queue: int = 0
    #: The claim statement sent (lean_claim, claim, flow_claim or fair_claim).
    statement: str = ""


class Engine:
    def __init__(
        self,
        source: Source,
        store: Store,
        session: Session,
        *,
        max_message_bytes: int,
        listener: Listener | None = None,
    ) -> None:
        self.source = source
        self.store = store
        self.session = session
        #: Behind a pooler, the direct session that LISTENs for this one (listen_url).
        self.listener = listener
        self.max_message_bytes = max_message_bytes
        self._acks = AckBuffer()
        self._undeliverable = Undeliverable(store)
        self._settles = Settles(self._send_settles)
        self._pipe = WakePipe()
        #: Queues whose last claim (or pop) came back short.
        self.exhausted: set[str] = set()
        #: Whether the last claim's answer said a flow limit exists: claims are then sent
        #: as flow_claim, and as claim again once an answer says none is left.
        self.flow = False
        #: Whether the last claim's answer said it met a message the gates judge (an
        #: ordering key, a follows link): claims are then sent as claim, and as
        #: lean_claim again once an answer does not say so.
        self.featured = False
        #: Messages handed to kombu so far (a blocking driver returns once this grows).
        self.delivered = 0
        self.statements = Statements()
        self._timers: Timers | None = None
        self._in_flight: _InFlight | None = None
        self._refill: Handle | None = None
        self._refill_due = False
        # The timer set for the next message falling due, and whether to ask again.
        self._due: Handle | None = None
        self._due_stale = True
        # When the last claim answered was sent (monotonic), until next_due uses it.
        self._looked: float | None = None
        self._loop_thread = 0
        self._looping = False
        self._kick_due = False
        # Claimed, not yet handed to kombu: id -> (lease, vt). Renewed too.
        self._undelivered: dict[int, tuple[Lease, float]] = {}
        self._undelivered_lock = threading.Lock()
        # Wake-up channel -> queue and queue -> channel, for every queue consumed so far.
        self._channels: dict[str, str] = {}
        self._queue_channels: dict[str, str] = {}
        # Delivered messages of an ordering key (ids): their acks ride on a claim.
        self._keyed: set[int] = set()
        #: When the claim whose rows are being delivered was sent (monotonic): their
        #: leases began no earlier (kombu's QoS counts their lapse from it).
        self.claim_sent = monotonic()
        # Where the next claim over more queues than it may name starts (a rotation),
        # and whether the last claim came back full (see _claimable).
        self._turn = 0
        self._deep = False
        # The queues of the last wants seen, and their wake-up channels (see kick).
        self._wanted: list[tuple[Sequence[str], Sequence[str]]] = []
        self._wanted_channels: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def timers(self) -> Timers | None:
        """The driver running the engine (None: stopped)."""
        return self._timers

    def start(self, timers: Timers) -> list[int]:
        """Open the session (if need be) under a driver's ``timers``; the descriptors
        the driver must watch: the session's socket, then the wake-up pipe."""
        if self._timers is not timers:
            self.stop()
        self.session.open()
        self._timers = timers
        self._due_stale = True
        self._loop_thread = threading.get_ident()
        self._kick_due = False
        self.looping(True)
        return [self.session.fileno(), self._pipe.fileno()]

    def stop(self) -> None:
        """Leave the driver and close the session. A statement out is finished first: a
        claim's messages are handed back now rather than when their lease lapses (a dead
        session gives no answer: they lapse, and the acks it carried are landed on
        another connection)."""
        self._timers = None
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        self._refill_due = False
        self._disarm_due()
        flight = self._in_flight
        if flight is not None:
            reply = self.session.finish(timeout=RETIRE_TIMEOUT)
            if reply is not None and reply.rows is not None:
                if flight.kind == "claim":
                    claimed = read_claim(flight.acks, reply.rows)
                    self.release([c for c in claimed if not c.held])
                elif flight.kind == "ack":
                    self._acked(flight, reply.rows)
                flight.acks = []  # landed with the statement
        self._abandon_in_flight()
        self.session.close()

    def close(self) -> None:
        """Stop, land the acks still buffered, finish the rows handed to be
        dead-lettered, and close the wake-up pipe."""
        self.stop()
        if self.listener is not None:
            self.listener.close()
        # Off this thread (Celery's, reconnecting): through a failover these acks keep
        # trying for the fenced window; the close below waits for them a moment only.
        self.land_acks(self._acks.close(), background=True)
        self._settles.close()
        self._undeliverable.close()
        self._pipe.close()

    def on_loop_thread(self) -> bool:
        """Whether the caller runs in the driver's loop (in a callback the loop runs, on
        its thread): the thread that must never wait for a round trip."""
        return (
            self._timers is not None
            and self._looping
            and threading.get_ident() == self._loop_thread
        )

    def looping(self, inside: bool) -> None:
        """A blocking driver enters (True) or leaves (False) its loop: outside it, acks
        and outcomes land where they are made (nothing else would land them soon)."""
        self._looping = inside
        if inside:
            self._acks.start()
        else:
            self._acks.pause()

    @property
    def busy(self) -> bool:
        """Whether a statement is on the wire (its answer not read yet)."""
        return self.session.busy

    @property
    def waiting(self) -> bool:
        """Whether the engine waits for a wake-up: running, no statement out, and every
        queue it consumes known to be empty (until a publish, an ack or the poll)."""
        if self._timers is None or self.session.busy:
            return False
        wants = self.source.wants()
        queues = {q for w in wants for q in (*w.acked, *w.unacked)}
        return bool(queues) and queues <= frozenset(self.exhausted)  # (one step: atomic)

    # -- events ------------------------------------------------------------------------
    def wake(self) -> None:
        """A prefetch slot is free (an ack): claim soon. On the driver's own thread (the
        prefork and solo pools ack there, in callbacks the loop runs) the next tick
        kicks, every ack of that turn riding on one statement; from any other thread
        the wake-up pipe wakes the driver."""
        if self.on_loop_thread():
            self._kick_due = True
        else:
            self.poke()

    def on_tick(self) -> None:
        """Once per turn of the driver's loop, before it waits."""
        if self._kick_due:
            self._kick_due = False
            self.kick()

    def on_wake(self) -> None:
        self._pipe.clear()
        if self.listener is not None:
            self.notified(self.listener.take())
        self.kick()

    def on_poll(self) -> None:
        """The polling interval: every queue may hold something again."""
        self.exhausted.clear()
        self._due_stale = True
        self.kick()

    def on_due(self) -> None:
        """The first message not visible yet (:meth:`_arm_due`) is due: claim it now."""
        self._due = None
        self.exhausted.clear()
        self._due_stale = True
        self.kick()

    def _arm_due(self, seconds: float | None) -> None:
        """Claim again in ``seconds`` (the answer of ``next_due``; None: nothing due)."""
        self._disarm_due()
        if seconds is not None and self._timers is not None:
            self._due = self._timers.call_later(max(seconds, 0.0), self.on_due)

    def _disarm_due(self) -> None:
        if self._due is not None:
            self._due.cancel()
            self._due = None

    def poke(self) -> None:
        """Wake the driver through the wake-up pipe (from a thread not its own: the
        listener's, on a notification)."""
        self._pipe.wake()

    def reset(self, queue: str) -> None:
        """A new consumer of ``queue``: claim it at once."""
        self.exhausted.discard(queue)
        self.wake()

    def on_readable(self) -> None:
        try:
            reply = self.session.read()
        except psycopg.Error as exc:
            if not rolled_back(exc):
                self._abandon_in_flight()
                raise
            # The server rolled the statement back whole (a deadlock with another
            # session's ack, say): nothing was claimed, its acks did not land, and the
            # session is still usable. Land the acks and claim again.
            logger.info("pgq: a claim was rolled back by the server (%s); claiming again", exc)
            self._abandon_in_flight()
            self.kick()
            return
        except BaseException:
            self._abandon_in_flight()
            raise
        # The statement's answer first: a notification read with a claim's empty
        # answer is for a publish that claim did not see.
        if reply.rows is not None:
            self._finished(reply.rows)
        self.notified(reply.notified)
        self.kick()

    def notified(self, channels: set[str]) -> None:
        """Channels notified: their queues are worth a claim again. A channel of no queue
        consumed here is ignored (a notification is only ever a hint)."""
        for channel in channels:
            queue = self._channels.get(channel)
            if queue is not None:
                self.exhausted.discard(queue)

    # -- what to send next -------------------------------------------------------------
    def kick(self) -> None:
        """Send the next statement if none is out: a LISTEN for queues newly consumed, a
        pop for no-ack queues that may hold messages, a claim where slots are free and
        queues may hold messages, else the buffered acks alone."""
        if self._timers is None or self.session.busy:
            return
        try:
            self._send_next()
        except BaseException:
            self._abandon_in_flight()
            raise

    def _send_next(self) -> None:
        session = self.session
        wants = self.source.wants()
        channels = self._wake_channels(wants)
        if self.listener is not None:
            self.listener.want(channels)
        if session.listen:
            missing = channels - session.listening
            if missing:
                self._in_flight = _InFlight("listen")
                session.send_listen(missing)
                self.statements.listen += 1
                return
        unacked = sorted({q for w in wants for q in w.unacked} - self.exhausted)
        if unacked:
            self._in_flight = _InFlight("pop", queues=unacked, limit=UNLIMITED_BATCH)
            session.send(
                "pop",
                {
                    "queues": unacked,
                    "limit": UNLIMITED_BATCH,
                    "max_bytes": self.max_message_bytes,
                    "max_message_bytes": self.max_message_bytes,
                },
            )
            self.statements.pop += 1
            return
        want = next(
            (
                w
                for w in wants
                if w.acked and w.room != 0 and any(q not in self.exhausted for q in w.acked)
            ),
            None,
        )
        if want is not None and not self._worth_claiming(want):
            return  # the acks wait too: they ride on that claim, a moment later
        acks = self._acks.take()
        queues: list[str] = []
        if want is not None:
            queues = self._claimable(want)
        elif acks and self._keyed:
            # An ack ending a message of an ordering key: the claim carrying it takes the
            # key's next message (the claim query's hand-off), even from a queue a claim
            # found empty a moment ago, where the next one waited parked. An ack alone
            # would leave it to the trigger's wake-up and one more round trip.
            ended = {t.queue for t in acks if t.id in self._keyed}
            want = next((w for w in wants if w.room != 0 and ended.intersection(w.acked)), None)
            if want is not None:
                queues = [q for q in want.acked if q in ended]
        # An ack of a keyed message rides on claim, whose hand-off takes the key's next.
        hands_on = any(token.id in self._keyed for token in acks)
        for token in acks:
            self._keyed.discard(token.id)
        if want is not None:
            limit = want.room if want.room is not None else UNLIMITED_BATCH
            queues = queues[: max(limit, 1)]
            per_queue = -(-limit // max(len(queues), 1))
            if any(self.source.fair_share(q) for q in queues):
                statement = "fair_claim"
            elif self.flow:
                statement = "flow_claim"
            else:
                statement = "claim" if self.featured or hands_on else "lean_claim"
            self._in_flight = _InFlight(
                "claim",
                acks,
                queues,
                limit,
                sent=monotonic(),
                per_queue=per_queue,
                statement=statement,
            )
            session.send(
                statement,
                claim_params(
                    queues,
                    [self.source.visibility_timeout(q) for q in queues],
                    limit,
                    [self.source.max_attempts(q) for q in queues],
                    acks,
                    max_bytes=self.max_message_bytes,
                    per_queue=per_queue,
                ),
            )
            self.statements.claim += 1
            self.statements.lean += statement == "lean_claim"
            self.statements.acks_riding += len(acks)
            if want.room is not None and (want.window - want.room) * 4 <= want.window:
                self.statements.claims_low += 1
            self._refill_due = False
            if self._refill is not None:
                self._refill.cancel()
                self._refill = None
        elif acks:
            self._in_flight = _InFlight("ack", acks)
            session.send(
                "ack",
                {
                    "ids": [t.id for t in acks],
                    "leases": [t.lease for t in acks],
                    "queues": [t.queue for t in acks],
                },
            )
            self.statements.ack += 1
            self.statements.acks_alone += len(acks)
        elif self._due_stale:
            # Nothing to claim and nothing to ack: when does something fall due?
            queues = sorted({q for w in wants for q in (*w.acked, *w.unacked)})
            if queues:
                self._due_stale = False
                self._in_flight = _InFlight("next_due", queues=queues)
                session.send("next_due", {"queues": queues, "since": self._since_looked()})
                self.statements.next_due += 1

    def _since_looked(self) -> float:
        """Seconds since the last claim was sent, for next_due (once: then 0).

        A message that fell due after that claim looked, and before next_due runs (while
        the claim's answer came back and was delivered), is found by neither: the claim
        did not see it visible, and next_due looks only past its own now. next_due looks
        back this far, and such a message is claimed at once. Once only: a next_due not
        following a claim (a full prefetch window, nothing claimed) looks from now, or a
        message left unclaimed would be reported due again and again."""
        looked, self._looked = self._looked, None
        return 0.0 if looked is None else monotonic() - looked + DUE_SLACK

    def _wake_channels(self, wants: list[Want]) -> set[str]:
        """The wake-up channels of every queue consumed: worked out again only when the
        queues consumed change (a kick compares lists, at C speed, instead of hashing a
        name per queue)."""
        wanted = [(w.acked, w.unacked) for w in wants]
        if wanted != self._wanted:
            self._wanted_channels = {self.channel(q) for a, u in wanted for q in (*a, *u)}
            self._wanted = wanted
        return self._wanted_channels

    def _claimable(self, want: Want) -> list[str]:
        """The queues of ``want`` the next claim names: of those that may hold work (not
        known to be empty), at most as many as it has room for, going on where the last
        claim over more queues than it could name stopped. Each queue named costs the
        claim index descents whatever it gives: after a claim came back full (its queues
        deep) the next names fewer (the square root of its room, each for a larger
        share); after a short one (queues shallow), as many as it has room for."""
        ready = [q for q in want.acked if q not in self.exhausted]
        room = max(want.room or UNLIMITED_BATCH, 1)
        cap = max(math.isqrt(room), 1) if self._deep else room
        if len(ready) > cap:
            start = self._turn % len(ready)
            ready = (ready[start:] + ready[:start])[:cap]
            self._turn = start + cap
        return ready

    def _worth_claiming(self, want: Want) -> bool:
        """Claim now, or let more slots free up first (up to REFILL_DELAY)?

        A claim per freed slot costs a statement per task. While the consumer still
        holds a good part of its prefetch window (running or queued in the pool) a
        refill can wait for a few more acks; a consumer running low, or all but idle,
        claims at once."""
        window, room = want.window, want.room
        if self._refill_due or window <= 1 or room is None:
            return True
        held = window - room
        if room * 2 >= window or held * 4 <= window:
            return True
        if self._refill is None and self._timers is not None:
            self._refill = self._timers.call_later(REFILL_DELAY, self._refill_now)
        return False

    def _refill_now(self) -> None:
        self._refill = None
        self._refill_due = True
        self.kick()

    def channel(self, queue: str) -> str:
        """The wake-up channel of ``queue`` (remembered both ways: a kick asks it of every
        queue consumed, and notifications map back to queues)."""
        channel = self._queue_channels.get(queue)
        if channel is None:
            channel = self._queue_channels[queue] = self.store.channel(queue)
            self._channels[channel] = queue
        return channel

    # -- what came back ----------------------------------------------------------------
    def _finished(self, rows: list[Row]) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.kind == "ack":
            self._acked(flight, rows)
        if flight is None or flight.kind in ("listen", "ack"):
            return
        if flight.kind == "next_due":
            due = rows[0][0] if rows else None
            self._arm_due(None if due is None else float(due))
            return
        batch = read_claim(flight.acks, rows)
        if flight.kind == "claim":
            self.statements.claim_seconds += monotonic() - flight.sent
            self._looked = flight.sent
            self.flow = claim_limits(rows)
            if rows:  # (an empty answer met nothing: it says nothing either way)
                self.featured = claim_featured(rows)
            if self.flow and flight.statement in ("claim", "lean_claim"):
                # A flow limit exists: the plain claim picked nothing (its acks landed).
                # Not a short claim: the kick that follows sends flow_claim.
                self.statements.flow_switch += 1
                return
        # Rows an ordered queue held back count: a claim they filled is not short. A
        # short claim took every candidate it found: a queue that gave fewer than its
        # share has no more (one that gave its share may have).
        if flight.kind == "claim":
            self._deep = len(batch) >= flight.limit
        # lean_claim met a keyed or following message: what it held is claim's to judge,
        # sent next; its queues are not known to be empty.
        lean_met = flight.statement == "lean_claim" and self.featured
        if len(batch) < flight.limit and not lean_met:
            if not 0 < flight.per_queue < flight.limit:  # (a pop: no share)
                self.exhausted.update(flight.queues)
            else:
                given = Counter(c.queue for c in batch)
                self.exhausted.update(q for q in flight.queues if given[q] < flight.per_queue)
            self._due_stale = True
        if any(c.held for c in batch):
            self.statements.held += sum(c.held for c in batch)
            batch = [c for c in batch if not c.held]
        leased = flight.kind == "claim"
        if leased:
            self.claim_sent = flight.sent
            self.track(batch)
        self.deliver_all(batch, leased=leased)

    @staticmethod
    def _acked(flight: _InFlight, rows: list[Row]) -> None:
        """Acks sent alone: those missing from the ids deleted were refused (reported)."""
        landed = [int(row[0]) for row in rows if row[0] is not None]
        fencing.refused("ack", fencing.refused_of(flight.acks, landed))

    def track(self, batch: Sequence[Claimed]) -> None:
        """Lease a claimed batch until kombu takes each message (see :meth:`held`)."""
        with self._undelivered_lock:
            for c in batch:
                if c.dead_letter_id is None:
                    self._undelivered[c.id] = (c.token, self.source.visibility_timeout(c.queue))

    def deliver_all(self, batch: Sequence[Claimed], *, leased: bool) -> None:
        """Hand a batch to kombu in order; should that stop (the worker shutting down),
        release the rest now rather than after their lease lapses. A message that cannot
        be delivered is dead-lettered, and the batch goes on."""
        for n, claimed in enumerate(batch):
            try:
                self._deliver_one(claimed, leased=leased)
            except BaseException:
                if leased:
                    self.release(batch[n + 1 :])
                raise

    def _deliver_one(self, claimed: Claimed, *, leased: bool) -> None:
        with self._undelivered_lock:
            self._undelivered.pop(claimed.id, None)
        why = claimed.fault if claimed.payload is None else envelope.fault(claimed.payload)
        if claimed.dead_letter_id is not None or why is not None:
            self._undeliverable.submit(
                claimed, claimed.fault or why or "undecodable payload", held=leased
            )
            return
        if claimed.note == FOLLOWS_MISSING:
            follows.follows_missing(claimed)
        headers = claimed.payload.get("headers") if claimed.payload else None
        if leased and isinstance(headers, dict) and ordering.ORDERING_KEY in headers:
            if len(self._keyed) >= MAX_KEYED:  # (ids of rejected deliveries linger)
                self._keyed.clear()
            self._keyed.add(claimed.id)
        try:
            self.source.deliver(claimed)
        except Exception as exc:  # any fault of one message: dead-letter it, go on
            logger.exception(
                "pgq: delivering message %d of queue %r failed", claimed.id, claimed.queue
            )
            if leased:
                self._undeliverable.submit(
                    claimed, f"delivery failed: {type(exc).__name__}: {exc}", held=True
                )
            return
        self.delivered += 1

    def release(self, rest: Sequence[Claimed]) -> None:
        """Hand back claimed messages now rather than after their lease lapses."""
        tokens = [c.token for c in rest if c.dead_letter_id is None]
        with self._undelivered_lock:
            for token in tokens:
                self._undelivered.pop(token.id, None)
        try:
            self.store.release(tokens)
        except (BrokerUnavailable, psycopg.OperationalError, psycopg.InterfaceError) as exc:
            logger.warning(
                "pgq: could not release %d messages (%s): their leases lapse", len(tokens), exc
            )

    # -- acks and leases ---------------------------------------------------------------
    # -- what the kombu layer hands back ------------------------------------------------
    def ack(self, token: Lease) -> bool:
        """Buffer the ack of a delivery: it rides on the next claim. False when the buffer
        is closed (the consumer stopped): the caller acks it now, itself."""
        return self._acks.add(token)

    def settle(self, token: Lease) -> bool:
        """Settle an atomic delivery soon, gathered with others into one statement
        (consume/settles.py). False when the consumer stopped: the caller settles it."""
        return self._settles.add(token)

    def _send_settles(self, tokens: list[Lease]) -> None:
        self.store.settle(tokens)
        self.statements.settle += 1  # (counted once landed)
        self.statements.settled += len(tokens)

    def later(self, what: str, work: Callable[[], object]) -> None:
        """Run ``work`` (a fenced statement: a requeue, a reject) off the driver's thread,
        soon; a failure is logged (``what`` names it): the message's lease lapses and it
        is delivered again."""
        self._undeliverable.later(what, work)

    def reject_undeliverable(self, claimed: Claimed, reason: str, *, held: bool = True) -> None:
        """Dead-letter ``claimed`` (unless its claim did) with ``reason`` and send the
        signal, soon. ``held``: under its lease (claimed); otherwise popped, gone from
        the queue."""
        self._undeliverable.submit(claimed, reason, held=held)

    def held(self) -> list[tuple[Lease, float]]:
        """Claimed messages not handed over yet: leased, so renewed like delivered ones."""
        with self._undelivered_lock:
            return list(self._undelivered.values())

    def flush_acks(self) -> None:
        """Land every buffered ack now (housekeeping: the driver may be busy)."""
        self.land_acks(self._acks.take())

    def land_acks(self, tokens: list[Lease], *, background: bool = False) -> None:
        """Ack ``tokens`` on a connection of their own. Through an outage that keeps
        trying for the fenced window (as long as a failover may take): from the driver's
        thread (``background``, or called on it) the undeliverable thread does it, so the
        loop, and Celery's reconnect, never wait for it."""
        if not tokens:
            return
        if background or self.on_loop_thread():
            self._undeliverable.later(
                f"ack of {len(tokens)} messages", lambda: self.store.ack(tokens)
            )
            return
        try:
            self.store.ack(tokens)
        except (BrokerUnavailable, psycopg.OperationalError, psycopg.InterfaceError) as exc:
            logger.warning(
                "pgq: ack of %d messages failed (%s); they will be delivered again when "
                "their visibility timeout lapses",
                len(tokens),
                exc,
            )

    def _abandon_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.acks:
            # Called where the session died: on the driver's thread, which must not wait.
            self.land_acks(self._acks.put_back(flight.acks), background=True)
