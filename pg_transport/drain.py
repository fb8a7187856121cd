"""The consumer side of a transport: what to claim, when, and handing it to kombu.

One ``Drain`` per transport. Celery's event loop drives it through ``hub.py``; kombu's
blocking ``drain_events`` (green pools, plain kombu consumers) through :meth:`drain`.
Two things keep it cheap:

* Acks ride on claims (under Celery's event loop). A finished task's ack waits in an
  :class:`AckBuffer` and the next claim deletes it in the same statement (``acks.py``).
* Queues known to be empty are not asked again. A claim that comes back short marks
  its queues exhausted until a NOTIFY names them or the next poll (delayed messages
  falling due and lapsed leases send no notification). LISTEN starts before the first
  claim, and a NOTIFY is read only after the claim it may contradict, so no wake-up
  is lost.

Claimed messages not yet handed to kombu (a batch behind a delivery that blocks, as
in the solo pool) are leased like delivered ones: the lease renewer sees them through
:meth:`Drain.held`.

No row stops the consumer. One the claim dead-lettered (past max_attempts, oversized,
not a JSON object), one that does not decode into a transport message, and one whose
delivery raises are kept in dead_letter with the reason, ``message_poisoned`` is sent
for it, and consumption goes on (:meth:`Drain.deliver_all`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING

import psycopg

from pg_transport import envelope
from pg_transport.acks import AckBuffer, Token
from pg_transport.errors import BrokerUnavailable
from pg_transport.store import Claimed, Lease
from pg_transport.undeliverable import Undeliverable

if TYPE_CHECKING:
    from pg_transport.transport import Channel, Transport

__all__ = ["UNLIMITED_BATCH", "Drain", "Wanted"]

logger = logging.getLogger("pg_transport.drain")

# Claim batch when the consumer set no prefetch limit.
UNLIMITED_BATCH = 100

# Errors that mean "Postgres is not there right now" (after the retries).
UNAVAILABLE = (psycopg.OperationalError, psycopg.InterfaceError, BrokerUnavailable)


@dataclass(frozen=True)
class Wanted:
    """A claim worth making: which channel, which of its queues, how many messages."""

    channel: Channel
    queues: list[str]
    limit: int


class Drain:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        #: Messages popped (no-ack queues) by the last :meth:`next_claim` calls.
        self.popped = 0
        self.store = transport.store
        self.acks = AckBuffer()
        self.undeliverable = Undeliverable(self.store)
        #: Queues whose last claim came back short (see the module docstring).
        self.exhausted: set[str] = set()
        self._next_poll = 0.0
        # Claimed, not yet handed to kombu: id -> (lease, vt). Renewed too.
        self._undelivered: dict[int, tuple[Lease, float]] = {}
        self._undelivered_lock = threading.Lock()
        # Wake-up channel -> queue, for the queues consumed so far.
        self._channels: dict[str, str] = {}

    # -- the loop ---------------------------------------------------------------
    def drain(self, timeout: float | None) -> None:
        """Deliver what is visible now, else wait for a NOTIFY, an ack or the poll."""
        transport = self.transport
        start = monotonic()
        interval = transport.polling_interval or 1.0
        while True:
            now = monotonic()
            if now >= self._next_poll:
                self.exhausted.clear()
                self._next_poll = now + interval
            # LISTEN before the claim: a publish landing between an empty claim and
            # the LISTEN would otherwise wait for the next poll.
            transport.listener.listen(self.channels())
            if self.claim_and_deliver():
                return
            now = monotonic()
            if timeout is not None and now - start >= timeout:
                raise TimeoutError()
            wait = self._next_poll - now
            if timeout is not None:
                wait = min(wait, timeout - (now - start))
            self.notified(transport.listener.wait(wait).channels)

    def channels(self) -> list[str]:
        """The wake-up channels of every queue consumed (acked or not)."""
        return [self.channel(q) for q in self.transport._consumed_queues()]

    def channel(self, queue: str) -> str:
        found = next((c for c, q in self._channels.items() if q == queue), None)
        if found is None:
            found = self.store.channel(queue)
            self._channels[found] = queue
        return found

    def notified(self, channels: set[str]) -> None:
        """Channels notified: their queues are worth a claim again. A channel of no
        queue consumed here is ignored (a notification is only ever a hint)."""
        for channel in channels:
            queue = self._channels.get(channel)
            if queue is not None:
                self.exhausted.discard(queue)

    def next_claim(self, served: Sequence[Channel] = ()) -> Wanted | None:
        """The next claim worth making, skipping ``served`` channels: a channel with
        free prefetch slots and queues that may hold messages, and how many to take.
        Queues consumed without acks are popped (and delivered) here and now: those
        are remote-control broadcasts, rare and small."""
        for channel in self.transport.consuming_channels():
            if channel in served:
                continue
            acked, unacked = channel.consuming()
            unacked = [q for q in unacked if q not in self.exhausted]
            if unacked:
                popped = self.store.pop(unacked, UNLIMITED_BATCH)
                if len(popped) < UNLIMITED_BATCH:
                    self.exhausted.update(unacked)
                self.popped += self.deliver_all(popped, leased=False)
            acked = [q for q in acked if q not in self.exhausted]
            if acked and channel.qos.can_consume():
                return Wanted(channel, acked, _room(channel))
        return None

    def claim_and_deliver(self) -> int:
        """Claim for every consuming channel with free slots and queues that may hold
        messages, and hand the messages to kombu; how many (dead letters included)."""
        self.popped = delivered = 0
        served: list[Channel] = []
        while (wanted := self.next_claim(served)) is not None:
            served.append(wanted.channel)
            batch = self._claim(wanted.channel, wanted.queues, wanted.limit)
            if len(batch) < wanted.limit:
                self.exhausted.update(wanted.queues)
            delivered += self.deliver_all(batch, leased=True)
        return delivered + self.popped

    # -- claiming -----------------------------------------------------------------
    def _claim(self, channel: Channel, queues: list[str], limit: int) -> list[Claimed]:
        vts = [channel.visibility_timeout(q) for q in queues]
        attempts = [channel.max_attempts(q) for q in queues]
        batch = self.store.claim(queues, vts, limit, attempts)
        self.track(channel, batch)
        return batch

    def track(self, channel: Channel, batch: list[Claimed]) -> None:
        """Lease a claimed batch until kombu takes each message (see :meth:`held`)."""
        with self._undelivered_lock:
            for c in batch:
                if c.dead_letter_id is None:
                    self._undelivered[c.id] = (c.token, channel.visibility_timeout(c.queue))

    def deliver_all(self, batch: list[Claimed], *, leased: bool) -> int:
        """Hand a batch to kombu in order; should that stop (the worker shutting down),
        release the rest now rather than after their lease lapses. A message that
        cannot be delivered is dead-lettered, and the batch goes on."""
        for n, claimed in enumerate(batch):
            try:
                self._deliver_one(claimed, leased=leased)
            except BaseException:
                if leased:
                    self.release(batch[n + 1 :])
                raise
        return len(batch)

    def _deliver_one(self, claimed: Claimed, *, leased: bool) -> None:
        why = claimed.fault if claimed.payload is None else envelope.fault(claimed.payload)
        if claimed.dead_letter_id is not None or why is not None:
            self._unwrap(claimed)
            self.dead(claimed, claimed.fault or why or "undecodable payload")
            return
        transport = self.transport
        payload = transport.as_payload(claimed)
        # kombu puts it in the QoS (leased and renewed from there) before Celery sees it.
        self._unwrap(claimed)
        try:
            transport.deliver(payload, claimed.queue)
        except Exception as exc:  # any fault of one message: dead-letter it, go on
            logger.exception("pgq: delivering message %d of queue %r failed",
                             claimed.id, claimed.queue)
            if leased:
                self.dead(claimed, f"delivery failed: {type(exc).__name__}: {exc}")

    def _unwrap(self, claimed: Claimed) -> None:
        with self._undelivered_lock:
            self._undelivered.pop(claimed.id, None)

    def dead(self, claimed: Claimed, reason: str) -> None:
        """Keep a message that cannot be delivered in dead_letter (the claim may have
        already: ``dead_letter_id``), recover what it was and send ``message_poisoned``:
        on a thread of its own (:mod:`~pg_transport.undeliverable`), never this one."""
        self.undeliverable.submit(claimed, reason)

    def release(self, rest: Sequence[Claimed]) -> None:
        """Hand back claimed messages now rather than after their lease lapses."""
        tokens = [c.token for c in rest if c.dead_letter_id is None]
        with self._undelivered_lock:
            for token in tokens:
                self._undelivered.pop(token.id, None)
        self.store.release(tokens)

    # -- acks and leases ------------------------------------------------------------
    def held(self) -> list[tuple[Lease, float]]:
        """Claimed messages not handed over yet: leased, so renewed like delivered ones."""
        with self._undelivered_lock:
            return list(self._undelivered.values())

    def flush_acks(self) -> None:
        """Land every buffered ack now (housekeeping: the consumer may be busy)."""
        self.land_acks(self.acks.take())

    def land_acks(self, tokens: list[Token]) -> None:
        if not tokens:
            return
        try:
            self.store.ack(tokens)
        except UNAVAILABLE as exc:
            logger.warning(
                "ack of %d messages failed (%s); they will be delivered again when "
                "their visibility timeout lapses", len(tokens), exc,
            )

    def close(self) -> None:
        """Stop buffering acks and land those still buffered; finish the rows handed
        to be dead-lettered."""
        self.land_acks(self.acks.close())
        self.undeliverable.close()

    def reset(self, queue: str) -> None:
        """A new consumer of ``queue``: claim it at once."""
        self.exhausted.discard(queue)
        self.transport.wake()


def _room(channel: Channel) -> int:
    """How many messages a claim for ``channel`` may take: its free prefetch slots."""
    return int(channel.qos.can_consume_max_estimate() or UNLIMITED_BATCH)
