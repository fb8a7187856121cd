"""pgq - PostgreSQL as a kombu transport (and so as a Celery broker).

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (routing state lives in Postgres, shared by all processes)
* Supports Priority: Yes (0-255, higher first, as on RabbitMQ)
* Supports TTL: Yes (queue expiry and message TTL, reaped by consumers)

Connection string
=================
``pgq://[user[:password]@]host[:port]/dbname[?libpq params]``; ``pgq:///dbname``
uses the unix socket, ``pgq://`` libpq's defaults and ``PG*`` environment.
Multi-host URLs (``host1,host2``) with ``target_session_attrs`` work as in libpq.

Transport options
=================
See :mod:`pg_transport.config`: ``schema``, ``visibility_timeout``,
``queue_visibility_timeouts``, ``max_attempts``, ``queue_max_attempts``,
``use_notify``, ``polling_interval``, ``lease_renewal``,
``native_delayed_delivery``, ``auto_migrate``; each overridable by ``PGQ_<KEY>``.

This module is thin: it maps kombu calls to :class:`~pg_transport.store.Store`
calls. A delivered message carries its fencing token (row id and lease) in
``delivery_info['pgq_token']`` and its queue in ``delivery_info['pgq_queue']``; ack,
requeue, dead-lettering and lease renewal are fenced by them.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from hashlib import md5
from queue import Empty
from typing import Any
from urllib.parse import quote

import psycopg
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from pg_transport import envelope, identity, poison, topic
from pg_transport.config import Options
from pg_transport.connection import Connector, mask_url, url_to_conninfo
from pg_transport.drain import UNAVAILABLE, Drain
from pg_transport.errors import (
    BrokerUnavailable,
    BrokerUnreachable,
    ConfigurationError,
    SchemaError,
)
from pg_transport.eta import eta_delay
from pg_transport.housekeeping import Housekeeper
from pg_transport.hub import EventLoopDrain
from pg_transport.notify import Listener
from pg_transport.schema import ensure_schema
from pg_transport.secrets import seal, unseal
from pg_transport.sql import load_queries
from pg_transport.store import Claimed, Lease, Store
from pg_transport.vacuum import Vacuumer

__all__ = ["Channel", "Message", "QoS", "Transport"]

logger = logging.getLogger("pg_transport.transport")

TOKEN = "pgq_token"
MAX_PRIORITY = 255
# Queue names are index keys and NOTIFY payloads: both have byte limits well above this.
MAX_QUEUE_NAME_BYTES = 1024


def check_queue_name(queue: str) -> str:
    size = len(queue.encode("utf-8"))
    if size > MAX_QUEUE_NAME_BYTES:
        raise ValueError(
            f"queue name of {size} bytes is too long for pgq (at most {MAX_QUEUE_NAME_BYTES}): "
            f"{queue[:40]!r}…"
        )
    return queue




def _token(message: Any) -> Lease:
    info = message.delivery_info
    ident, lease = info[TOKEN]
    return Lease(int(ident), int(lease), str(info["pgq_queue"]))


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

    def __init__(self, channel: Channel, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        self._held: dict[str, tuple[Lease, float]] = {}
        self._held_lock = threading.Lock()

    def append(self, message: Any, delivery_tag: str) -> None:
        token = _token(message)
        vt = self.channel.visibility_timeout(token.queue)
        with self._held_lock:
            self._held[delivery_tag] = (token, vt)
        super().append(message, delivery_tag)

    def _forget(self, delivery_tag: str) -> None:
        with self._held_lock:
            self._held.pop(delivery_tag, None)
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
        message = self._delivered.get(delivery_tag)
        undecodable = getattr(message, "undecodable", None)
        try:
            if held is not None and undecodable:
                self.channel.dead_letter(held[0], f"undecodable body: {undecodable}", message)
            elif held is not None:
                token = held[0]
                transport = self.channel.connection
                # Rides on the consumer's next claim (woken by _forget below); once
                # the consumer has stopped, the ack is landed here and now.
                if transport is None or not transport.drain.acks.add(token):
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
        try:
            if held is not None:
                token = held[0]
                if requeue:
                    self.channel.store.release([token])
                else:
                    message = self._delivered.get(delivery_tag)
                    self.channel.dead_letter(token, "rejected without requeue", message)
        except UNAVAILABLE as exc:
            self._lapse("reject" if not requeue else "requeue", held, exc)
        finally:
            self._forget(delivery_tag)

    @staticmethod
    def _lapse(what: str, held: tuple[Lease, float] | None, exc: BaseException) -> None:
        """Postgres stayed out of reach through the retries: say what happens next."""
        ident = held[0].id if held else "?"
        logger.warning(
            "%s of message %s failed (%s); it will be delivered again when its "
            "visibility timeout lapses", what, ident, exc,
        )

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Release every unacked delivery in one statement (shutdown, recover).

        Not after a lost connection: tasks may still be running and will ack
        through this QoS; their leases lapse on their own after the vt.
        """
        transport = self.channel.connection
        if transport is not None and transport.lost:
            logger.info(
                "connection lost: %d unacked messages keep their lease until they are "
                "acked or it lapses", len(self._held),
            )
            return []
        self._flush()
        with self._held_lock:
            held, self._held = self._held, {}
        self._delivered.clear()
        tokens = [h[0] for h in held.values()]
        try:
            self.channel.store.release(tokens)
        except (psycopg.Error, BrokerUnavailable) as exc:
            # The leases expire on their own: nothing is lost, only delayed.
            logger.warning("could not release %d unacked messages: %s", len(tokens), exc)
        return []


