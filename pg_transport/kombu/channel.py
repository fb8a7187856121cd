"""kombu's Channel for pgq: queues, exchanges and bindings in Postgres, publish and get.

Routing state lives in Postgres, shared by every process: exchanges and bindings are
rows, and a routed publish matches them in the same statement that inserts the message.
Every SQL operation is the store's (:mod:`pg_transport.store`); this module only maps
kombu's calls to them. Consuming is the engine's (:mod:`pg_transport.consume.engine`):
a channel only says which queues it consumes and how many messages it has room for.
"""

from __future__ import annotations

import base64
import logging
import math
import uuid
from hashlib import md5
from queue import Empty
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from pg_transport import poisoned
from pg_transport.config import MAX_SECONDS, Options
from pg_transport.errors import BrokerUnavailable, InvalidMessage, LimitError, PgqError
from pg_transport.kombu import chord_parts
from pg_transport.kombu.producer_batch import PublishBatch
from pg_transport.kombu.qos import Message, QoS, lease_of
from pg_transport.message import envelope, fair, identity, limits, ordering, poison, topic, unique
from pg_transport.message.eta import eta_delay
from pg_transport.publish.publisher import Publisher
from pg_transport.store import Claimed, Lease, Store

__all__ = [
    "EXCHANGE_TYPES",
    "MAX_PRIORITY",
    "PUBLISH_ID",
    "Channel",
    "check_queue_name",
    "fault",
    "publish_id",
]

logger = logging.getLogger("pg_transport.transport")

MAX_PRIORITY = 255
# Queue names are index keys and part of a wake-up channel's digest: both have byte
# limits well above this.
MAX_QUEUE_NAME_BYTES = 1024

#: The message property naming one logical publish: its publish keys derive from it.
PUBLISH_ID = "pgq_publish_id"


def publish_id(props: dict[str, Any]) -> str:
    """The id of the logical publish ``props`` belong to, given on its first attempt.

    kombu's publish retry (``Producer.publish(retry=True)``, which Celery's
    ``task_publish_retry`` is) prepares the message again for every attempt, with a new
    delivery tag, but from the same properties dict: the ``**properties`` of that one
    ``Producer.publish`` call. An id kept in that dict is therefore the same for every
    attempt of one publish and new for the next call, even one carrying the same task
    id (``self.retry()``, ``Task.replace()``). A publish whose commit landed but whose
    answer was lost, sent again by whoever, then finds its key taken and inserts nothing.
    The id is removed again before a consumer sees the message (see
    :meth:`pg_transport.kombu.transport.Transport.as_payload`): a message published anew
    from a delivered one's properties is a new publish."""
    found = props.get(PUBLISH_ID)
    if not isinstance(found, str) or not found:
        found = props[PUBLISH_ID] = uuid.uuid4().hex
    return found


def check_queue_name(queue: str) -> str:
    size = len(queue.encode("utf-8"))
    if size > MAX_QUEUE_NAME_BYTES:
        raise ValueError(
            f"queue name of {size} bytes is too long for pgq (at most {MAX_QUEUE_NAME_BYTES}): "
            f"{queue[:40]!r}…"
        )
    return queue


def fault(claimed: Claimed) -> str | None:
    """Why ``claimed`` cannot be delivered (None: it can)."""
    if claimed.dead_letter_id is not None:
        return claimed.fault or "dead-lettered by its claim"
    if claimed.payload is None:
        return claimed.fault or "undecodable payload"
    return envelope.fault(claimed.payload)


