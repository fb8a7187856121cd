"""Every SQL operation on the queue tables but publishing, behind one narrow class.

No kombu in here: the store speaks of queues, payloads, ids and leases. It claims, pops,
acks, releases, renews and dead-letters (the consumer's statements), declares queues,
exchanges and bindings, and counts and purges; publishing is the
:class:`~pg_transport.publish.publisher.Publisher`'s, which whoever composes the two (the
transport) builds beside it. Statements that are safe to repeat (ack,
release, renew, dead-lettering) are retried on a fresh connection after a
dead-connection error (ack, release and renew through an outage as long as a failover:
see :func:`~pg_transport.db.retry.fenced`). An ack or renewal the fencing refused is
reported (:mod:`pg_transport.fencing`).

A delivered message's fencing token is its :class:`~pg_transport.message.rows.Lease`: the row
id, the grant it was delivered under (the ``lease`` column, bumped by every claim and
every release) and its queue. Ack, release, renew and dead-lettering touch the row only
under that token, so a holder whose lease lapsed (the message was claimed again) or whose
message was released can touch it no more.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import psycopg
from psycopg.types.json import Json

from pg_transport import fencing
from pg_transport.config import DEFAULT_FOLLOWS_RETENTION
from pg_transport.db.pool import Connector
from pg_transport.db.retry import FENCED_RETRY_SECONDS, fenced
from pg_transport.db.wire import Row, Statement
from pg_transport.errors import NotPermitted
from pg_transport.message.limits import Limit
from pg_transport.message.rows import (
    DEFAULT_MAX_MESSAGE_BYTES,
    FEATURED,
    LIMITS,
    MARKERS,
    Claimed,
    Lease,
    decode_claimed,
    row_to_claimed,
    storable,
    text,
)
from pg_transport.sql import channel_prefix, load_queries, queue_channel

logger = logging.getLogger("pg_transport.store")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Claimed",
    "Lease",
    "Store",
    "claim_featured",
    "claim_limits",
    "claim_params",
    "decode_claimed",
    "read_claim",
]

# Unlimited attempts, where a caller gives no max_attempts (read_ct is an integer).
_NO_LIMIT = 2**31 - 1
# Claims one call of Store.claim may send while its answers hold ordered messages back
# (each parked one is never read again; one whose predecessor is being removed is).
HELD_RECLAIMS = 8


class Store:
    """SQL on one schema of one database."""

    def __init__(
        self,
        connector: Connector,
        schema: str,
        *,
        relaxed: Connector | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        follows_retention: float = DEFAULT_FOLLOWS_RETENTION,
        fenced_window: float = FENCED_RETRY_SECONDS,
    ) -> None:
        """``relaxed`` (optional) runs claim, ack, release and renew: statements whose
        commit may be lost in a server crash at the price of a redelivery, never of a
        message (see the ``relax_commit`` query). ``max_message_bytes`` bounds the payload
        a claim brings at once; ``follows_retention`` is how long housekeeping keeps the
        end of a followed task (docs/ordering.md).
        ``fenced_window``: how long an ack, release or renewal keeps trying through an
        outage (docs/high-availability.md)."""
        self.connector = connector
        self.fenced_window = fenced_window
        self.relaxed = relaxed or connector
        self.max_message_bytes = max_message_bytes
        self.follows_retention = follows_retention
        self.schema = schema
        self.channel_prefix = channel_prefix(schema)
        self.q = load_queries(schema)
        # The claim, run once per few messages, goes through libpq directly (wire.py).
        self.claim_statement = Statement("claim", self.q["claim"])
        #: The claim of the plain case (lean_claim): no gates, no hand-off; sent unless
        #: the last answer said the claim met a featured message.
        self.lean_claim_statement = Statement("lean_claim", self.q["lean_claim"])
        #: The claim of a consumer of a fair queue (fair_claim in queries.sql).
        self.fair_claim_statement = Statement("fair_claim", self.q["fair_claim"])
        #: The claim with the flow gates (flow_claim), sent while flow limits exist.
        self.flow_claim_statement = Statement("flow_claim", self.q["flow_claim"])
        #: Whether the last claim's answer said a flow limit exists: the next claim is
        #: then flow_claim (a plain claim's answer saying so picked nothing).
        self.flow = False
        #: Whether the last claim's answer said it met a message the gates judge (an
        #: ordering key, a follows link): the next claim is then claim, else lean_claim.
        self.featured = False

    @property
    def fenced_window(self) -> float:
        """Seconds an ack, release or renewal keeps trying through an outage."""
        return self._fenced_window

    @fenced_window.setter
    def fenced_window(self, seconds: float) -> None:
        self._fenced_window = seconds
        self._fenced_policy = fenced(seconds)

    def channel(self, queue: str) -> str:
        """The wake-up channel of ``queue``."""
        return queue_channel(self.schema, queue)

    # -- consuming -----------------------------------------------------------
    def claim(
        self,
        queues: Sequence[str],
        vts: Sequence[float],
        limit: int,
        max_attempts: Sequence[int] | None = None,
        *,
        acks: Sequence[Lease] = (),
        per_queue: int | None = None,
        fair: bool = False,
    ) -> list[Claimed]:
        """Claim up to ``limit`` visible messages over ``queues``, best first (at most
        ``per_queue`` of each queue and priority; default ``limit``).

        A message already delivered ``max_attempts`` times (per queue; unlimited when not
        given), larger than ``max_message_bytes`` or not a JSON object is dead-lettered by
        the same statement and comes back with ``dead_letter_id`` set instead of being
        delivered. ``acks`` are acked by the same statement. ``fair``: some of ``queues``
        may be fair (claimed round-robin over their fair keys: the ``fair_claim``
        statement); a fair queue claimed without it is claimed as any other.

        Not retried when its result was lost: that is indistinguishable from a
        consumer that died, and the visibility timeout brings those rows back. Tried
        again when the server rolled it back whole (a deadlock with an ack): nothing
        was claimed or acked then. The caller still owns ``acks`` when this raises.
        """
        if limit <= 0 or not queues:
            self.ack(acks)
            return []
        found: list[Claimed] = []
        for _ in range(HELD_RECLAIMS):
            params = claim_params(
                queues,
                vts,
                limit - len(found),
                max_attempts,
                acks,
                max_bytes=self.max_message_bytes,
                per_queue=per_queue,
            )

            if fair:
                statement = self.fair_claim_statement
            elif self.flow:
                statement = self.flow_claim_statement
            else:
                statement = self.claim_statement if self.featured else self.lean_claim_statement

            def work(
                conn: psycopg.Connection[Any],
                params: dict[str, Any] = params,
                statement: Statement = statement,
            ) -> list[Row]:
                prepare = conn.prepare_threshold is not None
                return statement.execute(conn, params, prepare=prepare)

            rows = self.relaxed.run(work, idempotent=False, statement=True)
            batch = read_claim(acks, rows)
            acks = ()
            plain = statement is self.claim_statement or statement is self.lean_claim_statement
            self.flow = claim_limits(rows)
            if rows:  # (an empty answer met nothing: it says nothing either way)
                self.featured = claim_featured(rows)
            if plain and self.flow:
                continue  # a flow limit exists: it picked nothing; flow_claim now
            delivered = [c for c in batch if not c.held]
            found += delivered
            # Rows held back (ordering; by lean_claim, whatever the gates judge) took
            # room: what is behind them is claimed too (by claim, after lean_claim, which
            # also takes the key's next that an ack it carried promoted).
            lean = statement is self.lean_claim_statement and self.featured
            if len(found) >= limit or (len(delivered) == len(batch) and not lean):
                break
        return found

    def pop(self, queues: Sequence[str], limit: int) -> list[Claimed]:
        """Take and delete up to ``limit`` visible messages: delivery without ack.
        Rows that cannot be delivered are dead-lettered by the same statement."""
        if limit <= 0 or not queues:
            return []
        params = {
            "queues": list(queues),
            "limit": limit,
            "max_bytes": self.max_message_bytes,
            "max_message_bytes": self.max_message_bytes,
        }

        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self.q["pop"], params).fetchall()

        return [row_to_claimed(*row) for row in self.relaxed.run(work, idempotent=False)]

    def keep_popped(self, claimed: Claimed, reason: str) -> int:
        """Keep in dead_letter a popped message (gone from its queue already) that could
        not be decoded, from its text; the dead-letter id."""
        return int(
            self._scalar(
                "dead_letter_unroutable",
                {
                    "queue": claimed.queue,
                    "payload": claimed.raw or "null",
                    "priority": claimed.priority,
                    "reason": text(reason),
                },
                idempotent=False,
            )
        )

    def ack(self, tokens: Sequence[Lease]) -> int:
        """Delete delivered messages still held under ``tokens``; how many were. Those
        no longer held (the fencing refused their ack) are reported."""
        landed = self._fenced("ack", tokens)
        fencing.refused("ack", fencing.refused_of(tokens, landed))
        return len(landed)

    def release(self, tokens: Sequence[Lease], *, failed: bool = False) -> int:
        """Make held messages visible now (requeue); how many were still held. ``failed``
        (a reject with requeue): in a relaxed queue, a message of an ordering key goes to
        the back of its key."""
        params = {
            **_lease_params(tokens),
            "channel_prefix": self.channel_prefix,
            "failed": failed,
        }
        if not tokens:
            return 0

        def work(conn: psycopg.Connection[Any]) -> int:
            return conn.execute(self.q["release"], params).rowcount

        return self.relaxed.run(work, idempotent=True, retry=self._fenced_policy)

    def settle(self, tokens: Sequence[Lease]) -> list[int]:
        """The worker's ack of atomic deliveries: release those their task's transaction
        did not complete (still held, not being committed right now); the ids released.
        One already gone was completed by its commit: not a refusal, nothing reported."""
        if not tokens:
            return []
        params = {**_lease_params(tokens), "channel_prefix": self.channel_prefix}

        def work(conn: psycopg.Connection[Any]) -> list[int]:
            return [row[0] for row in conn.execute(self.q["settle"], params).fetchall()]

        return self.relaxed.run(work, idempotent=True, retry=self._fenced_policy)

    def renew(self, held: Sequence[tuple[Lease, float]]) -> int:
        """Push the visibility timeout of held messages to now + their vt; how many were
        still held. The leases the fencing refused (lapsed: the message was delivered
        again) are reported."""
        return len(held) - len(self.renew_lost(held))

    def renew_lost(
        self,
        held: Sequence[tuple[Lease, float]],
        still_held: Callable[[list[Lease]], list[Lease]] | None = None,
        *,
        expected: Collection[int] = (),
    ) -> list[Lease]:
        """Renew ``held`` (as :meth:`renew`); the leases the fencing refused (reported).
        ``still_held``, asked once the statement is done, keeps of the refused leases
        those the caller still holds: one it let go meanwhile (acked, released: its row
        gone or changed by its own hand) was not lost to another consumer, and is
        neither reported nor returned (its ack or release reports its own refusal).
        Row ids ``expected`` to be gone (atomic tasks' deliveries, which their own commit
        ends before the worker's ack) are returned but not reported."""
        if not held:
            return []
        tokens = [t for t, _ in held]
        params = {**_lease_params(tokens), "vts": [vt for _, vt in held]}

        def work(conn: psycopg.Connection[Any]) -> list[int]:
            return [row[0] for row in conn.execute(self.q["renew"], params).fetchall()]

        landed = self.relaxed.run(work, idempotent=True, retry=self._fenced_policy)
        lost = fencing.refused_of(tokens, landed)
        if lost and still_held is not None:
            lost = still_held(lost)
        fencing.refused("renewal", [t for t in lost if t.id not in expected])
        return lost

    def _fenced(self, name: str, tokens: Sequence[Lease]) -> list[int]:
        """Run the fenced statement ``name`` (RETURNING the ids it touched) on ``tokens``."""
        if not tokens:
            return []
        params = _lease_params(tokens)

        def work(conn: psycopg.Connection[Any]) -> list[int]:
            return [row[0] for row in conn.execute(self.q[name], params).fetchall()]

        return self.relaxed.run(work, idempotent=True, retry=self._fenced_policy)

    def dead_letter(self, token: Lease, reason: str) -> int | None:
        """Move a held message to dead_letter; the dead-letter id, or None if not held."""
        params = {
            "id": token.id,
            "lease": token.lease,
            "queue": token.queue,
            "reason": text(reason),
        }

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
                "task_id": None if task_id is None else text(task_id),
                "task_name": None if task_name is None else text(task_name),
                "identity": Json(storable(identity)),
                "note": text("".join(f"; {r}" for r in reasons)),
            },
        )

    def dead_letter_envelope(self, dead_letter_id: int) -> dict[str, Any]:
        """The headers, properties and content type of a dead-lettered message (its body
        is not read: it may be what made the message too large to deliver)."""
        found = self._scalar("dead_letter_envelope", {"id": dead_letter_id})
        try:
            value = json.loads(found) if isinstance(found, str) else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

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
        self,
        queue: str,
        *,
        expires_ms: int | None = None,
        message_ttl_ms: int | None = None,
        ordering: str | None = None,
        fair: bool | None = None,
    ) -> None:
        """Record a declared queue. ``ordering`` (strict or relaxed) is what a failure
        does to the rest of an ordering key there; ``fair``, whether it is claimed
        round-robin over its messages' fair keys (its messages already there join the
        key ''); None keeps what is recorded."""
        self._declaring(
            f"queue {queue!r}",
            "declare_queue",
            {
                "queue": queue,
                "expires_ms": expires_ms,
                "message_ttl_ms": message_ttl_ms,
                "ordering": ordering,
                "fair": fair,
            },
        )
        if fair:
            self._declaring(f"queue {queue!r}", "fair_adopt", {"queue": queue})

    def queue_limit(self, queue: str) -> str | None:
        """The name of ``queue``'s own flow limit (``queue:<name>``), or None."""
        found = self._scalar("queue_limit", {"queue": queue})
        return None if found is None else str(found)

    def has_queue(self, queue: str) -> bool:
        return bool(self._scalar("has_queue", {"queue": queue}))

    def delete_queue(self, queue: str) -> int:
        return self._command("delete_queue", {"queue": queue})

    # -- routing -------------------------------------------------------------
    def declare_exchange(self, exchange: str, type_: str) -> str:
        """Record an exchange; the type it has (an existing one keeps its own)."""
        return str(
            self._declaring(
                f"exchange {exchange!r}", "declare_exchange", {"exchange": exchange, "type": type_}
            )
        )

    def exchange_type(self, exchange: str) -> str | None:
        found = self._scalar("exchange_type", {"exchange": exchange})
        return None if found is None else str(found)

    def delete_exchange(self, exchange: str) -> None:
        self._command("delete_exchange", {"exchange": exchange})

    def bind(self, exchange: str, queue: str, routing_key: str, pattern: str) -> bool:
        """Bind; False when the exchange was never declared (nothing is bound)."""
        params = {
            "exchange": exchange,
            "queue": queue,
            "routing_key": routing_key,
            "pattern": pattern,
        }
        return bool(
            self._declaring(f"a binding of queue {queue!r} to {exchange!r}", "bind", params)
        )

    def unbind(self, exchange: str, queue: str, routing_key: str) -> None:
        self._command("unbind", {"exchange": exchange, "queue": queue, "routing_key": routing_key})

    def list_bindings(self) -> list[tuple[str, str, str]]:
        def work(conn: psycopg.Connection[Any]) -> list[tuple[str, str, str]]:
            return [tuple(r) for r in conn.execute(self.q["list_bindings"]).fetchall()]

        return self.connector.run(work, idempotent=True)

    def define_limits(self, limits: Sequence[Limit]) -> None:
        """Write the flow limits configuration defines (origin config); one a command
        set is kept (docs/flow-control.md)."""
        if not limits:
            return
        params = {
            "names": [lim.name for lim in limits],
            "rate_counts": [lim.rate.count if lim.rate else None for lim in limits],
            "rate_periods": [lim.rate.period if lim.rate else None for lim in limits],
            "bursts": [lim.burst for lim in limits],
            "concurrencies": [lim.concurrency for lim in limits],
        }
        self._command("define_limits", params)

    def maintain(self, queues: Sequence[str]) -> tuple[int, int]:
        """Touch ``queues``; reap expired queues and messages. (queues, messages) reaped."""

        def work(conn: psycopg.Connection[Any]) -> tuple[int, int]:
            with conn.transaction():
                row = conn.execute(
                    self.q["maintain"],
                    {"queues": list(queues), "follows_retention": self.follows_retention},
                ).fetchone()
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
    per_queue: int | None = None,
    relax: str | None = None,
) -> dict[str, Any]:
    """Parameters of the ``claim`` query: up to ``limit`` messages in all, and up to
    ``per_queue`` (default ``limit``) candidates of each queue and priority. ``relax``:
    how a claim behind a transaction pooler commits ('off', 'auto': ``durable_acks``);
    None leaves it to the session."""
    attempts = list(max_attempts) if max_attempts is not None else [_NO_LIMIT] * len(queues)
    return {
        "queues": list(queues),
        "vts": list(vts),
        "max_attempts": attempts,
        "limit": limit,
        "per_queue": limit if per_queue is None else min(max(per_queue, 1), limit),
        "ack_ids": [t.id for t in acks],
        "ack_leases": [t.lease for t in acks],
        "ack_queues": [t.queue for t in acks],
        "max_bytes": max_bytes,
        "max_message_bytes": max_bytes,
        "relax": relax,
    }


