"""kombu's QoS for pgq: acks, rejects and the leases of unacked deliveries.

A delivered message carries its fencing token in its delivery info (row id and lease in
``pgq_token``, queue in ``pgq_queue``). An ack rides on the consumer's next claim when a
consumer engine runs (and is landed here otherwise); a reject with requeue releases the
message; one without, and an ack of a body that could not be decoded, move it to the
dead letters. Every action is fenced by the token: a delivery whose lease lapsed, or was
released, touches nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from time import monotonic
from typing import Any

import psycopg
from kombu.transport import virtual

from pg_transport.errors import BrokerUnavailable
from pg_transport.message.rows import Lease

__all__ = ["TOKEN", "Message", "QoS", "lease_of"]

logger = logging.getLogger("pg_transport.transport")

#: Where a delivery's row id and lease are, in its delivery info.
TOKEN = "pgq_token"

# Errors that mean "Postgres is not there right now" (after the retries).
UNAVAILABLE = (psycopg.OperationalError, psycopg.InterfaceError, BrokerUnavailable)


def lease_of(message: Any) -> Lease:
    """The fencing token of a delivered kombu message."""
    info = message.delivery_info
    ident, lease = info[TOKEN]
    headers = getattr(message, "headers", None)
    task = headers.get("id") if isinstance(headers, dict) else None
    if not isinstance(task, str):
        props = getattr(message, "properties", None)
        task = props.get("correlation_id") if isinstance(props, dict) else None
    return Lease(
        int(ident), int(lease), str(info["pgq_queue"]), task if isinstance(task, str) else None
    )


class Message(virtual.Message):
    """Remembers why its body could not be decoded.

    Celery logs an undecodable body and acks it, which would delete it; QoS.ack
    sees this mark and dead-letters the message with the reason instead.
    """

    undecodable: str | None = None

    def _decode(self) -> Any:
        try:
            return super()._decode()
        except Exception as exc:  # whatever the decoder raised is the reason kept
            self.undecodable = f"{type(exc).__name__}: {exc}"
            raise


class QoS(virtual.QoS):
    """Acks and rejects go straight to Postgres, fenced by the delivery's token.

    ``_held`` mirrors the unacked deliveries as (lease, vt) under a lock so the
    lease-renewal thread can read it while other threads ack.
    """

    def __init__(self, channel: Any, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        self._held: dict[str, tuple[Lease, float]] = {}
        # When each held lease lapses, as far as this process knows (monotonic clock):
        # the claim's time + vt, pushed on by every renewal that landed; -inf once a
        # renewal was refused (the message is someone else's now).
        self._expires: dict[str, float] = {}
        self._held_lock = threading.Lock()
        # Deliveries of atomic tasks (docs/design/exactly-once.md): their task's own
        # transaction deletes the row; the worker's ack only releases what it did not.
        self._settles: set[str] = set()

    def append(self, message: Any, delivery_tag: str) -> None:
        token = lease_of(message)
        vt = self.channel.visibility_timeout(token.queue)
        transport = self.channel.connection
        claimed_at = transport.engine.claim_sent if transport is not None else monotonic()
        with self._held_lock:
            self._held[delivery_tag] = (token, vt)
            self._expires[delivery_tag] = claimed_at + vt
        super().append(message, delivery_tag)

    def renewed(self, landed: Collection[int], lost: Collection[int], sent_at: float) -> None:
        """A renewal sent at ``sent_at`` landed for the row ids ``landed`` (their leases
        now run until ``sent_at`` + vt) and was refused for ``lost``."""
        with self._held_lock:
            for tag, (token, vt) in self._held.items():
                if token.id in lost:
                    self._expires[tag] = float("-inf")
                elif token.id in landed:
                    self._expires[tag] = max(self._expires.get(tag, 0.0), sent_at + vt)

    def lapsed(self, delivery_tag: str) -> bool:
        """Whether the lease of a held delivery has lapsed, as far as this process knows
        (no renewal landed in time, or one was refused): another worker may run it."""
        with self._held_lock:
            expires = self._expires.get(delivery_tag)
        return expires is not None and monotonic() >= expires

    def drop(self, delivery_tag: str) -> None:
        """Forget a delivery whose lease lapsed, without acking it (it is not ours any
        more); its prefetch slot is free again."""
        self._forget(delivery_tag)

    def settle_on_ack(self, delivery_tag: str) -> None:
        """The delivery's task completes it in its own transaction (an atomic task): its
        ack is a *settle*, releasing the message if that transaction did not delete it
        (rolled back, failed to commit, its process killed), and a no-op if it did."""
        with self._held_lock:
            if delivery_tag in self._held:
                self._settles.add(delivery_tag)

    def settling(self) -> set[int]:
        """Row ids of held deliveries whose task completes them itself (atomic tasks)."""
        with self._held_lock:
            return {self._held[t][0].id for t in self._settles if t in self._held}

    def _forget(self, delivery_tag: str) -> None:
        with self._held_lock:
            self._held.pop(delivery_tag, None)
            self._expires.pop(delivery_tag, None)
            self._settles.discard(delivery_tag)
        self._quick_ack(delivery_tag)
        transport = self.channel.connection
        if transport is not None:
            transport.wake()

    def forget(self, delivery_tag: str) -> None:
        """Drop a delivery Celery never took (its delivery raised): the consumer
        dead-letters it under its lease; its prefetch slot is free again."""
        if delivery_tag in self._delivered or delivery_tag in self._held:
            self._forget(delivery_tag)

    def held(self) -> list[tuple[Lease, float]]:
        with self._held_lock:
            return list(self._held.values())

    def ack(self, delivery_tag: str) -> None:
        with self._held_lock:
            held = self._held.get(delivery_tag)
            settle = delivery_tag in self._settles
        message = self._delivered.get(delivery_tag)
        undecodable = getattr(message, "undecodable", None)
        try:
            if held is not None and settle:
                self._settle(held)
            elif held is not None and undecodable:
                token = held[0]
                self._land(
                    "dead-lettering",
                    held,
                    lambda: self.channel.dead_letter(
                        token, f"undecodable body: {undecodable}", message
                    ),
                )
            elif held is not None:
                token = held[0]
                transport = self.channel.connection
                # Rides on the consumer's next claim (woken by _forget below); once
                # the consumer has stopped, the ack is landed here and now. After a lost
                # connection it is landed off this thread (Celery's, reconnecting): it
                # may keep trying for as long as a failover takes.
                if transport is not None and transport.lost:
                    transport.engine.land_acks([token], background=True)
                elif transport is None or not transport.engine.ack(token):
                    self.channel.store.ack([token])
        except UNAVAILABLE as exc:
            self._lapse("ack", held, exc)
        finally:
            # Forgotten either way: a delivery whose ack failed must not keep its
            # lease renewed forever; it lapses and the message is delivered again.
            self._forget(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        with self._held_lock:
            held = self._held.get(delivery_tag)
            settle = delivery_tag in self._settles
        try:
            if held is not None and requeue and settle:
                # An atomic task's (its process lost, its run requeued): released unless
                # its commit deleted it, never waiting on a commit in progress.
                self._settle(held)
            elif held is not None:
                token = held[0]
                if requeue:
                    self._land(
                        "requeue",
                        held,
                        lambda: self.channel.store.release([token], failed=True),
                    )
                else:
                    self._dead_letter(delivery_tag, held, "rejected without requeue")
        finally:
            self._forget(delivery_tag)

    def refuse(self, delivery_tag: str, reason: str) -> None:
        """Dead-letter a delivery Celery took but cannot run, with ``reason``; its
        prefetch slot is free again and its lease no longer renewed."""
        with self._held_lock:
            held = self._held.get(delivery_tag)
        try:
            if held is not None:
                self._dead_letter(delivery_tag, held, reason)
        finally:
            self._forget(delivery_tag)

    def _dead_letter(self, delivery_tag: str, held: tuple[Lease, float], reason: str) -> None:
        token = held[0]
        message = self._delivered.get(delivery_tag)
        self._land("dead-lettering", held, lambda: self.channel.dead_letter(token, reason, message))

    def _settle(self, held: tuple[Lease, float]) -> None:
        """Settle an atomic delivery: gathered with others into one statement by the
        consumer (consume/settles.py: a committed run's settle, the usual case, finds
        nothing, and a round trip each was most of what an atomic task cost the worker
        over a plain one); here and now once the consumer has stopped."""
        token = held[0]
        transport = self.channel.connection
        if transport is not None and transport.engine.settle(token):
            return
        self._land("settle", held, lambda: self.channel.store.settle([token]))

    def _land(self, what: str, held: tuple[Lease, float], work: Callable[[], object]) -> None:
        """Run a fenced statement for a delivery's outcome: off the driver's thread when
        called on it (the engine's background thread runs it), here otherwise."""
        transport = self.channel.connection
        engine = transport.engine if transport is not None else None
        if engine is not None and engine.on_loop_thread():
            engine.later(what, work)
            return
        try:
            work()
        except UNAVAILABLE as exc:
            self._lapse(what, held, exc)

    @staticmethod
    def _lapse(what: str, held: tuple[Lease, float] | None, exc: BaseException) -> None:
        """Postgres stayed out of reach through the retries: say what happens next."""
        ident = held[0].id if held else "?"
        logger.warning(
            "%s of message %s failed (%s); it will be delivered again when its "
            "visibility timeout lapses",
            what,
            ident,
            exc,
        )

    def restore_unacked_once(self, stderr: Any = None) -> None:
        """kombu's shutdown and collect hook. After a lost connection nothing is restored
        (see :meth:`restore_unacked`): one line says what happens instead of kombu's
        "Restoring N unacknowledged message(s)"."""
        transport = self.channel.connection
        if transport is None or not transport.lost:
            super().restore_unacked_once(stderr)
            return
        self._on_collect.cancel()
        self._flush()
        state = self._delivered
        if state and not getattr(state, "restored", None):
            logger.warning(
                "connection lost: %d unacknowledged message(s) are not restored; they stay "
                "leased to this worker, whose running tasks can still ack them, and return "
                "to their queue only if the lease lapses (visibility_timeout)",
                len(state),
            )
        state.restored = True  # type: ignore[attr-defined]  # kombu marks it so too

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Release every unacked delivery in one statement (shutdown, recover).

        Not after a lost connection: tasks may still be running and will ack
        through this QoS; their leases lapse on their own after the vt.
        """
        transport = self.channel.connection
        if transport is not None and transport.lost:
            return []  # restore_unacked_once said so
        self._flush()
        with self._held_lock:
            held, self._held = self._held, {}
            self._expires.clear()
        self._delivered.clear()
        tokens = [h[0] for h in held.values()]
        try:
            self.channel.store.release(tokens)
        except (psycopg.Error, BrokerUnavailable) as exc:
            # The leases expire on their own: nothing is lost, only delayed.
            logger.warning("could not release %d unacked messages: %s", len(tokens), exc)
        return []
