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
Every key of :class:`pg_transport.config.Options` (the full list, with defaults, is
docs/configuration.md), each overridable by ``PGQ_<KEY>``.

This module is thin: the Transport connects, owns the store, the publisher and the
consumer engine, and hands the engine to whichever loop drives it (Celery's event loop,
or kombu's blocking ``drain_events``). Queues, exchanges and publishing are the
Channel's (:mod:`pg_transport.kombu.channel`), acks and rejects the QoS's
(:mod:`pg_transport.kombu.qos`); :mod:`pg_transport.kombu.hooks` connects the Celery
signals pgq receives.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from time import monotonic
from typing import Any
from urllib.parse import quote

import psycopg
from kombu.transport import virtual

from pg_transport import failover
from pg_transport.backoff import BACKOFF
from pg_transport.config import Options, warn_unknown_environment
from pg_transport.consume.blocking import BlockingDriver
from pg_transport.consume.engine import UNLIMITED_BATCH, Engine
from pg_transport.consume.housekeeping import Housekeeper
from pg_transport.consume.hub import HubDriver
from pg_transport.consume.listener import Listener
from pg_transport.consume.session import Session
from pg_transport.consume.source import Want
from pg_transport.consume.vacuum import Vacuumer
from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector, mask_url, url_to_conninfo
from pg_transport.db.pool import shared as shared_connector
from pg_transport.db.url import first_port, seal, unseal
from pg_transport.errors import (
    BrokerRefused,
    BrokerUnavailable,
    BrokerUnreachable,
    SchemaError,
)
from pg_transport.kombu.channel import EXCHANGE_TYPES, PUBLISH_ID
from pg_transport.kombu.channel import Channel as PgChannel
from pg_transport.kombu.qos import TOKEN
from pg_transport.publish.publisher import Publisher
from pg_transport.sql import load_queries
from pg_transport.store import Claimed, Lease, Store

__all__ = ["Transport", "interrupt_drains"]

logger = logging.getLogger("pg_transport.transport")

# Longest a close waits for a housekeeping thread's cycle under way (a statement or two;
# through an outage an ack's retries may take longer: that thread then ends on its own).
HOUSEKEEPING_STOP_WAIT = 5.0

# Every transport of this process, for interrupt_drains (a signal handler: no lock).
_live: weakref.WeakSet[Transport] = weakref.WeakSet()


def interrupt_drains() -> None:
    """The worker is shutting down: every blocking drain of this process ends now
    (:meth:`pg_transport.consume.blocking.BlockingDriver.interrupt`)."""
    for transport in list(_live):
        transport.blocking.interrupt()


class Transport(virtual.Transport):
    """kombu transport for ``pgq://`` URLs."""

    Channel = PgChannel
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
        batch_publish=True,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = Options.from_sources(client.transport_options, os.environ)
        warn_unknown_environment(os.environ)
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
        # kombu leaves a URL it does not parse whole without a port; the port libpq
        # tries first stands there until a connection says which one answered.
        client.port = first_port(self.url) or client.port
        # Behind a transaction pooler (use_notify off) a session is not ours from one
        # statement to the next: no server-side prepared statements, no session
        # settings (every statement commits synchronously, is planned every time).
        queries = load_queries(self.options.schema)
        own = self.options.use_notify
        prepare = 5 if own else None
        no_jit = (queries["no_jit"],) if own else ()
        # Every kombu connection of this process with the same settings shares these
        # two pools (shared): a process holds one set of sessions, capped by pool_size,
        # however many connections Celery or Flower open; an idle one closes after
        # pool_idle_timeout.
        sizes = {
            "max_size": self.options.pool_size,
            "max_idle": self.options.pool_size,
            "idle_timeout": self.options.pool_idle_timeout,
        }
        self.connector = shared_connector(
            conninfo,
            display_url=shown,
            prepare_threshold=prepare,
            setup=no_jit,
            pin_search_path=own,
            **sizes,
        )
        # The consumer's statements (claim, ack, renew, ...) are planned once.
        self.relaxed = (
            shared_connector(
                conninfo,
                display_url=shown,
                prepare_threshold=prepare,
                setup=(
                    *_commit_setup(self.options.durable_acks, queries),
                    queries["generic_plans"],
                    *no_jit,
                ),
                **sizes,
            )
            if own
            else self.connector
        )
        # durable_publish off: a publish commits without waiting for its WAL flush, as
        # the consumer's statements do. On: it returns after the flush, but a consumer
        # waiting for it has it before.
        durable = self.options.durable_publish
        self.store = Store(
            self.connector,
            self.options.schema,
            relaxed=self.relaxed,
            max_message_bytes=self.options.max_message_bytes,
            follows_retention=self.options.follows_retention,
            fenced_window=self.options.fenced_window,
        )
        #: Publishes to the same schema (the store runs every other statement).
        self.publisher = Publisher(
            self.connector if durable else self.relaxed,
            self.options.schema,
            flushes=durable,
            max_message_bytes=self.options.max_message_bytes,
            follows_timeout=self.options.follows_timeout,
            unique_wait=self.options.unique_wait,
        )
        self._renewer: Housekeeper | None = None
        self._vacuumer: Vacuumer | None = None
        #: Set when Celery collects this transport after losing the connection.
        self.lost = False
        session = Session(
            self.relaxed,
            self.options.schema,
            listen=own,
            prepare=own,
            # Behind a pooler no session setting lasts: each claim relaxes its commit.
            relax=None if own else _claim_relax(self.options.durable_acks),
        )
        #: The consumer, one for every way of driving it.
        self.engine = Engine(
            self,
            self.store,
            session,
            max_message_bytes=self.options.max_message_bytes,
            listener=self._listener(),
        )
        self.hub = HubDriver(self.engine, self.polling_interval)
        self.blocking = BlockingDriver(self.engine, self.polling_interval)
        _live.add(self)

    # kombu's Connection drops ``client`` from a transport it collects after a lost
    # connection, but a publish retry (kombu's, Celery's ``task_publish_retry``) then
    # declares the queue again through an entity still bound to this transport's
    # channel, which reads ``channel.connection.client``: a lost transport keeps its
    # client, and that declare lands through the store, which outlives the loss.
    @property
    def client(self) -> Any:
        return self._client

    @client.setter
    def client(self, value: Any) -> None:
        if value is not None or not getattr(self, "lost", False):
            self._client = value

    def _listener(self) -> Listener | None:
        """Behind a pooler with ``listen_url``: the direct session that LISTENs for this
        process's consumer (no prepared statements; search_path pinned, as it is ours)."""
        url = self.options.listen_url
        if not url:
            return None
        connector = Connector(
            url_to_conninfo(url), display_url=mask_url(url), max_idle=0, prepare_threshold=None
        )
        return Listener(connector, self.options.schema, lambda: self.engine.poke())

    def driver_version(self) -> str:
        return str(psycopg.__version__)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        # kombu passes its `hostname`, masked since __init__; the secrets are in its
        # `password`. Shown, a secret is *** whatever mask kombu or Celery asks for:
        # one mask on every surface.
        url = unseal(uri, getattr(self.client, "password", None)) if "://" in uri else self.url
        return url if include_password else mask_url(url)

    def establish_connection(self) -> Any:
        # In a worker, a refusal before this one makes it wait first (backoff.py).
        BACKOFF.wait()
        try:
            ensure_schema(
                self.connector, self.options.schema, auto_migrate=self.options.auto_migrate
            )
            # Prove the server answers now, so a bad URL fails at connect, not later.
            with self.connector.connection() as conn:
                conn.execute("SELECT 1")
                if self.client is not None:  # with several hosts, the one that answered
                    self.client.port = int(conn.info.port)
        except BrokerRefused as exc:
            BACKOFF.refused(exc)
            raise
        BACKOFF.connected()
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            self.hub.unregister()
            self.engine.close()
            self._stop_housekeeping(wait=HOUSEKEEPING_STOP_WAIT)
            # The pools are the process's (shared): their idle sessions close after
            # pool_idle_timeout, or when another user finds them dead.

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
        self.engine.close()
        # What killed this connection most likely killed the pools' idle sessions too.
        self.relaxed.discard_idle()
        self.connector.discard_idle()

    def wake(self) -> None:
        """A claim may be worth making now (an ack freed a slot): tell the engine."""
        self.engine.wake()

    # -- consuming -----------------------------------------------------------
    def as_payload(self, claimed: Claimed) -> dict[str, Any]:
        payload = claimed.payload
        assert payload is not None, "a message with no payload is dead-lettered"
        props = payload.setdefault("properties", {})
        props.pop(PUBLISH_ID, None)  # the publish's, not the delivery's (channel.publish_id)
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

    # -- the engine's source (consume/engine.py) ------------------------------------
    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._ensure_renewer()
        self.hub.register(loop)

    def wants(self) -> list[Want]:
        """Every consuming channel's queues, and how many messages it has room for."""
        found = []
        for channel in self.consuming_channels():
            acked, unacked = channel.consuming()
            qos = channel.qos
            room = (
                int(qos.can_consume_max_estimate() or UNLIMITED_BATCH) if qos.can_consume() else 0
            )
            found.append(Want(acked, unacked, room, qos.prefetch_count or 0))
        return found

    def deliver(self, claimed: Claimed) -> None:
        """Hand a message to the consumer of its queue (kombu's callback). Should that
        raise, no channel holds the delivery any more (the engine dead-letters it)."""
        payload = self.as_payload(claimed)
        try:
            self._deliver(payload, claimed.queue)
        except Exception:
            tag = payload["properties"]["delivery_tag"]
            for channel in list(self.channels):
                if channel._qos is not None:
                    channel._qos.forget(tag)
            raise

    def visibility_timeout(self, queue: str) -> float:
        return self.options.visibility_timeout_for(queue)  # (cached there, per queue)

    def max_attempts(self, queue: str) -> int:
        return self.options.max_attempts_for(queue)

    def fair_share(self, queue: str) -> bool:
        return bool(self.options.fair_share_for(queue))

    def consuming_channels(self) -> list[PgChannel]:
        return [c for c in self.channels if any(c.consuming())]

    def _consumed_queues(self) -> set[str]:
        """Every queue some channel of this connection consumes, acked or not."""
        return {q for c in self.consuming_channels() for qs in c.consuming() for q in qs}

    def drain_events(  # type: ignore[override]
        self, connection: Any, timeout: float | None = None
    ) -> None:
        """Deliver what comes, else wait for a wake-up, an ack or the poll: the engine
        Celery's event loop runs, driven by a poll() loop (:mod:`~pg_transport.db.waits`)."""
        self._ensure_renewer()
        self.blocking.drain(timeout)

    def _ensure_renewer(self) -> None:
        """Start the consumer's background threads: lease renewal and maintenance,
        and (unless ``vacuum_threshold`` is 0) vacuuming of the message table."""
        threshold = self.options.vacuum_threshold
        if threshold and (self._vacuumer is None or not self._vacuumer.is_alive()):
            # The maintenance's pool: the housekeeping's look shares its session.
            self._vacuumer = Vacuumer(self.connector, self.options.schema, threshold)
            self._vacuumer.start()
        if self._renewer is None or not self._renewer.is_alive():
            self._renewer = Housekeeper(
                flush_acks=self.engine.flush_acks,
                held=self.held,
                renew=self.renew if self.options.lease_renewal else None,
                maintain=self.maintain,
                default_vt=self.options.visibility_timeout,
                look=self._look_for_vacuum if threshold else None,
            )
            self._renewer.start()

    def _stop_housekeeping(self, wait: float = 0.0) -> None:
        """Stop the background threads; with ``wait`` (a close), wait that long at most
        for each to end: once the close returns, none of them sends a statement."""
        for thread in (self._renewer, self._vacuumer):
            if thread is not None:
                thread.stop()
        for thread in (self._renewer, self._vacuumer):
            if thread is not None:
                thread.stop(wait)

    def _look_for_vacuum(self) -> None:
        vacuumer = self._vacuumer
        if vacuumer is not None and vacuumer.is_alive():
            vacuumer.look()

    def maintain(self) -> None:
        queues = sorted(self._consumed_queues())
        self.store.maintain(queues)

    def renew(self, held: Sequence[tuple[Lease, float]]) -> None:
        """Renew ``held``; each channel's QoS learns which leases now run longer and
        which are lost (a delivery whose lease lapsed is not started: guard.py)."""
        sent = monotonic()
        # An atomic task's commit deletes its row before the worker's ack (a settle)
        # forgets it: a renewal in between finds it gone, expectedly. The renewal also
        # races this consumer's acks: a message acked after ``held`` was read may be gone
        # when the statement runs, which is no loss (only a row still held once the
        # statement is done was lost to another consumer).
        completing = {
            ident
            for channel in list(self.channels)
            if channel._qos is not None
            for ident in channel._qos.settling()
        }
        lost = {t.id for t in self.store.renew_lost(held, self._still_held, expected=completing)}
        landed = {t.id for t, _ in held} - lost
        for channel in list(self.channels):
            qos = channel._qos
            if qos is not None:
                qos.renewed(landed, lost, sent)

    def _still_held(self, tokens: list[Lease]) -> list[Lease]:
        now = {(t.id, t.lease) for t, _ in self.held()}
        return [t for t in tokens if (t.id, t.lease) in now]

    def held(self) -> list[tuple[Lease, float]]:
        """Every message this consumer holds a lease on: delivered and unacked, or
        claimed and not handed over yet."""
        held = self.engine.held()
        for channel in list(self.channels):
            qos = channel._qos
            if qos is not None:
                held.extend(qos.held())
        return held


def _commit_setup(durable_acks: str, queries: dict[str, str]) -> tuple[str, ...]:
    """How the consumer's session commits (``durable_acks``): relaxed (off), as the
    server says (on), or relaxed unless the server has synchronous standbys (auto)."""
    return {
        "off": (queries["relax_commit"],),
        "on": (),
        "auto": (queries["relax_commit_unless_synchronous"],),
    }[durable_acks]


def _claim_relax(durable_acks: str) -> str | None:
    """Behind a transaction pooler, where no session setting lasts, how each claim
    commits (the claim's ``relax``): as ``durable_acks`` has the consumer's session
    commit on Postgres directly ('off', 'auto'; 'on': None, as the server says)."""
    return None if durable_acks == "on" else durable_acks


def _client_url(client: Any) -> str:
    """The pgq URL of a kombu Connection, built from its fields when not given as one."""
    alternates = getattr(client, "alt", None)
    if isinstance(alternates, list) and len(alternates) > 1:
        # kombu's failover list ('pgq://a;pgq://b', or Celery's list-valued broker_url).
        failover.adopt(alternates)
    hostname = client.hostname or ""
    if "://" in hostname:
        return unseal(str(hostname), client.password)
    switched = failover.full_url(client)
    if switched is not None:  # kombu switched to an alternate's switch form
        return switched
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