def read_claim(acks: Sequence[Lease], rows: Sequence[Row]) -> list[Claimed]:
    """A claim's answer (or a pop's) as its driver takes it, the engine's or
    :meth:`Store.claim`: the rows decoded, in the statement's order; the acks it carried
    that the fencing refused reported and left out; rows held back (ordering) kept, for
    they took room (a claim they filled is not short)."""
    batch = [decode_claimed(row) for row in rows]
    while batch and batch[-1].note in MARKERS:
        batch.pop()
    if not acks:
        return batch
    refused = {c.id for c in batch if c.refused}
    if refused:
        fencing.refused("ack", [t for t in acks if t.id in refused])
    return [c for c in batch if not c.refused]


def _markers(rows: Sequence[Row]) -> set[bytes]:
    """The notes of the rows at the end of a claim's answer that are no message."""
    found: set[bytes] = set()
    for row in reversed(rows):
        note = row[8] if len(row) > 8 else None
        if note is None or note.decode("utf-8", "replace") not in MARKERS:
            break
        found.add(note)
    return found


def claim_limits(rows: Sequence[Row]) -> bool:
    """Whether a claim's answer (its rows as they came) ends with the row that says a
    flow limit exists (claim_limits in queries.sql): the next claim is then flow_claim;
    without it, the plain claim."""
    return LIMITS.encode() in _markers(rows)


def claim_featured(rows: Sequence[Row]) -> bool:
    """Whether a claim's answer ends with the row that says it met a message the gates
    judge (claim_featured in queries.sql): the next claim is then claim; without it,
    lean_claim."""
    return FEATURED.encode() in _markers(rows)


def _lease_params(tokens: Sequence[Lease]) -> dict[str, Any]:
    return {
        "ids": [t.id for t in tokens],
        "leases": [t.lease for t in tokens],
        "queues": [t.queue for t in tokens],
    }
