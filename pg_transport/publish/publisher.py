"""Publishing: one publisher, choosing how to send each message from a table of ways.

A publish is an INSERT keyed by the message's publish key (a retry after an ambiguous
commit inserts nothing twice) and a wake-up of its queue's consumers (a NOTIFY with no
payload on the queue's channel). How they go depends on where the statement runs
(:func:`way_of` picks one of :data:`WAYS`):

- ``batched``: on a session of pgq's own in psycopg's pipeline mode (a barrier arming
  its parts, :func:`pg_transport.fanin.state.arm`): one statement, joining the
  pipeline's transaction; its commit sends the wake-ups. (The messages of
  ``pg_transport.batch()`` do not come this way: the batch keeps them and writes them
  with ``publish_many``, :meth:`Publisher._insert_rows`.)
- ``apart``: on a session of pgq's own, idle, whose commits wait for their WAL flush
  (``durable_publish``): the insert and the wake-up as two transactions sent at once, so
  the durable commit holds no NOTIFY lock through its flush and no consumer is woken for
  a message not on disk yet.
- ``together``: anywhere else on a session of pgq's own (a transaction open on it,
  ``durable_publish`` off, a transaction pooler): one statement, insert and NOTIFY in
  one transaction.
- ``joined``: on an application's connection (``pg_transport.transaction()``,
  :mod:`~pg_transport.publish.joined`): one statement in the application's transaction,
  not prepared, through a cursor of pgq's own; the application's commit sends the
  wake-up, its rollback takes the message back.

Inside an application's transaction a publish goes there before anything else (a
``batch()`` open around or inside it adds nothing: that transaction is already one
commit).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row

from pg_transport.db.pool import Connector, is_own
from pg_transport.db.wire import Statement, run_apart
from pg_transport.errors import (
    DuplicateTask,
    InvalidMessage,
    MessageTooLarge,
    NotPermitted,
    UniqueBusy,
)
from pg_transport.message import fair, limits, ordering, unique
from pg_transport.message.rows import DEFAULT_MAX_MESSAGE_BYTES
from pg_transport.publish import batching, joined
from pg_transport.publish.callers import Caller
from pg_transport.sql import channel_prefix, load_queries, queue_channel

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "WAYS", "Publisher", "way_of"]

T = TypeVar("T")

logger = logging.getLogger("pg_transport.publish")

#: The triggers that keep the publisher's boundary: their refusals name them.
BOUNDARY = frozenset({"message_admit", "dead_letter_admit"})

#: The parameters of ``publish_many``: each an array, one element a message.
MANY_COLUMNS = (
    "queue",
    "priority",
    "delay",
    "publish_key",
    "payload",
    "ttl",
    "okey",
    "task_id",
    "follows",
    "follow_wait",
    "followable",
    "channel",
    "fkey",
)

#: Those of them that are float8 arrays.
FLOAT_COLUMNS = frozenset({"delay", "ttl", "follow_wait"})

#: Times a unique publish is sent when its key's holder left between the conflict and
#: the look-up of who held it (each time another publish took the key and left again).
UNIQUE_ATTEMPTS = 3


class Publisher:
    """Publishes to one schema through one connector (``flushes``: whether its commits
    wait for their WAL flush, as ``durable_publish`` makes them)."""

    def __init__(
        self,
        connector: Connector,
        schema: str,
        *,
        flushes: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        follows_timeout: float = ordering.DEFAULT_FOLLOWS_TIMEOUT,
        unique_wait: float = unique.DEFAULT_UNIQUE_WAIT,
    ) -> None:
        self.connector = connector
        #: Seconds a unique publish waits for an open transaction holding its key.
        self.unique_wait = unique_wait
        self.schema = schema
        self.flushes = flushes
        self.max_message_bytes = max_message_bytes
        #: Seconds a follower waits for its predecessor unless it says (follows_timeout).
        self.follows_timeout = follows_timeout
        self.channel_prefix = channel_prefix(schema)
        self.q = load_queries(schema)
        # The statements run once per message go through libpq directly (wire.py).
        self.wire = {
            name: Statement(name, self.q[name])
            for name in ("publish_plain", "enqueue", "wake", "publish_routed", "wake_routed")
        }

    def channel(self, queue: str) -> str:
        """The wake-up channel of ``queue``."""
        return queue_channel(self.schema, queue)

    def encode(self, payload: dict[str, Any]) -> str:
        """The JSON text stored for ``payload``; :class:`MessageTooLarge` past the limit."""
        try:
            # ASCII only: its length is its size in bytes. No NaN or infinity: Python
            # writes them, and Postgres' json refuses them.
            text = json.dumps(payload, allow_nan=False)
        except ValueError:
            raise InvalidMessage(
                f"message field {_non_finite(payload)} is not a finite number: JSON holds no "
                "NaN or infinity; the message was not published"
            ) from None
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
        ttl: float | None = None,
    ) -> None:
        """Insert a message and wake its queue's consumers once it is committed. With a
        ``publish_key`` a repeated call inserts nothing. It expires after ``ttl``
        seconds or its queue's message TTL, whichever is shorter (neither: never).
        Inside a batch (:mod:`~pg_transport.batching`) it joins the batch's transaction
        instead; inside the application's (:mod:`~pg_transport.publish.joined`), that
        one."""
        params = self._publish_params(queue, payload, priority, delay, publish_key, ttl)
        if params["ukey"] is not None:
            self._publish_unique(params, payload)
            return
        open_batch = batching.current()
        if open_batch is not None and joined.current() is None:
            # kept, and written with the batch's other messages by one statement
            open_batch.add(self._batch_key(), self.connector, self._insert_rows, params)
            return
        self._dispatch(
            lambda conn: self._insert_on(conn, params),
            idempotent=publish_key is not None,
            payload=payload,
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
        self._insert_on(
            conn, self._publish_params(queue, payload, priority, delay, publish_key, None)
        )

    def in_batch(self, op: batching.Op) -> Any:
        """Run ``op`` in the open batch's transaction on this publisher's database: the
        one the publishes of the batch join. For work that must commit exactly when its
        messages do (a periodic task's slot taken in the transaction that sends it)."""
        open_batch = batching.current()
        if open_batch is None:
            raise RuntimeError("no pgq batch is open in this context")
        return open_batch.run(self._batch_key(), self.connector, op)

    def _publish_params(
        self,
        queue: str,
        payload: dict[str, Any],
        priority: int,
        delay: float,
        publish_key: str | None,
        ttl: float | None,
    ) -> dict[str, Any]:
        # First: a header it cannot honour is refused naming it, before encoding fails on
        # a value JSON cannot hold.
        place = ordering.placement(payload, self.follows_timeout)
        ordering.check_hold(place, max(delay, 0.0))
        limits.check_headers(payload)
        return {
            **place.params(),
            **self._unique_params(payload, place),
            "fkey": fair.fair_key(payload),
            "queue": queue,
            "priority": priority,
            "delay": max(delay, 0.0),
            "publish_key": publish_key,
            "ttl": ttl,
            "payload": self.encode(payload),
            "channel": self.channel(queue),
        }

    def _unique_params(self, payload: dict[str, Any], place: ordering.Placement) -> dict[str, Any]:
        """The unique headers of ``payload`` as the publish's values: the key, whether it
        is held while running, and the task id the holder look-up compares (kept on the
        row of a unique message, as on an ordered one)."""
        wants = unique.uniqueness(payload)
        if wants.key is None:
            return {"ukey": None, "urun": False, "unique_wait": None}
        task_id = place.task_id if place.task_id is not None else unique.task_id_of(payload)
        return {
            **wants.params(),
            "task_id": task_id,
            "unique_conflict": wants.conflict,
            "unique_wait": f"{max(self.unique_wait, 0.001) * 1000:.0f}ms",
        }

    def _publish_unique(self, params: dict[str, Any], payload: dict[str, Any]) -> None:
        """Publish a message with a unique key, in whatever transaction this thread's
        publishes go (an application's, a batch's, or one of its own): inserted unless a
        message holding its key is there. A duplicate publishes nothing; with
        ``unique_conflict="raise"`` it raises :class:`DuplicateTask` naming the holder."""

        def insert(conn: psycopg.Connection[Any]) -> tuple[int, str | None]:
            with self._permitted(conn), self._waits(params):
                row = _fetch_one(conn, self.q["publish_unique"], params)
            assert row is not None
            self._restore_wait(conn, row[3])
            return int(row[0]), row[2]

        for _ in range(UNIQUE_ATTEMPTS):
            inserted, holder = self._dispatch(insert, idempotent=True)
            if inserted:
                joined.note_published(payload)
                return
            if self._settled(params, holder):
                return
        raise UniqueBusy(
            f"unique key {params['ukey'][:80]!r} of queue {params['queue']!r} changed hands "
            f"{UNIQUE_ATTEMPTS} times while it was published; nothing was published"
        )

    def _settled(self, params: dict[str, Any], holder: str | None) -> bool:
        """A unique publish inserted nothing: True when that is its answer (this very
        publish sent again, or a duplicate, which raises if it asked to), False when no
        one holds the key any more and it is to be sent again."""
        if holder is None:
            return False
        if holder and holder == params["task_id"]:
            return True  # this publish, sent again: its message is there
        logger.info(
            "pgq: task %s not published to queue %r: unique key %r is held by task %s",
            params["task_id"],
            params["queue"],
            params["ukey"][:80],
            holder or "(no task id)",
        )
        if params["unique_conflict"] == "raise":
            raise DuplicateTask(
                f"unique key {params['ukey'][:80]!r} is held by task {holder or '(no id)'} "
                f"in queue {params['queue']!r}; nothing was published",
                key=params["ukey"],
                existing_id=holder,
            )
        # The caller's AsyncResult (Celery picked its id) resolves to the holder's.
        if holder and params["task_id"]:
            unique.note_holder(params["task_id"], holder)
        return True

    @contextmanager
    def _waits(self, params: dict[str, Any]) -> Iterator[None]:
        """A unique publish that waited ``unique_wait`` for a transaction inserting its
        key raises :class:`UniqueBusy`."""
        try:
            yield
        except psycopg.errors.LockNotAvailable as exc:
            raise UniqueBusy(
                f"unique key {params['ukey'][:80]!r}: a transaction that published the same "
                f"key has not ended after unique_wait ({self.unique_wait:g} s); nothing was "
                "published (an application's transaction left open shows in "
                "pg_stat_activity as 'idle in transaction')"
            ) from exc

    def _restore_wait(self, conn: psycopg.Connection[Any], before: str | None) -> None:
        """Put back a caller's lock_timeout, which the unique publish set for its
        transaction (on a session of pgq's own outside a transaction block, it ended
        with the statement)."""
        if before is None or (
            is_own(conn)
            and conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
            and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
        ):
            return
        _fetch_one(conn, self.q["lock_timeout_restore"], {"lock_timeout": before})

    def _insert_on(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
        """Run a publish on ``conn``, the way :func:`way_of` picks for it."""
        with self._permitted(conn):
            WAYS[way_of(conn, flushes=self.flushes)](self, conn, params)

    def _insert_rows(self, conn: psycopg.Connection[Any], rows: list[dict[str, Any]]) -> None:
        """Insert the messages of a batch (``rows``: what :meth:`_publish_params` made of
        each, in publish order) with one statement on the batch's connection, and wake
        each queue that got one, at the commit."""
        # (an array holds one type: psycopg refuses a list of ints and floats mixed)
        columns = {
            name: [_as_float(row[name]) for row in rows]
            if name in FLOAT_COLUMNS
            else [row[name] for row in rows]
            for name in MANY_COLUMNS
        }
        with self._permitted(conn):
            conn.execute(self.q["publish_many"], columns)  # joins the batch's pipeline

    @contextmanager
    def _permitted(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """A publish Postgres refuses for the role's rights raises :class:`NotPermitted`,
        with the database's reason: a publisher-only role publishing to a worker's
        control queue or writing what only pgq writes (the publisher's boundary, raised
        by the triggers BOUNDARY names: migration 0013_publish_boundary.sql), or, on
        pgq's own session, a role without the grants of docs/least-privilege.md (on an
        application's, :mod:`~pg_transport.publish.joined` says which grant it needs).
        Nothing was stored."""
        try:
            yield
        except psycopg.errors.InsufficientPrivilege as exc:
            if exc.diag.constraint_name not in BOUNDARY and not is_own(conn):
                raise
            raise NotPermitted(
                f"role {conn.info.user!r} may not publish this message in pgq schema "
                f"{self.schema!r}: {exc.diag.message_primary or exc} (see "
                "docs/least-privilege.md); nothing was published"
            ) from exc

    def _batched(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
        conn.execute(self.q["publish_plain"], params)  # joins the caller's pipeline

    def _joined(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
        # A cursor of pgq's own (the application may have set its connection's row or
        # cursor factory), never prepared (its session may be a transaction pooler's),
        # left open: in the application's pipeline, if it runs one, its result comes later.
        cur = psycopg.Cursor(conn, row_factory=tuple_row)
        cur.execute(self.q["publish_plain"], params, prepare=False)

    def _together(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> None:
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
        self,
        conn: psycopg.Connection[Any],
        params: dict[str, Any],
        woke: psycopg.Error,
        *,
        statement: str = "wake",
    ) -> None:
        """A wake-up for a message committed durably failed: lost with ``conn``, it is
        sent again on another connection; otherwise a warning says so. Nothing here
        raises: the message is committed, and its publish succeeded."""
        failure: Exception | None = woke
        if isinstance(woke, psycopg.OperationalError) and conn.closed:
            try:
                self.connector.run(
                    lambda other: self.wire[statement].execute(other, params, prepare=True),
                    idempotent=True,
                )
                failure = None
            except Exception as exc:  # (no connection to be had: BrokerUnavailable, …)
                failure = exc
        if failure is not None:
            logger.warning(
                "pgq: a message of queue %r is published, but waking its consumers "
                "failed (%s): they take it at their next poll",
                params.get("queue") or params.get("exchange"),
                failure,
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
        place = ordering.placement(payload, self.follows_timeout)  # (first: above)
        ordering.check_hold(place, max(delay, 0.0))
        limits.check_headers(payload)
        params = {
            **place.params(),
            **self._unique_params(payload, place),
            "fkey": fair.fair_key(payload),
            "exchange": exchange,
            "routing_key": routing_key,
            "priority": priority,
            "delay": max(delay, 0.0),
            "ttl": ttl,
            "publish_tag": publish_tag,
            "payload": self.encode(payload),
            "channel_prefix": self.channel_prefix,
            "wake": True,
        }

        def routed(conn: psycopg.Connection[Any]) -> tuple[str | None, int, int, str | None]:
            if params["ukey"] is None and way_of(conn, flushes=self.flushes) == "apart":
                return self._routed_then_wake(conn, params)
            with self._permitted(conn), self._waits(params):
                row = _fetch_one(conn, self.q["publish_routed"], params)
            assert row is not None
            if params["ukey"] is not None:
                self._restore_wait(conn, row[4])
            return row[0], int(row[1] or 0), int(row[5] or 0), row[3]

        if params["ukey"] is None:
            kind, matched, _, _ = self._dispatch(
                routed, idempotent=publish_tag is not None, payload=payload
            )
            return kind, matched
        for _ in range(UNIQUE_ATTEMPTS):
            kind, matched, inserted, holder = self._dispatch(routed, idempotent=True)
            if matched > 1:
                raise unique.UniqueError(
                    f"header {unique.UNIQUE_KEY}={params['ukey'][:40]!r}: exchange "
                    f"{exchange!r} routes {routing_key!r} to {matched} queues; a unique "
                    "message goes to exactly one (each copy would conflict with the "
                    "others); nothing was published"
                )
            if inserted:
                joined.note_published(payload)
            if inserted or matched == 0 or self._settled(params, holder):
                return kind, matched
        raise UniqueBusy(
            f"unique key {params['ukey'][:80]!r} changed hands {UNIQUE_ATTEMPTS} times "
            "while it was published; nothing was published"
        )

    def _routed_then_wake(
        self, conn: psycopg.Connection[Any], params: dict[str, Any]
    ) -> tuple[str | None, int, int, str | None]:
        """``publish_routed`` without its wake-ups, then ``wake_routed``: two transactions
        sent at once, as :meth:`_enqueue_then_wake` sends a publish to one queue (its
        docstring says why). (type, queues matched, copies inserted, holder: None.)"""
        with self._permitted(conn):
            inserted, woke = run_apart(
                conn,
                [
                    (self.wire["publish_routed"], {**params, "wake": False}),
                    (self.wire["wake_routed"], params),
                ],
                prepare=True,
            )
            if isinstance(inserted, psycopg.Error):
                raise inserted
        if isinstance(woke, psycopg.Error):
            self._wake_failed(conn, params, woke, statement="wake_routed")
        (row,) = inserted
        kind = None if row[0] is None else bytes(row[0]).decode()
        return kind, int(row[1] or 0), int(row[5] or 0), None

    def dead_letter_unroutable(
        self, queue: str, payload: dict[str, Any], *, priority: int, reason: str
    ) -> int:
        params = {
            "queue": queue,
            "payload": self.encode(payload),
            "priority": priority,
            "reason": reason,
        }

        def keep(conn: psycopg.Connection[Any]) -> Any:
            with self._permitted(conn):
                return _scalar_on_(conn, self.q["dead_letter_unroutable"], params)

        # Kept only if the application's transaction commits, or the batch's messages are.
        return int(self._dispatch(keep, idempotent=False))

    def _dispatch(
        self,
        work: Callable[[psycopg.Connection[Any]], T],
        *,
        idempotent: bool,
        payload: dict[str, Any] | None = None,
    ) -> T:
        """Run ``work`` where this thread's publishes go: in the application's transaction
        (:mod:`~pg_transport.publish.joined`; ``payload`` noted as published in it), in the
        open batch's (:mod:`~pg_transport.publish.batching`), or on a session of this
        publisher's own, sent again after a lost connection only when ``idempotent``."""
        caller = joined.current()
        if caller is not None:
            result = self.on_caller(caller, work)
            if payload is not None:
                joined.note_published(payload)
            return result
        open_batch = batching.current()
        if open_batch is not None:
            found: T = open_batch.run(self._batch_key(), self.connector, work)
            return found
        return self.connector.run(work, idempotent=idempotent)

    def on_caller(self, caller: Caller, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``work`` in the application's transaction ``caller``, once its connection
        is known to be on this publisher's database (else
        :class:`~pg_transport.errors.TransactionRefused`)."""
        return joined.on_caller(
            caller, self.connector, self.schema, self.q["server_identity"], work
        )

    def _batch_key(self) -> tuple[str, str, bool]:
        """Which transaction of a batch this store's publishes join: the publisher's
        database, the schema, and whether its commits wait for their WAL flush."""
        return (self.connector.conninfo, self.schema, self.flushes)


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)


def way_of(conn: psycopg.Connection[Any], *, flushes: bool) -> str:
    """How a publish goes on ``conn`` (see the module's docstring): ``joined`` on an
    application's connection; on pgq's own, ``batched`` in a pipeline, ``apart`` on a
    session that prepares (not a transaction pooler's), idle, whose commits wait for
    their flush; else ``together``."""
    if not is_own(conn):
        return "joined"
    if conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
        return "batched"
    own_idle = (
        conn.prepare_threshold is not None
        and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    )
    return "apart" if flushes and own_idle else "together"


#: Each way of publishing, by the name :func:`way_of` gives it.
WAYS: dict[str, Callable[[Publisher, psycopg.Connection[Any], dict[str, Any]], None]] = {
    "batched": Publisher._batched,
    "apart": Publisher._enqueue_then_wake,
    "together": Publisher._together,
    "joined": Publisher._joined,
}


def _fetch_one(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any]
) -> tuple[Any, ...] | None:
    """``query``'s first row, through a cursor of pgq's own (an application may have set
    its connection's row or cursor factory), prepared only on a session of pgq's own."""
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        cur.execute(query, params, prepare=None if is_own(conn) else False)
        return cur.fetchone()


def _scalar_on_(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> Any:
    row = _fetch_one(conn, query, params)
    return row[0] if row else None


def _non_finite(value: Any, path: str = "") -> str:
    """Where in ``value`` the first NaN or infinity is (``headers.x``, ``body[2]``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(the message)"
    items: Any = ()
    if isinstance(value, Mapping):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    for where, item in items:
        found = _non_finite(item, where)
        if found:
            return found
    return ""