class Channel(virtual.Channel):
    """A kombu channel on the pgq store."""

    QoS = QoS
    Message = Message
    do_restore = True
    supports_fanout = True
    default_priority = 0
    min_priority = 0
    max_priority = MAX_PRIORITY
    connection: Transport

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._vt_cache: dict[str, float] = {}
        self._attempts_cache: dict[str, int] = {}
        # Kept past close: acks of tasks that outlive a lost connection still land.
        self.store: Store = connection.store
        # Queues consumed with no_ack: their messages are deleted as they are taken.
        self._noack_queues: set[str] = set()


    def visibility_timeout(self, queue: str) -> float:
        vt = self._vt_cache.get(queue)
        if vt is None:
            vt = self._vt_cache[queue] = self.connection.options.visibility_timeout_for(queue)
        return vt

    def max_attempts(self, queue: str) -> int:
        attempts = self._attempts_cache.get(queue)
        if attempts is None:
            attempts = self._attempts_cache[queue] = self.connection.options.max_attempts_for(
                queue
            )
        return attempts

    def dead_letter(self, token: Lease, reason: str, message: Any) -> int | None:
        """Move a delivery to dead_letter and record what it was (no poison signal)."""
        dead_id = self.store.dead_letter(token, reason)
        if dead_id is not None and message is not None:
            decoded = poison.decode(self.connection.raw_payload(message))
            found, why = identity.recover(decoded.task_name, decoded.args, decoded.kwargs)
            self.store.identify_dead_letter(
                dead_id, task_id=decoded.task_id, task_name=decoded.task_name,
                identity=found, reasons=decoded.reasons + why,
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
    def _delay(self, message: dict[str, Any]) -> float:
        """Seconds until a Celery ETA/countdown message is due (0: deliver now)."""
        if not self.connection.options.native_delayed_delivery:
            return 0.0
        headers = message.get("headers")
        return eta_delay(headers) if isinstance(headers, dict) else 0.0

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        check_queue_name(queue)
        props = message.setdefault("properties", {})
        tag = props.get("delivery_tag")
        # The same key the routed publish computes in SQL: md5(tag || queue).
        key = md5(f"{tag}{queue}".encode()).hexdigest() if tag else None
        self.store.publish(
            queue,
            message,
            priority=self._get_message_priority(message),
            delay=self._delay(message),
            publish_key=key,
        )

    # -- routing: exchanges and bindings live in Postgres ----------------------
    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        # expires / message_ttl become x-expires / x-message-ttl, as on RabbitMQ.
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def exchange_declare(
        self, exchange: str | None = None, type: str = "direct", durable: bool = False,
        auto_delete: bool = False, arguments: Any = None, nowait: bool = False,
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
                (50, 10), "Channel.exchange_declare", "540",
            )
        existing = self.store.declare_exchange(exchange, type)
        if existing != type:
            raise ChannelError(
                f"PRECONDITION_FAILED - exchange {exchange!r} exists with type {existing!r},"
                f" not {type!r}", (50, 10), "Channel.exchange_declare", "406",
            )

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self.store.delete_exchange(exchange)

    def queue_bind(
        self, queue: str, exchange: str | None = None, routing_key: str = "",
        arguments: Any = None, **kwargs: Any,
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
            pattern = (topic.binding_pattern(key) if kind == "topic"
                       else topic.literal_pattern(key))
        except topic.InvalidBindingKey as exc:
            raise ChannelError(
                f"PRECONDITION_FAILED - cannot bind queue {queue!r} to exchange "
                f"{exchange!r}: {exc}", (50, 20), "Channel.queue_bind", "406",
            ) from exc
        if not self.store.bind(exchange, check_queue_name(queue), key, pattern):
            raise _not_found(missing, "Channel.queue_bind")  # deleted since it was looked up

    def queue_unbind(
        self, queue: str, exchange: str | None = None, routing_key: str = "",
        arguments: Any = None, **kwargs: Any,
    ) -> None:
        self.store.unbind(exchange or "amq.direct", queue, routing_key or "")

    def list_bindings(self) -> Any:
        return iter(self.store.list_bindings())

    def basic_publish(self, message: Any, exchange: str, routing_key: str, **kwargs: Any) -> Any:
        self._inplace_augment_message(message, exchange, routing_key)
        if not exchange:  # the default exchange: the routing key names the queue
            return self._put(routing_key, message)
        props = message["properties"]
        kind, matched = self.store.publish_routed(
            exchange, routing_key or "", message,
            priority=self._get_message_priority(message),
            delay=self._delay(message),
            ttl=_expiration(props.get("expiration")),
            publish_tag=props.get("delivery_tag"),
        )
        if not matched:
            self._unroutable(message, exchange, routing_key or "", kind)
        return None

    def _unroutable(self, message: Any, exchange: str, routing_key: str, kind: str | None) -> None:
        """Nothing was bound to receive it. Pub/sub (fanout, topic) drops it, as AMQP
        does; a direct message is a task nobody would run: it is dead-lettered."""
        what = f"exchange {exchange!r} ({kind or 'never declared'}), routing key {routing_key!r}"
        if kind in ("fanout", "topic") or exchange.endswith(".pidbox"):
            # Broadcasts with no listener and replies to a client that left.
            logger.debug("no queue bound for %s: dropped", what)
            return
        dead_id = self.store.dead_letter_unroutable(
            check_queue_name(routing_key), message,
            priority=self._get_message_priority(message),
            reason=f"unroutable: no queue bound for {what}",
        )
        logger.warning("no queue bound for %s: kept as dead letter %d", what, dead_id)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        while True:
            claimed = self.store.claim(
                [queue], [self.visibility_timeout(queue)], 1, [self.max_attempts(queue)]
            )
            if not claimed:
                raise Empty()
            found = claimed[0]
            why = found.fault if found.payload is None else envelope.fault(found.payload)
            if found.dead_letter_id is None and why is None:
                return self.connection.as_payload(found)
            self.connection.drain.dead(found, found.fault or why or "undecodable payload")

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
        )

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        if if_empty and self._size(queue):
            return
        self._delete(queue)  # the queue, its bindings and its messages

    def _restore(self, message: Any) -> None:
        self.store.release([_token(message)])

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        check_queue_name(queue)
        if no_ack:
            self._noack_queues.add(queue)
        self.connection.drain.reset(queue)
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
        while True:
            popped = self.store.pop([queue], 1)
            if not popped:
                return None
            found = popped[0]
            why = found.fault if found.payload is None else envelope.fault(found.payload)
            if found.dead_letter_id is None and why is None:
                return self.Message(self.connection.as_payload(found), channel=self)
            self.connection.drain.dead(found, found.fault or why or "undecodable payload")

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
        return max(float(value), 0.0) / 1000.0
    except (TypeError, ValueError):
        return None


PgChannel = Channel  # the name "Channel" is a class attribute inside Transport


class Transport(virtual.Transport):
    """kombu transport for ``pgq://`` URLs."""

    Channel = Channel
    can_parse_url = True
    default_port = 5432  # type: ignore[assignment]
    driver_type = "postgresql"
    driver_name = "psycopg"
    polling_interval = 1.0

    connection_errors = (
        *virtual.Transport.connection_errors,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        BrokerUnavailable,
    )  # type: ignore[assignment]
    channel_errors = (*virtual.Transport.channel_errors, SchemaError)  # type: ignore[assignment]
    # What kombu retries: not a refusal (wrong password, missing database) nor a
    # schema we may not use, which would fail the same way every time.
    recoverable_connection_errors = (
        psycopg.OperationalError,
        psycopg.InterfaceError,
        BrokerUnreachable,
    )
    recoverable_channel_errors = ()

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=EXCHANGE_TYPES,
        heartbeats=False,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = Options.from_sources(client.transport_options, os.environ)
        super().__init__(client, **kwargs)
        self.polling_interval = self.options.polling_interval
        self.url = _client_url(client)
        conninfo, shown = url_to_conninfo(self.url), mask_url(self.url)
        if "://" in (client.hostname or ""):
            # kombu keeps a URL it does not parse whole in `hostname`, which Celery
            # reports in `inspect stats` (and Flower shows). The masked URL goes there,
            # the secrets in kombu's own `password`: Celery leaves that out of stats,
            # clones and pools carry it over, and _client_url puts the two together.
            hostname, credentials = seal(self.url)
            if credentials is not None:
                client.hostname, client.password = hostname, credentials
        # Behind a transaction pooler (use_notify off) a session is not ours from one
        # statement to the next: no server-side prepared statements, no session
        # settings (every statement commits synchronously, is planned every time).
        queries = load_queries(self.options.schema)
        own = self.options.use_notify
        prepare = 5 if own else None
        no_jit = (queries["no_jit"],) if own else ()
        self.connector = Connector(
            conninfo, display_url=shown, prepare_threshold=prepare, setup=no_jit,
            pin_search_path=own,
        )
        # The consumer's statements (claim, ack, renew, ...) are planned once.
        self.relaxed = (
            Connector(conninfo, display_url=shown, prepare_threshold=prepare,
                      setup=(queries["relax_commit"], queries["generic_plans"], *no_jit))
            if own
            else self.connector
        )
        # durable_publish off: a publish commits without waiting for its WAL flush, as
        # the consumer's statements do. On: it returns after the flush, but a consumer
        # waiting for it has it before.
        durable = self.options.durable_publish
        self.store = Store(
            self.connector, self.options.schema, relaxed=self.relaxed,
            publisher=self.connector if durable else self.relaxed,
            publisher_flushes=durable, max_message_bytes=self.options.max_message_bytes,
        )
        self.listener = Listener(
            self.connector, self.options.schema, use_notify=self.options.use_notify
        )
        self._renewer: Housekeeper | None = None
        self._vacuumer: Vacuumer | None = None
        #: Set when Celery collects this transport after losing the connection.
        self.lost = False
        self.drain = Drain(self)
        self.hub = EventLoopDrain(self, self.drain)

    def driver_version(self) -> str:
        return str(psycopg.__version__)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        # kombu passes its `hostname`, masked since __init__; the secrets are in its
        # `password`. Shown, a secret is *** whatever mask kombu or Celery asks for:
        # one mask on every surface.
        url = unseal(uri, getattr(self.client, "password", None)) if "://" in uri else self.url
        return url if include_password else mask_url(url)

    def establish_connection(self) -> Any:
        ensure_schema(self.connector, self.options.schema, auto_migrate=self.options.auto_migrate)
        # Prove the server answers now, so a bad URL fails at connect, not later.
        with self.connector.connection() as conn:
            conn.execute("SELECT 1")
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            self.hub.unregister()
            self.drain.close()
            self._stop_housekeeping()
            self.listener.close()
            self.relaxed.close()
            self.connector.close()

    def _collect(self, connection: Any) -> None:
        """Drop a lost connection without releasing what it delivered.

        Celery calls this (not close) when the broker connection is lost. Tasks
        still running keep their messages: their leases lapse only after the
        visibility timeout, and an ack that comes before then still lands (acks
        open a fresh connection). Releasing here, as close does, would hand
        running tasks to another consumer at once.
        """
        self.lost = True
        self._stop_housekeeping()
        # Acks open fresh connections: what finished before the loss still lands.
        self.hub.unregister()
        self.drain.close()
        self.listener.close()
        self.relaxed.close()
        self.connector.close()

    def wake(self) -> None:
        """A claim may be worth making now: tell the consumer loop, whichever it is."""
        if not self.hub.wake():
            self.listener.wake()

    # -- consuming -----------------------------------------------------------
    def as_payload(self, claimed: Claimed) -> dict[str, Any]:
        payload = claimed.payload
        assert payload is not None, "a message with no payload is dead-lettered"
        props = payload.setdefault("properties", {})
        props["delivery_tag"] = f"{claimed.id}:{claimed.lease}"
        info = props.setdefault("delivery_info", {})
        info[TOKEN] = [claimed.id, claimed.lease]
        info["pgq_queue"] = claimed.queue
        # Where Celery looks (request.delivery_info['redelivered']) and where kombu does.
        info["redelivered"] = payload["redelivered"] = claimed.read_ct > 1
        return payload

    @staticmethod
    def raw_payload(message: Any) -> dict[str, Any]:
        """The transport payload of a delivered kombu message, as it was stored."""
        raw = getattr(message, "_raw", None)
        if isinstance(raw, dict):
            return raw
        return {
            "body": message.body,
            "content-type": message.content_type,
            "headers": message.headers,
            "properties": {},
        }

    # -- Celery's event loop (see hub.py) ------------------------------------------
    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._ensure_renewer()
        self.hub.register(loop)
        self.drain.acks.start()

    def deliver(self, payload: dict[str, Any], queue: str) -> None:
        """Hand a message to the consumer of ``queue`` (kombu's callback). Should that
        raise, no channel holds the delivery any more (the caller dead-letters it)."""
        try:
            self._deliver(payload, queue)
        except Exception:
            tag = payload["properties"]["delivery_tag"]
            for channel in list(self.channels):
                if channel._qos is not None:
                    channel._qos.forget(tag)
            raise

    def consuming_channels(self) -> list[PgChannel]:
        return [c for c in self.channels if any(c.consuming())]

    def _consumed_queues(self) -> set[str]:
        """Every queue some channel of this connection consumes, acked or not."""
        return {q for c in self.consuming_channels() for qs in c.consuming() for q in qs}

    def drain_events(  # type: ignore[override]
        self, connection: Any, timeout: float | None = None
    ) -> None:
        """Deliver what is visible now, else wait for a NOTIFY, an ack or the poll."""
        self._ensure_renewer()
        self.drain.drain(timeout)

    def _ensure_renewer(self) -> None:
        """Start the consumer's background threads: lease renewal and maintenance,
        and (unless ``vacuum_threshold`` is 0) vacuuming of the message table."""
        if self._renewer is None or not self._renewer.is_alive():
            self._renewer = Housekeeper(self)
            self._renewer.start()
        threshold = self.options.vacuum_threshold
        if threshold and (self._vacuumer is None or not self._vacuumer.is_alive()):
            self._vacuumer = Vacuumer(self.connector, self.options.schema, threshold)
            self._vacuumer.start()

    def _stop_housekeeping(self) -> None:
        for thread in (self._renewer, self._vacuumer):
            if thread is not None:
                thread.stop()

    def maintain(self) -> None:
        queues = sorted(self._consumed_queues())
        self.store.maintain(queues)

    def held(self) -> list[tuple[Lease, float]]:
        """Every message this consumer holds a lease on: delivered and unacked, or
        claimed and not handed over yet."""
        held = self.drain.held()
        for channel in list(self.channels):
            qos = channel._qos
            if qos is not None:
                held.extend(qos.held())
        return held


def _client_url(client: Any) -> str:
    """The pgq URL of a kombu Connection, built from its fields when not given as one."""
    if len(getattr(client, "alt", None) or ()) > 1:
        # kombu splits a URL at every ';' into failover alternates, a ';' in a password
        # included, and Celery reports the alternates masked by a parser of its own.
        raise ConfigurationError(
            "the broker URL is a list (kombu splits a URL at ';'): pgq takes one URL. "
            "List failover hosts libpq's way, pgq://host1,host2/db?"
            "target_session_attrs=read-write, and write a ';' in a password as %3B"
        )
    hostname = client.hostname or ""
    if "://" in hostname:
        return unseal(str(hostname), client.password)
    auth = ""
    if client.userid:
        auth = quote(client.userid, safe="")
        if client.password:
            auth += ":" + quote(str(client.password), safe="")
        auth += "@"
    host = hostname
    port = f":{client.port}" if client.port else ""
    vhost = client.virtual_host or ""
    vhost = "" if vhost == "/" else quote(vhost.lstrip("/"), safe="")
    return f"pgq://{auth}{host}{port}/{vhost}"

