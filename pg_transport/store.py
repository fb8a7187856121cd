"""Every SQL operation on the queue tables, behind one narrow class.

No kombu in here: the store speaks of queues, payloads, ids and fencing tokens.
Statements that are safe to repeat (ack, release, renew) are retried once on a
fresh connection after a dead-connection error; publish is made safe to repeat
by its publish key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.types.json import Json

from pg_transport import batching
from pg_transport.connection import Connector
from pg_transport.gate import HandoffGate
from pg_transport.locks import lock_space
from pg_transport.sql import handoff_prefix, load_queries, notify_channel
from pg_transport.wire import Row, Statement, run_apart

logger = logging.getLogger("pg_transport.store")

# Routes that matched no queue remembered at most; more are forgotten (see publish_routed).
_MAX_ROUTES = 1024

T = TypeVar("T")

__all__ = [
    "HANDOFF_LIMIT",
    "Claimed",
    "Store",
    "Waiting",
    "claim_params",
    "decode_claimed",
    "decode_handed",
    "notify_channel",
    "unwaited",
]

# The longest NOTIFY payload, in bytes. A message handed to a consumer travels in one,
# with its id, queue (JSON-escaped: up to 6 bytes a byte) and priority around it;
# larger messages wait for a claim.
HANDOFF_LIMIT = 7999
# Room for the id, the priority and the JSON array's punctuation.
_HANDOFF_FRAME = 64

@dataclass(frozen=True)
class Claimed:
    id: int
    queue: str
    priority: int
    read_ct: int
    payload: dict[str, Any]
    #: Set when the claim found this message past max_attempts and dead-lettered it.
    dead_letter_id: int | None = None


class Store:
    """SQL on one schema of one database."""

    def __init__(
        self,
        connector: Connector,
        schema: str,
        *,
        relaxed: Connector | None = None,
        publisher: Connector | None = None,
        deliver_before_flush: bool = False,
        publisher_flushes: bool = True,
        gate: HandoffGate | None = None,
    ) -> None:
        """``relaxed`` (optional) runs claim, ack, release and renew: statements whose
        commit may be lost in a server crash at the price of a redelivery, never of a
        message (see the ``relax_commit`` query). ``publisher`` (default: ``connector``)
        runs publishes.

        ``deliver_before_flush``: a message handed to a waiting consumer is committed
        without waiting for its WAL flush, so that the consumer has it at once, and
        :meth:`publish` runs the ``flush_wal`` query before it returns: the message is
        on disk by then, as with any durable publish (see the ``publish`` query).

        ``publisher_flushes``: whether ``publisher``'s commits wait for their WAL flush
        (``durable_publish``, the default). Where they do not, a publish holds nobody up
        with its wake-up inside its transaction: see ``flushes`` in :meth:`publish_on`.

        ``gate`` (default: a new :class:`~pg_transport.gate.HandoffGate`) decides when
        :meth:`publish` tries a hand-off."""
        self.connector = connector
        self.relaxed = relaxed or connector
        self.publisher = publisher or connector
        self.deliver_before_flush = deliver_before_flush
        self.publisher_flushes = publisher_flushes
        self.gate = gate or HandoffGate()
        # Routes (exchange, routing key) whose last publish matched no queue.
        self._unrouted: set[tuple[str, str]] = set()
        # Whether this role may run flush_wal: asked once, on the first publish.
        self._can_flush: bool | None = None
        self.schema = schema
        self.channel = notify_channel(schema)
        self.lock_space = lock_space(schema)
        # What every publish tells the statement about where to wake or hand over.
        self._publish_to = {
            "channel": self.channel,
            "lock_space": self.lock_space,
            "take_space": lock_space(schema, "handoff"),
            "handoff_prefix": handoff_prefix(schema),
        }
        self.q = load_queries(schema)
        # The statements run once per message go through libpq directly (wire.py).
        self.wire = {
            name: Statement(name, self.q[name])
            for name in (
                "publish", "publish_plain", "enqueue", "wake", "settle", "publish_routed",
                "claim", "flush_wal",
            )
        }

    # -- publishing ----------------------------------------------------------
    def publish(
        self,
        queue: str,
        payload: dict[str, Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        publish_key: str | None = None,
    ) -> None:
        """Insert a message. With a ``publish_key`` a repeated call inserts nothing.

        The statement commits on its own, so a message due now may be handed straight
        to a waiting consumer (see the ``publish`` query), unless tries on its queue
        have lately found nobody waiting (:attr:`gate`). Inside a batch
        (:mod:`~pg_transport.batching`) it joins the batch's transaction instead."""
        open_batch = batching.current()
        if open_batch is not None:  # (publish_on joins the batch's pipeline: no hand-off)
            open_batch.run(self._batch_key(), self.publisher, lambda conn: self.publish_on(
                conn, queue, payload, priority=priority, delay=delay, publish_key=publish_key,
            ))
            return

        def statement(conn: psycopg.Connection[Any], unflushed: bool) -> tuple[None, bool]:
            handed_unflushed = self.publish_on(
                conn, queue, payload, priority=priority, delay=delay,
                publish_key=publish_key, handoff=True, deliver_unflushed=unflushed,
                flushes=self.publisher_flushes,
            )
            return None, handed_unflushed

        self._run_publish(statement, idempotent=publish_key is not None)

    def _run_publish(
        self,
        statement: Callable[[psycopg.Connection[Any], bool], tuple[T, bool]],
        *,
        idempotent: bool,
    ) -> T:
        """Run a publishing statement that commits on its own, flushing where needed.

        ``statement(conn, unflushed)`` runs it, allowed to hand over unflushed when
        ``unflushed``, and returns its result and whether a hand-off committed
        unflushed; the WAL is then flushed before this returns. A retry after a lost
        connection flushes even when its insert finds the message there: the attempt
        that sent the statement may have committed it unflushed."""
        sent = False

        def work(conn: psycopg.Connection[Any]) -> T:
            nonlocal sent
            unflushed = self.deliver_before_flush and self._may_flush(conn)
            retried, sent = sent, True
            result, handed_unflushed = statement(conn, unflushed)
            if handed_unflushed or (retried and unflushed):
                # On disk once a later commit's flush is done: WAL is flushed in order.
                prepare = conn.prepare_threshold is not None
                self.wire["flush_wal"].execute(conn, {}, prepare=prepare)
            return result

        return self.publisher.run(work, idempotent=idempotent)

    def _may_flush(self, conn: psycopg.Connection[Any]) -> bool:
        if self._can_flush is None:
            row = conn.execute(self.q["can_flush_wal"]).fetchone()
            self._can_flush = bool(row and row[0])
            if not self._can_flush:
                logger.warning(
                    "pgq: this role may not run pg_logical_emit_message, so a durable "
                    "publish reaches consumers only once its WAL flush is done (about a "
                    "millisecond later); GRANT EXECUTE on it lets them have it at once"
                )
        return self._can_flush

    def publish_on(
        self,
        conn: psycopg.Connection[Any],
        queue: str,
        payload: dict[str, Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        publish_key: str | None = None,
        handoff: bool = False,
        deliver_unflushed: bool = False,
        flushes: bool = True,
    ) -> bool:
        """Insert a message on the caller's connection, inside the caller's transaction.

        For work that must commit together with its message (a barrier firing its
        callback): the message exists exactly when the transaction commits.

        ``handoff`` (a try, where :attr:`gate` finds one worth it) only where the
        statement is the whole transaction: a message handed to a consumer is leased
        from the moment of the insert, and a transaction that went on for longer than
        the lease would commit it visible to every other consumer as well.

        ``deliver_unflushed`` (with ``handoff``): a hand-off commits without waiting for
        its WAL flush, and this returns True when one did; the caller must then flush
        (the ``flush_wal`` query) before it calls the message published. Where the
        statement commits on its own on a session that prepares, the try commits
        unflushed only if it hands over, and its flush is sent with it
        (:meth:`_try_then_settle`): this returns False, nothing being left to flush.

        ``flushes``: whether a commit on ``conn`` waits for its WAL flush (False: a session
        of ``durable_publish`` off). Where it does and the statement commits on its own,
        a publish that tries no hand-off sends its wake-up as a transaction of its own
        (:meth:`_enqueue_then_wake`); where it does not, the wake-up stays inside the
        insert's transaction, which holds the NOTIFY lock only for a moment: one
        transaction costs the server less than two (measured: 1.15-1.23x the publish
        rate from 2 to 4 producers, docs/performance.md).
        """
        # In psycopg's pipeline (a caller batching its statements) results come later:
        # nothing could learn that a hand-off committed unflushed.
        batched = conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF
        text = json.dumps(payload)
        # A hand-off is tried for a message due now and small enough for a NOTIFY, on a
        # queue where tries have not lately been finding nobody waiting (gate.py).
        attempt = (
            handoff and delay <= 0 and _fits_notify(queue, text)
            and self.gate.worth_trying(queue)
        )
        params = {
            "queue": queue,
            "priority": priority,
            "delay": max(delay, 0.0),
            "publish_key": publish_key,
            "payload": text,
            "notify": delay <= 0,
            "handoff": attempt,
            "deliver_unflushed": attempt and deliver_unflushed and not batched,
            "settle_follows": False,
            **self._publish_to,
        }
        name = "publish" if attempt else "publish_plain"
        if batched:
            conn.execute(self.q[name], params)  # join the caller's batch
            return False
        # Prepared on sessions that prepare at all (none behind a transaction pooler).
        prepare = conn.prepare_threshold is not None
        apart = _sends_apart(conn)
        if apart and flushes and not attempt and params["notify"]:
            self._enqueue_then_wake(conn, params)
            return False
        if apart and params["deliver_unflushed"]:
            rows = self._try_then_settle(conn, params)
            flushed = True
        else:
            rows = self.wire[name].execute(conn, params, prepare=prepare)
            flushed = False
        if not attempt:
            return False
        if rows:  # none: the key was there already, and the try found out nothing
            self.gate.tried(queue, handed=rows[0][2] == b"t")
        return not flushed and any(row[1] == b"t" for row in rows)

    def _try_then_settle(
        self, conn: psycopg.Connection[Any], params: dict[str, Any]
    ) -> list[Row]:
        """A hand-off try, then the ``settle`` query, each a transaction of its own, sent
        at once: one round trip. A try that hands its message over commits unflushed and
        settle flushes (``flush_wal``'s work); one that finds nobody commits as the
        session says without waking anyone, and settle wakes the listeners: its durable
        commit then holds up no other publisher's (the ``wake`` query says why), as a
        plain publish's does. Returns the try's rows. Only where the role may flush:
        settle calls the function even where it has only to wake. Settle runs after a
        try that failed too, doing what the session's last try left (at worst a wake-up
        or a flush too many).

        The try's error is raised. After a try that found nobody, its message is on
        disk, and a failed settle is a failed wake-up, as in :meth:`_enqueue_then_wake`.
        After a hand-off, the publish is done once settle is: its error is raised (a
        session lost before settle's answer leaves the commit unknown on disk, and
        :meth:`_run_publish` sends a keyed publish again, flush included)."""
        tried, settled = self._with_settle(conn, self.wire["publish"], params)
        if settled is not None:
            if not tried or tried[0][2] == b"t":  # handed over, or inserted nothing
                raise settled
            self._wake_failed(conn, params, settled)
        return tried

    def _with_settle(
        self, conn: psycopg.Connection[Any], statement: Statement, params: dict[str, Any]
    ) -> tuple[list[Row], psycopg.Error | None]:
        """``statement`` with settle_follows set, then ``settle``, sent at once (see
        :meth:`_try_then_settle`): the statement's rows (its error is raised) and
        settle's error, if it failed."""
        published, settled = run_apart(
            conn,
            [(statement, {**params, "settle_follows": True}),
             (self.wire["settle"], {"channel": self.channel, "queue": params.get("queue")})],
            prepare=True,
        )
        if isinstance(published, psycopg.Error):
            raise published
        return published, settled if isinstance(settled, psycopg.Error) else None

    def _enqueue_then_wake(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
        """``publish_plain`` as two transactions sent at once: the insert, committed as
        the session says (durable by default), then the wake-up alone (the ``wake``
        query says why). A publisher's flush then holds up no other publisher.

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

    # -- consuming -----------------------------------------------------------
    def claim(
        self,
        queues: Sequence[str],
        vts: Sequence[float],
        limit: int,
        max_attempts: Sequence[int] | None = None,
        *,
        acks: Sequence[tuple[int, int]] = (),
    ) -> list[Claimed]:
        """Claim up to ``limit`` visible messages over ``queues``, best first.

        A message already delivered ``max_attempts`` times (per queue; unlimited
        when not given) is dead-lettered by the same statement and comes back with
        ``dead_letter_id`` set instead of being delivered. ``acks`` (id, read_ct)
        are acked by the same statement.

        Not retried: a claim whose result was lost is indistinguishable from a
        consumer that died, and the visibility timeout brings those rows back. The
        caller still owns ``acks`` when this raises.
        """
        if limit <= 0 or not queues:
            self.ack(acks)
            return []
        params = claim_params(queues, vts, limit, max_attempts, acks)

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self.q["claim"], params).fetchall()

        return _ordered(self.relaxed.run(work, idempotent=False))

    def pop(self, queues: Sequence[str], limit: int) -> list[Claimed]:
        """Take and delete up to ``limit`` visible messages: delivery without ack."""
        if limit <= 0 or not queues:
            return []
        params = {"queues": list(queues), "limit": limit}

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self.q["pop"], params).fetchall()

        return _ordered(self.relaxed.run(work, idempotent=False))

    def ack(self, tokens: Sequence[tuple[int, int]]) -> int:
        """Delete delivered messages by (id, read_ct); return how many were still ours."""
        return self._fenced("ack", tokens)

    def release(self, tokens: Sequence[tuple[int, int]]) -> int:
        """Make claimed messages visible now (requeue); return how many were still ours."""
        return self._fenced("release", tokens, channel=self.channel)

    def renew(self, tokens: Sequence[tuple[int, int, float]]) -> int:
        """Push the visibility timeout of held messages to now + vt."""
        if not tokens:
            return 0
        params = {
            "ids": [t[0] for t in tokens],
            "read_cts": [t[1] for t in tokens],
            "vts": [t[2] for t in tokens],
        }

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q["renew"], params).rowcount

        return self.relaxed.run(work, idempotent=True, fenced=True)

    def _fenced(self, name: str, tokens: Sequence[tuple[int, int]], **extra: Any) -> int:
        if not tokens:
            return 0
        params = {"ids": [t[0] for t in tokens], "read_cts": [t[1] for t in tokens], **extra}

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q[name], params).rowcount

        return self.relaxed.run(work, idempotent=True, fenced=True)

    def dead_letter(self, token: tuple[int, int], reason: str) -> int | None:
        """Move a claimed message to dead_letter; the dead-letter id, or None if not ours."""
        params = {"id": token[0], "read_ct": token[1], "reason": reason}

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
        """Record the task and identity recovered from a dead-lettered message."""
        self._command(
            "dead_letter_identify",
            {
                "id": dead_letter_id,
                "task_id": task_id,
                "task_name": task_name,
                "identity": Json(identity),
                "note": "".join(f"; {r}" for r in reasons),
            },
        )

    def record_hooks(self, dead_letter_id: int, hooks: list[dict[str, Any]]) -> None:
        self._command("dead_letter_hooks", {"id": dead_letter_id, "hooks": Json(hooks)})

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

    def declare_queue(
        self, queue: str, *, expires_ms: int | None = None, message_ttl_ms: int | None = None
    ) -> None:
        self._command(
            "declare_queue",
            {"queue": queue, "expires_ms": expires_ms, "message_ttl_ms": message_ttl_ms},
        )

    def has_queue(self, queue: str) -> bool:
        return bool(self._scalar("has_queue", {"queue": queue}))

    def delete_queue(self, queue: str) -> int:
        return self._command("delete_queue", {"queue": queue})


    # -- routing -------------------------------------------------------------
    def declare_exchange(self, exchange: str, type_: str) -> str:
        """Record an exchange; the type it has (an existing one keeps its own)."""
        return str(self._scalar("declare_exchange", {"exchange": exchange, "type": type_}))

    def exchange_type(self, exchange: str) -> str | None:
        found = self._scalar("exchange_type", {"exchange": exchange})
        return None if found is None else str(found)

    def delete_exchange(self, exchange: str) -> None:
        self._command("delete_exchange", {"exchange": exchange})

    def bind(self, exchange: str, queue: str, routing_key: str, pattern: str) -> bool:
        """Bind; False when the exchange was never declared (nothing is bound)."""
        params = {"exchange": exchange, "queue": queue, "routing_key": routing_key,
                  "pattern": pattern}
        return bool(self._scalar("bind", params))

    def unbind(self, exchange: str, queue: str, routing_key: str) -> None:
        self._command("unbind", {"exchange": exchange, "queue": queue,
                                 "routing_key": routing_key})

    def list_bindings(self) -> list[tuple[str, str, str]]:
        def work(conn: psycopg.Connection[Any]) -> list[tuple[str, str, str]]:
            return [tuple(r) for r in conn.execute(self.q["list_bindings"]).fetchall()]

        return self.connector.run(work, idempotent=True)

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
        matched. With a ``publish_tag`` a repeated call inserts nothing new. A copy
        handed to a waiting consumer reaches it before its WAL flush, as in
        :meth:`publish`.
        """
        text = json.dumps(payload)
        open_batch = batching.current()
        params = {
            "exchange": exchange,
            "routing_key": routing_key,
            "priority": priority,
            "delay": max(delay, 0.0),
            "ttl": ttl,
            "publish_tag": publish_tag,
            "payload": text,
            "notify": delay <= 0,
            # Queue names are known only once routed: the statement checks each one.
            "handoff": delay <= 0 and open_batch is None,
            "handoff_room": _notify_room(text),
            **self._publish_to,
        }
        if open_batch is not None:  # in the batch's transaction: no hand-off, no settle

            def routed_in(conn: psycopg.Connection[Any]) -> tuple[str | None, int]:
                routed = {**params, "deliver_unflushed": False, "settle_follows": False}
                row = conn.execute(self.q["publish_routed"], routed).fetchone()
                assert row is not None
                return row[0], int(row[1] or 0)

            found: tuple[str | None, int] = open_batch.run(
                self._batch_key(), self.publisher, routed_in
            )
            return found

        route = (exchange, routing_key)

        def statement(
            conn: psycopg.Connection[Any], unflushed: bool
        ) -> tuple[tuple[str | None, int], bool]:
            routed = {**params, "deliver_unflushed": unflushed, "settle_follows": False}
            prepare = conn.prepare_threshold is not None
            # Settle is sent along where the statement may wake or hand over: not for a
            # route that matched no queue last time (events nobody monitors, say), which
            # would only pay for it. A binding made since costs one publish its NOTIFY
            # inside its commit, as every routed publish did before settle.
            if (unflushed and params["notify"] and _sends_apart(conn)
                    and route not in self._unrouted):
                [row], settled = self._with_settle(conn, self.wire["publish_routed"], routed)
                if settled is not None:  # (a hand-off's flush, or every wake-up)
                    raise settled
                flushed = True
            else:
                [row] = self.wire["publish_routed"].execute(conn, routed, prepare=prepare)
                flushed = False
            type_, matched = (None if row[0] is None else row[0].decode()), int(row[1] or 0)
            if matched:
                self._unrouted.discard(route)
            else:
                if len(self._unrouted) >= _MAX_ROUTES:
                    self._unrouted.clear()
                self._unrouted.add(route)
            return (type_, matched), not flushed and row[3] == b"t"

        return self._run_publish(statement, idempotent=publish_tag is not None)

    def dead_letter_unroutable(
        self, queue: str, payload: dict[str, Any], *, priority: int, reason: str
    ) -> int:
        params = {"queue": queue, "payload": Json(payload), "priority": priority,
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

    def maintain(self, queues: Sequence[str]) -> tuple[int, int]:
        """Touch ``queues``; reap expired queues and messages. (queues, messages) reaped."""

        def work(conn: psycopg.Connection[Any]) -> tuple[int, int]:
            with conn.transaction():
                params = {"queues": list(queues), "lock_space": self.lock_space}
                row = conn.execute(self.q["maintain"], params).fetchone()
                gone, expired = (list(row[0]), int(row[1])) if row else ([], 0)
                if gone:
                    conn.execute(self.q["drop_messages"], {"queues": gone})
            return len(gone), expired

        # On a session that plans for the values it gets (see drop_messages).
        return self.connector.run(work, idempotent=True)


@dataclass(frozen=True)
class Waiting:
    """How a claim registers its consumer as waiting (see the ``claim`` query).

    ``queues``/``vts``: where to wait if the claim comes back empty (sent only while
    the consumer waits nowhere); ``unwait``: stop waiting if it brings messages."""

    token: int
    queues: Sequence[str] = ()
    vts: Sequence[float] = ()
    unwait: bool = False


def claim_params(
    queues: Sequence[str],
    vts: Sequence[float],
    limit: int,
    max_attempts: Sequence[int] | None,
    acks: Sequence[tuple[int, int]],
    waiting: Waiting | None = None,
) -> dict[str, Any]:
    """Parameters of the ``claim`` query."""
    attempts = list(max_attempts) if max_attempts is not None else [2**31 - 1] * len(queues)
    return {
        "queues": list(queues), "vts": list(vts), "max_attempts": attempts, "limit": limit,
        "ack_ids": [t[0] for t in acks], "ack_read_cts": [t[1] for t in acks],
        "waiter": waiting.token if waiting else None,
        "wait_queues": list(waiting.queues) if waiting else [],
        "wait_vts": list(waiting.vts) if waiting else [],
        "unwait": waiting.unwait if waiting else False,
    }


def _notify_room(text: str) -> int:
    """Bytes left in a NOTIFY for the queue name (JSON-escaped, up to 6 bytes a byte)
    once a message with this JSON text is in it (ASCII: json.dumps escapes the rest)."""
    return HANDOFF_LIMIT - _HANDOFF_FRAME - len(text)


def _sends_apart(conn: psycopg.Connection[Any]) -> bool:
    """Whether statements on ``conn`` may be sent as transactions of their own, several
    at once (:func:`~pg_transport.wire.run_apart`): the session prepares (it is its own,
    not a transaction pooler's) and no transaction is open on it."""
    return (
        conn.prepare_threshold is not None
        and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    )


def _fits_notify(queue: str, text: str) -> bool:
    """Whether a message with this JSON text can be handed over to ``queue``."""
    return 6 * len(queue.encode("utf-8")) <= _notify_room(text)


def decode_claimed(row: Sequence[bytes | None]) -> Claimed:
    """A claim or pop row as libpq's text values (statements sent without psycopg)."""
    ident, queue, priority, read_ct, payload, dead = row[:6]
    assert ident is not None and queue is not None and payload is not None
    assert priority is not None and read_ct is not None
    return Claimed(
        int(ident), queue.decode(), int(priority), int(read_ct), json.loads(payload),
        None if dead is None else int(dead),
    )


def unwaited(rows: Sequence[Sequence[bytes | None]]) -> int:
    """How many waiting rows a claim that brought ``rows`` deleted (its last column)."""
    if not rows or len(rows[0]) < 7 or rows[0][6] is None:
        return 0
    return int(rows[0][6])


def decode_handed(text: str) -> Claimed:
    """A message handed over in a NOTIFY: ``[id, queue, priority, payload]`` as JSON,
    leased on its first delivery."""
    ident, queue, priority, payload = json.loads(text)
    return Claimed(int(ident), str(queue), int(priority), 1, payload)


def _ordered(rows: Sequence[Any]) -> list[Claimed]:
    """Rows of a claim or pop, which the statement returns in delivery order."""
    return [Claimed(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]