class Channel(virtual.Channel):
    """A kombu channel on the pgq store."""

    QoS = QoS
    Message = Message
    do_restore = True
    supports_fanout = True
    default_priority = 0
    min_priority = 0
    max_priority = MAX_PRIORITY
    connection: Any  # the Transport (typed there: this module does not import it)

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        # Kept past close: acks of tasks that outlive a lost connection still land.
        self.store: Store = connection.store
        self.publisher: Publisher = connection.publisher
        # Queues consumed with no_ack: their messages are deleted as they are taken.
        self._noack_queues: set[str] = set()
        self._options: Options = connection.options

    def visibility_timeout(self, queue: str) -> float:
        return self._options.visibility_timeout_for(queue)  # (cached there)

    def max_attempts(self, queue: str) -> int:
        return self._options.max_attempts_for(queue)

    def fair_share(self, queue: str) -> bool:
        return bool(self._options.fair_share_for(queue))

    def dead_letter(self, token: Lease, reason: str, message: Any) -> int | None:
        """Move a delivery to dead_letter and record what it was (no poison signal)."""
        dead_id = self.store.dead_letter(token, reason)
        if dead_id is not None and message is not None:
            decoded = poison.decode(self.connection.raw_payload(message))
            found, why = identity.recover(decoded.task_name, decoded.args, decoded.kwargs)
            self.store.identify_dead_letter(
                dead_id,
                task_id=decoded.task_id,
                task_name=decoded.task_name,
                identity=found,
                reasons=decoded.reasons + why,
            )
            poisoned.tell_dead_lettered(
                dead_letter_id=dead_id,
                queue=token.queue,
                payload=self.connection.raw_payload(message),
                reason=reason,
                settled=True,
            )
        return dead_id

    # -- body encoding: text bodies (JSON) stay readable in the table ----------
    def encode_body(self, body: Any, encoding: str | None = None) -> tuple[Any, str | None]:
        if isinstance(body, str):
            return body, None
        if isinstance(body, (bytes, bytearray, memoryview)):
            return base64.b64encode(bytes(body)).decode("ascii"), "base64"
        encoded: tuple[Any, str | None] = super().encode_body(body, encoding)
        return encoded

    # -- kombu virtual channel interface ------------------------------------
    def _get_message_priority(self, message: Any, reverse: bool = False) -> int:
        # kombu takes a priority it cannot read as the default, and raises a bare
        # OverflowError on an infinite one: a NaN or infinity is refused by name instead.
        properties = message.get("properties") if isinstance(message, dict) else None
        priority = properties.get("priority") if isinstance(properties, dict) else None
        if isinstance(priority, float) and not math.isfinite(priority):
            raise InvalidMessage(
                f"message property priority is {priority!r}: a number from 0 to "
                f"{self.max_priority} is; the message was not published"
            )
        return int(super()._get_message_priority(message, reverse))

    def _delay(self, message: dict[str, Any]) -> float:
        """Seconds until a Celery ETA/countdown message is due (0: deliver now)."""
        if not self.connection.options.native_delayed_delivery:
            return 0.0
        headers = message.get("headers")
        return eta_delay(headers) if isinstance(headers, dict) else 0.0

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        check_queue_name(queue)
        props = message.setdefault("properties", {})
        tag = publish_id(props)
        # The same key the routed publish computes in SQL: md5(id || queue).
        key = md5(f"{tag}{queue}".encode()).hexdigest()
        try:
            self.publisher.publish(
                queue,
                message,
                priority=self._get_message_priority(message),
                delay=self._delay(message),
                publish_key=key,
                ttl=_expiration(props.get("expiration")),
            )
        except PgqError as exc:
            # Refused, not published (an unreachable database is another matter: the
            # chord cannot be failed there either). A chord header part's chord fails.
            if not isinstance(exc, BrokerUnavailable):
                chord_parts.refused(message, exc)
            raise

    # -- routing: exchanges and bindings live in Postgres ----------------------
    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        # expires / message_ttl become x-expires / x-message-ttl, as on RabbitMQ.
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Any = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        type = type or "direct"
        exchange = exchange or f"amq.{type}"
        if passive:
            if self.store.exchange_type(exchange) is None:
                raise _not_found(f"no exchange {exchange!r}", "Channel.exchange_declare")
            return
        if type not in EXCHANGE_TYPES:
            raise ChannelError(
                f"NOT_IMPLEMENTED - exchange type {type!r} (pgq routes {sorted(EXCHANGE_TYPES)})",
                (50, 10),
                "Channel.exchange_declare",
                "540",
            )
        existing = self.store.declare_exchange(exchange, type)
        if existing != type:
            raise ChannelError(
                f"PRECONDITION_FAILED - exchange {exchange!r} exists with type {existing!r},"
                f" not {type!r}",
                (50, 10),
                "Channel.exchange_declare",
                "406",
            )

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self.store.delete_exchange(exchange)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        exchange = exchange or "amq.direct"
        key = routing_key or ""
        missing = f"cannot bind queue {queue!r}: no exchange {exchange!r} (declare it first)"
        kind = self.store.exchange_type(exchange)
        if kind is None:
            raise _not_found(missing, "Channel.queue_bind")
        try:
            # Every publish to a topic exchange matches its key against each binding's
            # pattern: one pattern Postgres cannot compile would break them all.
            pattern = topic.binding_pattern(key) if kind == "topic" else topic.literal_pattern(key)
        except topic.InvalidBindingKey as exc:
            raise ChannelError(
                f"PRECONDITION_FAILED - cannot bind queue {queue!r} to exchange "
                f"{exchange!r}: {exc}",
                (50, 20),
                "Channel.queue_bind",
                "406",
            ) from exc
        if not self.store.bind(exchange, check_queue_name(queue), key, pattern):
            raise _not_found(missing, "Channel.queue_bind")  # deleted since it was looked up

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        self.store.unbind(exchange or "amq.direct", queue, routing_key or "")

    def list_bindings(self) -> Any:
        return iter(self.store.list_bindings())

    def basic_publish(self, message: Any, exchange: str, routing_key: str, **kwargs: Any) -> Any:
        self._inplace_augment_message(message, exchange, routing_key)
        ordering.move_options(message)
        limits.move_options(message)
        unique.move_options(message)
        fair.move_options(message)
        if not exchange:  # the default exchange: the routing key names the queue
            return self._put(routing_key, message)
        props = message["properties"]
        kind, matched = self.publisher.publish_routed(
            exchange,
            routing_key or "",
            message,
            priority=self._get_message_priority(message),
            delay=self._delay(message),
            ttl=_expiration(props.get("expiration")),
            publish_tag=publish_id(props),
        )
        if not matched:
            self._unroutable(message, exchange, routing_key or "", kind)
        return None

    def create_publish_batch(self, max_size: int) -> PublishBatch:
        """kombu's ``Producer.batch()``: a flush is one commit (:mod:`producer_batch`)."""
        return PublishBatch(self, max_size)

    def _unroutable(self, message: Any, exchange: str, routing_key: str, kind: str | None) -> None:
        """Nothing was bound to receive it. Pub/sub (fanout, topic) drops it, as AMQP
        does; a direct message is a task nobody would run: it is dead-lettered."""
        what = f"exchange {exchange!r} ({kind or 'never declared'}), routing key {routing_key!r}"
        if kind in ("fanout", "topic") or exchange.endswith(".pidbox"):
            # Broadcasts with no listener and replies to a client that left.
            logger.debug("no queue bound for %s: dropped", what)
            return
        dead_id = self.publisher.dead_letter_unroutable(
            check_queue_name(routing_key),
            message,
            priority=self._get_message_priority(message),
            reason=f"unroutable: no queue bound for {what}",
        )
        logger.warning("no queue bound for %s: kept as dead letter %d", what, dead_id)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        while True:
            claimed = self.store.claim(
                [queue],
                [self.visibility_timeout(queue)],
                1,
                [self.max_attempts(queue)],
                fair=self.fair_share(queue),
            )
            if not claimed:
                raise Empty()
            found = claimed[0]
            why = fault(found)
            if why is None:
                payload: dict[str, Any] = self.connection.as_payload(found)
                return payload
            self.connection.engine.reject_undeliverable(found, why)

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        arguments = kwargs.get("arguments") or {}
        self.store.declare_queue(
            check_queue_name(queue),
            expires_ms=_int_or_none(arguments.get("x-expires")),
            message_ttl_ms=_int_or_none(arguments.get("x-message-ttl")),
            ordering=self.connection.options.ordering_for(queue),
            fair=self.connection.options.fair_share_for(queue),
        )

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        if if_empty and self._size(queue):
            return
        self._delete(queue)  # the queue, its bindings and its messages

    def _restore(self, message: Any) -> None:
        self.store.release([lease_of(message)])

    def _refuse_limited_without_acks(self, queue: str) -> None:
        """A queue with a flow limit of its own is not consumed without acks: a pop takes
        and deletes messages without the claim that enforces the limit
        (docs/flow-control.md)."""
        name = self.store.queue_limit(queue)
        if name is not None:
            raise LimitError(
                f"queue {queue!r} has flow limit {name!r}: a consumer without acks "
                "(no_ack=True) takes messages without the claim that enforces it, so it may "
                f"not consume this queue; consume it with acks, or remove the limit (`pgq "
                f"limit reset {name}`)"
            )

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        check_queue_name(queue)
        if no_ack:
            self._refuse_limited_without_acks(queue)
            self._noack_queues.add(queue)
        self.connection.engine.reset(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._noack_queues.discard(queue)
        return result

    def basic_qos(self, *args: Any, **kwargs: Any) -> None:
        super().basic_qos(*args, **kwargs)
        if self.connection is not None:
            self.connection.wake()  # a larger prefetch window is room for a claim now

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        if not no_ack:
            return super().basic_get(queue, no_ack, **kwargs)
        self._refuse_limited_without_acks(queue)
        while True:
            popped = self.store.pop([queue], 1)
            if not popped:
                return None
            found = popped[0]
            why = fault(found)
            if why is None:
                return self.Message(self.connection.as_payload(found), channel=self)
            self.connection.engine.reject_undeliverable(found, why, held=False)

    def consuming(self) -> tuple[list[str], list[str]]:
        """The queues this channel consumes: (acknowledged, no_ack)."""
        if not self._consumers or self.closed:
            return [], []
        acked = [q for q in self._active_queues if q not in self._noack_queues]
        unacked = [q for q in self._active_queues if q in self._noack_queues]
        return acked, unacked


EXCHANGE_TYPES = frozenset({"direct", "topic", "fanout"})


def _not_found(what: str, method: str) -> ChannelError:
    return ChannelError(f"NOT_FOUND - {what}", (50, 10), method, "404")


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _expiration(value: Any) -> float | None:
    """A message's ``expiration`` property (milliseconds, as in AMQP) in seconds."""
    if value in (None, ""):
        return None
    try:
        milliseconds = float(value)
    except (TypeError, ValueError):
        return None
    except OverflowError:  # an int past any float
        milliseconds = math.inf
    if not milliseconds <= MAX_SECONDS * 1000.0:  # NaN too
        raise InvalidMessage(
            f"message property expiration is {value!r} ms: at most {MAX_SECONDS * 1000} ms "
            "(ten years); the message was not published"
        )
    return max(milliseconds, 0.0) / 1000.0
