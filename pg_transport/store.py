"""Every SQL operation on the queue tables, behind one narrow class.

No kombu in here: the store speaks of queues, payloads, ids and leases. Statements that
are safe to repeat (ack, release, renew, dead-lettering) are retried on a fresh
connection after a dead-connection error (ack, release and renew through a short outage:
see :func:`~pg_transport.connection.retry_fenced`); publish is made safe to repeat by its
publish key.

A delivered message's fencing token is its :class:`Lease`: the row id, the grant it was
delivered under (the ``lease`` column, bumped by every claim and every release) and its
queue. Ack, release, renew and dead-lettering touch the row only under that token, so a
holder whose lease lapsed (the message was claimed again) or whose message was released
can touch it no more.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Json

from pg_transport import batching
from pg_transport.connection import Connector
from pg_transport.errors import MessageTooLarge, NotPermitted
from pg_transport.sql import channel_prefix, load_queries, queue_channel
from pg_transport.wire import Row, Statement, run_apart

logger = logging.getLogger("pg_transport.store")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Claimed",
    "Lease",
    "Store",
    "claim_params",
    "decode_claimed",
]

#: Largest payload (its JSON text, in bytes) published or delivered by default.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Unlimited attempts, where a caller gives no max_attempts (read_ct is an integer).
_NO_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Lease:
    """The fencing token of one delivery: row id, grant and queue."""

    id: int
    lease: int
    queue: str


@dataclass(frozen=True)
class Claimed:
    """One row a claim (or pop) brought back.

    ``dead_letter_id`` set: the claim moved the row to dead_letter instead of delivering
    it, for ``fault`` (past max_attempts, too large, not a JSON object). ``fault`` set and
    ``dead_letter_id`` None: the row was delivered but cannot be decoded into a message
    (the consumer dead-letters it under its lease). ``payload`` is None for an oversized
    row (never sent to the consumer) and for one that could not be decoded."""

    id: int
    queue: str
    priority: int
    read_ct: int
    lease: int
    payload: dict[str, Any] | None
    dead_letter_id: int | None = None
    fault: str | None = None
    #: The payload's JSON text, kept only when it did not decode.
    raw: str | None = None

    @property
    def token(self) -> Lease:
        return Lease(self.id, self.lease, self.queue)


class Store:
    """SQL on one schema of one database."""

    def __init__(
        self,
        connector: Connector,
        schema: str,
        *,
        relaxed: Connector | None = None,
        publisher: Connector | None = None,
        publisher_flushes: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """``relaxed`` (optional) runs claim, ack, release and renew: statements whose
        commit may be lost in a server crash at the price of a redelivery, never of a
        message (see the ``relax_commit`` query). ``publisher`` (default: ``connector``)
        runs publishes; ``publisher_flushes`` says whether its commits wait for their WAL
        flush (``durable_publish``): see :meth:`publish_on`. ``max_message_bytes`` bounds a
        published message's JSON text and the payload a claim brings at once."""
        self.connector = connector
        self.relaxed = relaxed or connector
        self.publisher = publisher or connector
        self.publisher_flushes = publisher_flushes
        self.max_message_bytes = max_message_bytes
        self.schema = schema
        self.channel_prefix = channel_prefix(schema)
        self.q = load_queries(schema)
        # The statements run once per message go through libpq directly (wire.py).
        self.wire = {
            name: Statement(name, self.q[name])
            for name in ("publish_plain", "enqueue", "wake", "claim")
        }

    def channel(self, queue: str) -> str:
        """The wake-up channel of ``queue``."""
        return queue_channel(self.schema, queue)

    # -- publishing ----------------------------------------------------------
    def encode(self, payload: dict[str, Any]) -> str:
        """The JSON text stored for ``payload``; :class:`MessageTooLarge` past the limit."""
        text = json.dumps(payload)  # ASCII only: its length is its size in bytes
        if len(text) > self.max_message_bytes:
            raise MessageTooLarge(
                f"message of {len(text)} bytes is larger than max_message_bytes "
                f"({self.max_message_bytes}); it was not published"
            )
        return text

    def publish(
        self,
        queue: str,
        payload: dict[str, Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        publish_key: str | None = None,
    ) -> None:
        """Insert a message and wake its queue's consumers once it is committed. With a
        ``publish_key`` a repeated call inserts nothing. Inside a batch
        (:mod:`~pg_transport.batching`) it joins the batch's transaction instead."""
        params = self._publish_params(queue, payload, priority, delay, publish_key)
        open_batch = batching.current()
        if open_batch is not None:
            open_batch.run(
                self._batch_key(), self.publisher, lambda conn: self._insert_on(conn, params)
            )
            return
        self.publisher.run(
            lambda conn: self._insert_on(conn, params), idempotent=publish_key is not None
        )

    def publish_on(
        self,
        conn: psycopg.Connection[Any],
        queue: str,
        payload: dict[str, Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        publish_key: str | None = None,
    ) -> None:
        """Insert a message on the caller's connection, inside the caller's transaction.

        For work that must commit together with its message (a barrier firing its
        callback): the message exists exactly when the transaction commits, and its
        wake-up (a NOTIFY, transactional) goes out then."""
        self._insert_on(conn, self._publish_params(queue, payload, priority, delay, publish_key))

    def _publish_params(
        self, queue: str, payload: dict[str, Any], priority: int, delay: float,
        publish_key: str | None,
    ) -> dict[str, Any]:
        return {
            "queue": queue,
            "priority": priority,
            "delay": max(delay, 0.0),
            "publish_key": publish_key,
            "payload": self.encode(payload),
            "notify": delay <= 0,
            "channel": self.channel(queue),
        }

    def _insert_on(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
        """Run a publish on ``conn``. Where the statement is a transaction of its own on a
        session that is pgq's (it prepares) and its commit waits for the WAL flush, the
        insert and its wake-up go as two transactions sent at once (:meth:`_enqueue_then_wake`);
        otherwise as one statement, inside whatever transaction ``conn`` has open."""
        if conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
            conn.execute(self.q["publish_plain"], params)  # join the caller's batch
            return
        if self.publisher_flushes and params["notify"] and _sends_apart(conn):
            self._enqueue_then_wake(conn, params)
            return
        prepare = conn.prepare_threshold is not None
        self.wire["publish_plain"].execute(conn, params, prepare=prepare)

    def _enqueue_then_wake(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
        """``publish_plain`` as two transactions sent at once: the insert, committed as
        the session says (durable by default), then the wake-up alone (the ``wake`` query
        says why). A publisher's flush then holds up no other publisher, and no consumer
        is woken for a message that is not on disk yet.

        The insert's outcome is the publish's; the wake-up is sent all the same when it
        fails (one wake-up too many: the listeners' claims find nothing new). A wake-up
        lost with the connection after the insert committed is sent again on another
        one; one that fails otherwise (the notification queue full) leaves a committed
        message that consumers find at their next poll instead of at once."""
        inserted, woke = run_apart(
            conn, [(self.wire["enqueue"], params), (self.wire["wake"], params)], prepare=True
        )
        if isinstance(inserted, psycopg.Error):
            raise inserted
        if isinstance(woke, psycopg.Error):
            self._wake_failed(conn, params, woke)

    def _wake_failed(
        self, conn: psycopg.Connection[Any], params: dict[str, Any], woke: psycopg.Error
    ) -> None:
        """A wake-up for a message committed durably failed: lost with ``conn``, it is
        sent again on another connection; otherwise a warning says so."""
        failure: psycopg.Error | None = woke
        if isinstance(woke, psycopg.OperationalError) and conn.closed:
            try:
                self.publisher.run(
                    lambda other: self.wire["wake"].execute(other, params, prepare=True),
                    idempotent=True,
                )
                failure = None
            except psycopg.Error as exc:
                failure = exc
        if failure is not None:
            logger.warning(
                "pgq: a message of queue %r is published, but waking its consumers "
                "failed (%s): they take it at their next poll", params["queue"], failure,
            )

    def publish_routed(
        self,
        exchange: str,
        routing_key: str,
        payload: dict[str, Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        ttl: float | None = None,
        publish_tag: str | None = None,
    ) -> tuple[str | None, int]:
        """Insert one copy per queue the exchange routes ``routing_key`` to.

        Returns the exchange's type (None: never declared) and how many queues
        matched. With a ``publish_tag`` a repeated call inserts nothing new.
        """
        params = {
            "exchange": exchange,
            "routing_key": routing_key,
            "priority": priority,
            "delay": max(delay, 0.0),
            "ttl": ttl,
            "publish_tag": publish_tag,
            "payload": self.encode(payload),
            "notify": delay <= 0,
            "channel_prefix": self.channel_prefix,
        }

        def routed(conn: psycopg.Connection[Any]) -> tuple[str | None, int]:
            row = conn.execute(self.q["publish_routed"], params).fetchone()
            assert row is not None
            return row[0], int(row[1] or 0)

        open_batch = batching.current()
        if open_batch is not None:
            found: tuple[str | None, int] = open_batch.run(
                self._batch_key(), self.publisher, routed
            )
            return found
        return self.publisher.run(routed, idempotent=publish_tag is not None)

    def dead_letter_unroutable(
        self, queue: str, payload: dict[str, Any], *, priority: int, reason: str
    ) -> int:
        params = {"queue": queue, "payload": self.encode(payload), "priority": priority,
                  "reason": reason}
        open_batch = batching.current()
        if open_batch is not None:  # kept only if the batch's message is published
            return int(open_batch.run(self._batch_key(), self.publisher, lambda conn: (
                self._scalar_on(conn, "dead_letter_unroutable", params)
            )))
        return int(self._scalar("dead_letter_unroutable", params, idempotent=False))

    def _batch_key(self) -> tuple[str, str, bool]:
        """Which transaction of a batch this store's publishes join: the publisher's
        database, the schema, and whether its commits wait for their WAL flush."""
        return (self.publisher.conninfo, self.schema, self.publisher_flushes)

    # -- consuming -----------------------------------------------------------
    def claim(
        self,
        queues: Sequence[str],
        vts: Sequence[float],
        limit: int,
        max_attempts: Sequence[int] | None = None,
        *,
        acks: Sequence[Lease] = (),
    ) -> list[Claimed]:
        """Claim up to ``limit`` visible messages over ``queues``, best first.

        A message already delivered ``max_attempts`` times (per queue; unlimited when not
        given), larger than ``max_message_bytes`` or not a JSON object is dead-lettered by
        the same statement and comes back with ``dead_letter_id`` set instead of being
        delivered. ``acks`` are acked by the same statement.

        Not retried: a claim whose result was lost is indistinguishable from a
        consumer that died, and the visibility timeout brings those rows back. The
        caller still owns ``acks`` when this raises.
        """
        if limit <= 0 or not queues:
            self.ack(acks)
            return []
        params = claim_params(
            queues, vts, limit, max_attempts, acks, max_bytes=self.max_message_bytes
        )

        def work(conn: psycopg.Connection[Any]) -> list[Row]:
            prepare = conn.prepare_threshold is not None
            return self.wire["claim"].execute(conn, params, prepare=prepare)

        return [decode_claimed(row) for row in self.relaxed.run(work, idempotent=False)]

    def pop(self, queues: Sequence[str], limit: int) -> list[Claimed]:
        """Take and delete up to ``limit`` visible messages: delivery without ack.
        Rows that cannot be delivered are dead-lettered by the same statement."""
        if limit <= 0 or not queues:
            return []
        params = {
            "queues": list(queues), "limit": limit,
            "max_bytes": self.max_message_bytes, "max_message_bytes": self.max_message_bytes,
        }

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self.q["pop"], params).fetchall()

        return [_claimed(*row) for row in self.relaxed.run(work, idempotent=False)]

    def keep_popped(self, claimed: Claimed, reason: str) -> int:
        """Keep in dead_letter a popped message (gone from its queue already) that could
        not be decoded, from its text; the dead-letter id."""
        return int(self._scalar("dead_letter_unroutable", {
            "queue": claimed.queue, "payload": claimed.raw or "null",
            "priority": claimed.priority, "reason": _text(reason),
        }, idempotent=False))

    def ack(self, tokens: Sequence[Lease]) -> int:
        """Delete delivered messages still held under ``tokens``; how many were."""
        return self._fenced("ack", tokens)

    def release(self, tokens: Sequence[Lease]) -> int:
        """Make held messages visible now (requeue); how many were still held."""
        return self._fenced("release", tokens, channel_prefix=self.channel_prefix)

    def renew(self, held: Sequence[tuple[Lease, float]]) -> int:
        """Push the visibility timeout of held messages to now + their vt."""
        if not held:
            return 0
        params = {**_lease_params([t for t, _ in held]), "vts": [vt for _, vt in held]}

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q["renew"], params).rowcount

        return self.relaxed.run(work, idempotent=True, fenced=True)

    def _fenced(self, name: str, tokens: Sequence[Lease], **extra: Any) -> int:
        if not tokens:
            return 0
        params = {**_lease_params(tokens), **extra}

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q[name], params).rowcount

        return self.relaxed.run(work, idempotent=True, fenced=True)

    def dead_letter(self, token: Lease, reason: str) -> int | None:
        """Move a held message to dead_letter; the dead-letter id, or None if not held."""
        params = {"id": token.id, "lease": token.lease, "queue": token.queue,
                  "reason": _text(reason)}

        def work(conn: psycopg.Connection[Any]) -> int | None:
            row = conn.execute(self.q["dead_letter"], params).fetchone()
            return int(row[0]) if row else None

        return self.connector.run(work, idempotent=True)

    def identify_dead_letter(
        self,
        dead_letter_id: int,
        *,
        task_id: str | None,
        task_name: str | None,
        identity: dict[str, Any],
        reasons: Sequence[str],
    ) -> None:
        """Record the task and identity recovered from a dead-lettered message. Text is
        stored as Postgres can hold it (no NUL, no lone surrogate; an identity value
        jsonb refuses, such as NaN, as its text)."""
        self._command(
            "dead_letter_identify",
            {
                "id": dead_letter_id,
                "task_id": None if task_id is None else _text(task_id),
                "task_name": None if task_name is None else _text(task_name),
                "identity": Json(storable(identity)),
                "note": _text("".join(f"; {r}" for r in reasons)),
            },
        )

    def record_hooks(self, dead_letter_id: int, hooks: list[dict[str, Any]]) -> None:
        self._command("dead_letter_hooks", {"id": dead_letter_id, "hooks": Json(storable(hooks))})

    def get_dead_letter(self, dead_letter_id: int) -> dict[str, Any] | None:
        def work(conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
            cur = conn.execute(self.q["dead_letter_get"], {"id": dead_letter_id})
            row = cur.fetchone()
            if row is None:
                return None
            names = [d.name for d in cur.description or ()]
            return dict(zip(names, row, strict=True))

        return self.connector.run(work, idempotent=True)

    # -- queues --------------------------------------------------------------
    def _scalar(self, name: str, params: dict[str, Any], *, idempotent: bool = True) -> Any:
        return self.connector.run(
            lambda conn: self._scalar_on(conn, name, params), idempotent=idempotent
        )

    def _scalar_on(self, conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> Any:
        row = conn.execute(self.q[name], params).fetchone()
        return row[0] if row else None

    def _command(self, name: str, params: dict[str, Any]) -> int:
        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q[name], params).rowcount

        return self.connector.run(work, idempotent=True)

    def size(self, queue: str) -> int:
        return int(self._scalar("size", {"queue": queue}))

    def purge(self, queue: str) -> int:
        # Not retried: a lost answer would make the retry report 0.
        return int(self._scalar("purge", {"queue": queue}, idempotent=False))

    def _declaring(self, what: str, name: str, params: dict[str, Any]) -> Any:
        """Run a statement that writes queues, exchanges or bindings. A role that may
        not (a publisher-only role: docs/least-privilege.md) meets it at its first
        publish, as kombu and Celery declare by default: it is told what to do. Returns
        the statement's first column, if it returns one."""

        def work(conn: psycopg.Connection[Any]) -> Any:
            try:
                cur = conn.execute(self.q[name], params)
                row = cur.fetchone() if cur.description else None
                return row[0] if row else None
            except psycopg.errors.InsufficientPrivilege as exc:
                raise NotPermitted(
                    f"role {conn.info.user!r} may not declare {what} in pgq schema "
                    f"{self.schema!r} ({exc.diag.message_primary or exc}): declare it as a "
                    "role that may (the workers do when they start), or publish without "
                    "declaring (no_declare=True on the queue or exchange; see "
                    "docs/least-privilege.md)"
                ) from exc

        return self.connector.run(work, idempotent=True)

    def declare_queue(
        self, queue: str, *, expires_ms: int | None = None, message_ttl_ms: int | None = None
    ) -> None:
        self._declaring(
            f"queue {queue!r}", "declare_queue",
            {"queue": queue, "expires_ms": expires_ms, "message_ttl_ms": message_ttl_ms},
        )

    def has_queue(self, queue: str) -> bool:
        return bool(self._scalar("has_queue", {"queue": queue}))

    def delete_queue(self, queue: str) -> int:
        return self._command("delete_queue", {"queue": queue})

    # -- routing -------------------------------------------------------------
    def declare_exchange(self, exchange: str, type_: str) -> str:
        """Record an exchange; the type it has (an existing one keeps its own)."""
        return str(self._declaring(f"exchange {exchange!r}", "declare_exchange",
                                   {"exchange": exchange, "type": type_}))

    def exchange_type(self, exchange: str) -> str | None:
        found = self._scalar("exchange_type", {"exchange": exchange})
        return None if found is None else str(found)

    def delete_exchange(self, exchange: str) -> None:
        self._command("delete_exchange", {"exchange": exchange})

    def bind(self, exchange: str, queue: str, routing_key: str, pattern: str) -> bool:
        """Bind; False when the exchange was never declared (nothing is bound)."""
        params = {"exchange": exchange, "queue": queue, "routing_key": routing_key,
                  "pattern": pattern}
        return bool(self._declaring(f"a binding of queue {queue!r} to {exchange!r}", "bind",
                                    params))

    def unbind(self, exchange: str, queue: str, routing_key: str) -> None:
        self._command("unbind", {"exchange": exchange, "queue": queue,
                                 "routing_key": routing_key})

    def list_bindings(self) -> list[tuple[str, str, str]]:
        def work(conn: psycopg.Connection[Any]) -> list[tuple[str, str, str]]:
            return [tuple(r) for r in conn.execute(self.q["list_bindings"]).fetchall()]

        return self.connector.run(work, idempotent=True)

    def maintain(self, queues: Sequence[str]) -> tuple[int, int]:
        """Touch ``queues``; reap expired queues and messages. (queues, messages) reaped."""

        def work(conn: psycopg.Connection[Any]) -> tuple[int, int]:
            with conn.transaction():
                row = conn.execute(self.q["maintain"], {"queues": list(queues)}).fetchone()
                gone, expired = (list(row[0]), int(row[1])) if row else ([], 0)
                if gone:
                    conn.execute(self.q["drop_messages"], {"queues": gone})
            return len(gone), expired

        # On a session that plans for the values it gets (see drop_messages).
        return self.connector.run(work, idempotent=True)


def claim_params(
    queues: Sequence[str],
    vts: Sequence[float],
    limit: int,
    max_attempts: Sequence[int] | None,
    acks: Sequence[Lease],
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Parameters of the ``claim`` query."""
    attempts = list(max_attempts) if max_attempts is not None else [_NO_LIMIT] * len(queues)
    return {
        "queues": list(queues), "vts": list(vts), "max_attempts": attempts, "limit": limit,
        "ack_ids": [t.id for t in acks], "ack_leases": [t.lease for t in acks],
        "ack_queues": [t.queue for t in acks],
        "max_bytes": max_bytes, "max_message_bytes": max_bytes,
    }


def _lease_params(tokens: Sequence[Lease]) -> dict[str, Any]:
    return {
        "ids": [t.id for t in tokens],
        "leases": [t.lease for t in tokens],
        "queues": [t.queue for t in tokens],
    }


def _sends_apart(conn: psycopg.Connection[Any]) -> bool:
    """Whether statements on ``conn`` may be sent as transactions of their own, several
    at once (:func:`~pg_transport.wire.run_apart`): the session prepares (it is its own,
    not a transaction pooler's) and no transaction is open on it."""
    return (
        conn.prepare_threshold is not None
        and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    )


def decode_claimed(row: Sequence[bytes | None]) -> Claimed:
    """A claim row as libpq's text values (statements sent without psycopg's cursor).

    Never raises for what a row holds: a payload that does not decode into a JSON
    object comes back with ``fault`` saying why, for the consumer to dead-letter."""
    ident, queue, priority, read_ct, lease, payload, dead, fault = row[:8]
    assert ident is not None and queue is not None
    assert priority is not None and read_ct is not None and lease is not None
    return _claimed(
        int(ident), queue.decode("utf-8", "replace"), int(priority), int(read_ct), int(lease),
        payload, None if dead is None else int(dead),
        None if fault is None else fault.decode("utf-8", "replace"),
    )


def _claimed(
    ident: int, queue: str, priority: int, read_ct: int, lease: int,
    payload: Any, dead: int | None, fault: str | None,
) -> Claimed:
    """A Claimed row, its payload decoded and checked (``payload``: JSON text or bytes,
    or what psycopg already decoded)."""
    decoded: dict[str, Any] | None = None
    raw: str | None = None
    if payload is not None:
        try:
            value = json.loads(payload) if isinstance(payload, (bytes, str)) else payload
        except (ValueError, RecursionError) as exc:
            value, fault = None, fault or f"payload does not decode: {type(exc).__name__}"
        if isinstance(value, dict):
            decoded = value
        else:
            fault = fault or f"payload is a JSON {type(value).__name__}, not an object"
            if isinstance(payload, (bytes, str)):
                raw = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
    return Claimed(ident, queue, priority, read_ct, lease, decoded, dead, fault, raw)


def _text(value: str) -> str:
    """``value`` as Postgres text can hold it: NUL and lone surrogates replaced."""
    cleaned = value.replace("\x00", "\N{REPLACEMENT CHARACTER}")
    return cleaned.encode("utf-8", "replace").decode("utf-8")


def storable(value: Any) -> Any:
    """``value`` as jsonb can hold it: strings through :func:`_text`, floats that are not
    finite (NaN, infinities) as their text, anything else not JSON as its repr."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, dict):
        return {_text(str(k)): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return _text(repr(value))
