"""The Celery result backend on Postgres: ``result_backend = "pgq://user:pass@host/db"``.

A task's state is one row of ``result`` (its meta encoded with ``result_serializer``,
compressed with ``result_compression`` if set, with its content type; read back under
``result_accept_content``/``accept_content``). A SUCCESS is never overwritten. Storing
commits the row, then notifies the task's channel with no payload (one round trip: the
two are pipelined); callers wait through the process's one listening session
(:mod:`pg_transport.results.listener`), as Celery's Redis backend waits on pub/sub.

Options: ``result_backend_transport_options`` (:mod:`pg_transport.results.options`).
Expired results (``result_expires``) are deleted by the workers using this backend
(:mod:`pg_transport.results.hooks`) and by Celery's ``backend_cleanup``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Mapping
from functools import partial
from typing import Any

import psycopg
from celery import states
from celery.backends.asynchronous import AsyncBackendMixin, BaseResultConsumer
from celery.backends.base import Backend, compress_payload, decompress_payload
from celery.exceptions import NotRegistered
from celery.result import result_from_tuple
from kombu.serialization import dumps, loads
from kombu.utils.encoding import bytes_to_str

from pg_transport.config import Options
from pg_transport.db import completing
from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector, is_own, shared, url_to_conninfo
from pg_transport.db.retry import is_dead_connection
from pg_transport.db.url import mask_url
from pg_transport.db.wire import Statement, run_apart
from pg_transport.errors import BrokerUnreachable, NotPermitted, NotYetCommitted
from pg_transport.message import unique
from pg_transport.publish import joined
from pg_transport.results.chords import Chords
from pg_transport.results.errors import ResultTooLarge
from pg_transport.results.expiry import REAP_LIMIT, reap_expired
from pg_transport.results.listener import Listener, Row, listener_for, result_channel
from pg_transport.results.masking import seal_result_backend, url_of
from pg_transport.results.options import DEFAULT_SCHEMA, ResultOptions
from pg_transport.sql import load_named

__all__ = ["PgqBackend", "ResultConsumer", "calling"]

# The backend whose app is sending a task on this thread, and the task's id (Celery calls
# on_task_call just before it publishes): where a duplicate's alias is stored.
_calls = threading.local()


def calling(task_id: str) -> PgqBackend | None:
    """The pgq backend of the app that is sending ``task_id`` on this thread (and wants
    its result), if any."""
    call = getattr(_calls, "call", None)
    if call is None or call[0] != task_id:
        return None
    _calls.call = None
    backend: PgqBackend = call[1]
    return backend


def alias_in(meta: Mapping[str, Any]) -> str | None:
    """The holder a duplicate's stored state names (the state of a task that was never
    queued: its key was held), if ``meta`` is one."""
    holder = meta.get(unique.RESULT_ALIAS)
    if meta.get("status") != states.PENDING or not isinstance(holder, str) or not holder:
        return None
    return holder


logger = logging.getLogger("pg_transport.results")


def _idle_own(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn`` is a session of pgq's own with no transaction open and no
    pipeline running: one where a statement commits on its own."""
    return (
        is_own(conn)
        and conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
        and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    )


def _connector(conninfo: str, display_url: str, *, own_sessions: bool) -> Connector:
    # One pool per process and database, whatever the number of backend objects
    # (Celery builds one per thread). Without sessions of its own (use_notify off: a
    # transaction pooler in between) nothing is pinned or prepared: the results' SQL
    # names every table and function by schema.
    return shared(
        conninfo,
        display_url=display_url,
        application_name="pgq",
        prepare_threshold=5 if own_sessions else None,
        pin_search_path=own_sessions,
    )


def _refuse_uncommitted(task_ids: list[str]) -> None:
    """A wait for a task this thread published in a transaction still open could only
    time out (no worker sees the task before the commit): refuse it at once."""
    for task_id in task_ids:
        caller = joined.uncommitted(task_id)
        if caller is not None:
            raise NotYetCommitted(
                f"task {task_id} was published in the transaction of {caller.describe}, "
                "which is still open: no worker can see the task before it commits. "
                "Wait for the result after the commit (outside the "
                "pg_transport.transaction() block)"
            )


def _default_schema(app: Any) -> str:
    broker = str(app.conf.broker_write_url or app.conf.broker_url or "")
    if broker.lower().startswith("pgq://"):
        return Options.from_sources(app.conf.broker_transport_options, os.environ).schema
    return os.environ.get("PGQ_SCHEMA") or DEFAULT_SCHEMA


class ResultConsumer(BaseResultConsumer):
    """Celery's side of waiting: rows the listener read are decoded and handed to
    Celery on the waiting caller's thread (in :meth:`drain_events`)."""

    backend: PgqBackend

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inbox: deque[Row] = deque()
        self._arrived = threading.Condition()
        self._subscribed: set[str] = set()
        # A duplicate unique task waits on the task that held its key: duplicate ->
        # holder, and holder -> the duplicates waiting on it.
        self._holder: dict[str, str] = {}
        self._followers: dict[str, set[str]] = {}
        self._pid = os.getpid()

    def _forked(self) -> None:
        # A child inherits the parent's subscriptions, which are the parent listener's:
        # it starts with none (its own listener subscribes again).
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self.on_after_fork()

    def start(self, initial_task_id: str, **kwargs: Any) -> None:
        self.consume_from(initial_task_id)

    def _wanted(self, task_id: str) -> bool:
        return task_id in self._subscribed or bool(self._followers.get(task_id))

    def consume_from(self, task_id: str) -> None:
        self._forked()
        holder = unique.holder_of(task_id)
        if holder is not None:
            self.follow(task_id, holder)
        if task_id not in self._subscribed:
            self._subscribed.add(task_id)
            self.backend.listener.subscribe(task_id, self)

    def follow(self, task_id: str, holder: str) -> None:
        """Wait on ``holder`` for ``task_id``, a duplicate of it: its states are handed
        to Celery as ``task_id``'s."""
        if self._holder.get(task_id) == holder or holder == task_id:
            return
        subscribe = not self._wanted(holder)
        self._holder[task_id] = holder
        self._followers.setdefault(holder, set()).add(task_id)
        if subscribe:
            self.backend.listener.subscribe(holder, self)

    def cancel_for(self, task_id: str) -> None:
        self._forked()
        holder = self._holder.pop(task_id, None)
        if holder is not None:
            followers = self._followers.get(holder, set())
            followers.discard(task_id)
            if not followers:
                self._followers.pop(holder, None)
                if holder not in self._subscribed:
                    self.backend.listener.unsubscribe(holder, self)
        if task_id in self._subscribed:
            self._subscribed.discard(task_id)
            if not self._wanted(task_id):
                self.backend.listener.unsubscribe(task_id, self)

    def deliver(self, row: Row) -> None:
        with self._arrived:
            self._inbox.append(row)
            self._arrived.notify_all()

    def drain_events(self, timeout: float | None = None) -> None:
        with self._arrived:
            if not self._inbox:
                self._arrived.wait(timeout)
            rows = list(self._inbox)
            self._inbox.clear()
        for row in rows:
            meta = self.backend.decode_row(row.content_type, row.content_encoding, row.meta)
            holder = alias_in(meta)
            if holder is not None:
                # A duplicate's stand-in: its waiters wait on the holder from now on.
                self.follow(row.task_id, holder)
                continue
            if row.task_id in self._subscribed or not self._followers.get(row.task_id):
                self.on_state_change(meta, None)
            for task_id in sorted(self._followers.get(row.task_id, ())):
                self.on_state_change({**meta, "task_id": task_id}, None)

    def on_state_change(self, meta: dict[str, Any], message: Any) -> None:
        super().on_state_change(meta, message)
        if meta["status"] in states.READY_STATES:
            self.cancel_for(meta["task_id"])

    def stop(self) -> None:
        for task_id in list(self._subscribed):
            self.cancel_for(task_id)

    def on_after_fork(self) -> None:
        # The parent's subscriptions are its listener's; the child starts with none.
        self._subscribed = set()
        self._holder = {}
        self._followers = {}
        with self._arrived:
            self._inbox.clear()


class PgqBackend(AsyncBackendMixin, Backend):
    """Results, states, groups and waiting on Postgres."""

    ResultConsumer = ResultConsumer

    supports_native_join = True
    supports_autoexpire = True
    supports_result_compression = True
    persistent = True

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any) -> None:
        url = url_of(url or app.conf.result_backend or "")
        super().__init__(app, url=url, **kwargs)
        self.url = url
        # The app's setting shows this URL from now on only masked (a worker's was
        # sealed when it imported its modules).
        seal_result_backend(app)
        self.options = ResultOptions.from_sources(
            app.conf.get("result_backend_transport_options"),
            os.environ,
            default_schema=_default_schema(app),
        )
        self.schema = self.options.schema
        self.connector = _connector(
            url_to_conninfo(url), mask_url(url), own_sessions=self.options.use_notify
        )
        self.q = load_named("results.sql", self.schema, "pg_transport.results")
        self._statements: dict[str, Statement] = {}
        self._checked = False
        self.chords = Chords(
            self, enabled=self.options.native_chords, conninfo=self.connector.conninfo
        )
        # Chord parts' metas, stored with their count (see on_chord_part_return).
        self._deferred = threading.local()
        self.result_consumer = self.ResultConsumer(
            self, self.app, self.accept, self._pending_results, self._pending_messages
        )

    # -- plumbing -----------------------------------------------------------------------
    @property
    def listener(self) -> Listener:
        self._ensure_schema()
        return listener_for(
            self.connector,
            self.schema,
            use_notify=self.options.use_notify,
            polling_interval=self.options.polling_interval,
        )

    def _ensure_schema(self) -> None:
        if not self._checked:
            ensure_schema(self.connector, self.schema, auto_migrate=self.options.auto_migrate)
            self._checked = True

    def _run(self, work: Any, what: str) -> Any:
        self._ensure_schema()
        run = completing.connection()
        try:
            if run is not None:
                # An atomic task's run: in its transaction, committed with its writes.
                return work(run)
            return self.connector.run(work, idempotent=True)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise NotPermitted(
                f"the pgq result backend cannot {what} in schema {self.schema!r}: "
                f"{exc.diag.message_primary or exc}. Grant the role what docs/results.md "
                "lists under Roles for its use (a worker's rights, or EXECUTE on the result "
                "functions for a process that waits for results)"
            ) from exc

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        # A reaped or restarting connection (result_backend_always_retry retries these).
        return is_dead_connection(exc) or isinstance(exc, BrokerUnreachable)

    def as_uri(self, include_password: bool = False) -> str:
        return self.url if include_password else mask_url(self.url)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        kwargs.setdefault("url", self.url)
        return super().__reduce__(args, kwargs)

    # -- encoding -----------------------------------------------------------------------
    def _encoded(self, data: Any) -> tuple[str, str, bytes]:
        content_type, content_encoding, payload = dumps(data, serializer=self.serializer)
        if self.compression:
            payload = compress_payload(payload, self.compression)
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        return content_type, content_encoding, bytes(payload)

    def _decoded(self, content_type: str, content_encoding: str, meta: bytes) -> Any:
        payload = decompress_payload(bytes(meta))
        return loads(
            payload,
            content_type=content_type,
            content_encoding=content_encoding,
            accept=self.accept,
        )

    def decode_row(self, content_type: str, content_encoding: str, meta: bytes) -> dict[str, Any]:
        decoded: dict[str, Any] = self._decoded(content_type, content_encoding, meta)
        return self.meta_from_decoded(decoded)  # type: ignore[no-any-return]

    def _check_size(self, task_id: str, what: str, payload: bytes) -> None:
        if len(payload) > self.options.max_result_bytes:
            raise ResultTooLarge(
                f"the {what} of task {task_id} is {len(payload)} bytes encoded, more than "
                f"max_result_bytes ({self.options.max_result_bytes}): it was not stored"
            )

    def _too_large(self, task_id: str, state: str, size: int) -> tuple[dict[str, Any], str]:
        """What is stored instead of a meta larger than ``max_result_bytes``.

        A successful result raises :class:`ResultTooLarge` (an ``EncodeError``: Celery then
        stores the task as failed with it). A failure or a state whose meta is too large
        (the task_extended arguments, say) is stored without its extended fields, the
        failure as ``ResultTooLarge`` naming the size, so a waiter is never left waiting.
        """
        error = ResultTooLarge(
            f"the result of task {task_id} is {size} bytes encoded, more than "
            f"max_result_bytes ({self.options.max_result_bytes}): it was not stored"
        )
        if state == states.SUCCESS:
            raise error
        if state in self.EXCEPTION_STATES:
            state, result = states.FAILURE, self.prepare_exception(error)
        else:
            result = None
        meta = self._get_result_meta(result=result, state=state, traceback=None, request=None)
        meta["task_id"] = task_id
        return meta, state

    # -- tasks --------------------------------------------------------------------------
    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: str | None = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request
        )
        meta["task_id"] = bytes_to_str(task_id)
        content_type, content_encoding, payload = self._encoded(meta)
        if len(payload) > self.options.max_result_bytes:
            meta, state = self._too_large(task_id, state, len(payload))
            content_type, content_encoding, payload = self._encoded(meta)
        if (
            state in states.READY_STATES
            and request is not None
            and getattr(request, "chord", None)
            and getattr(request, "group", None)
            and self.chords.usable()
        ):
            # Stored in on_chord_part_return's transaction, with the part's count.
            self._deferred_metas()[meta["task_id"]] = meta
            return result
        params = {
            "task_id": meta["task_id"],
            "status": state,
            "content_type": content_type,
            "content_encoding": content_encoding,
            "meta": payload,
            "date_done": meta.get("date_done"),
            "expires": self.expires if self.expires else None,
        }
        notify = {"channel": result_channel(self.schema, meta["task_id"])}

        def work(conn: psycopg.Connection[Any]) -> None:
            if not _idle_own(conn):
                # In a transaction of the caller's (an atomic task's): both in it, the
                # wake-up sent when it commits.
                conn.execute(self.q["result_store"], params)
                conn.execute(self.q["result_notify"], notify)
                return
            self._store_then_wake(conn, params, notify)

        self._run(work, "store a result")
        return result

    def _store_then_wake(
        self, conn: psycopg.Connection[Any], params: dict[str, Any], notify: dict[str, Any]
    ) -> None:
        """The row and its wake-up as two transactions sent at once (one round trip):
        the row commits (durably), then the wake-up alone. Postgres commits the
        transactions that NOTIFY one at a time, each holding a lock through its commit,
        WAL flush included: a wake-up in the row's transaction would make every other
        result stored (and every publish) wait for this flush, where alone it holds the
        lock only for a moment. No waiter is woken for a row not yet on disk. (psycopg's
        pipeline would send both in one transaction: no synchronization point between
        them in autocommit.)

        A wake-up lost with the connection after the row committed is sent again on
        another one; one that fails otherwise is said: the waiter's next look (a new
        subscriber, a reconnection) finds the row."""
        stored, woke = run_apart(
            conn,
            [(self._wire("result_store"), params), (self._wire("result_notify"), notify)],
            prepare=conn.prepare_threshold is not None,
        )
        if isinstance(stored, psycopg.Error):
            raise stored
        if not isinstance(woke, psycopg.Error):
            return
        failure: Exception | None = woke
        if isinstance(woke, psycopg.OperationalError) and conn.closed:
            try:
                self.connector.run(
                    lambda other: self._wire("result_notify").execute(
                        other, notify, prepare=other.prepare_threshold is not None
                    ),
                    idempotent=True,
                )
                failure = None
            except Exception as exc:  # (no connection to be had: BrokerUnavailable, …)
                failure = exc
        if failure is not None:
            logger.warning(
                "pgq results: a result of task %s is stored, but waking its waiters failed (%s)",
                params["task_id"],
                failure,
            )

    def _wire(self, name: str) -> Statement:
        """A named query of results.sql, sent through libpq (:mod:`pg_transport.db.wire`)."""
        statement = self._statements.get(name)
        if statement is None:
            statement = self._statements[name] = Statement(name, self.q[name])
        return statement

    def store_state_row(
        self, conn: psycopg.Connection[Any], task_id: str, meta: dict[str, Any]
    ) -> None:
        """Store ``meta`` (a full Celery meta dict) for ``task_id`` on ``conn``, inside the
        caller's transaction, and notify its waiters when that commits."""
        content_type, content_encoding, payload = self._encoded(meta)
        self._check_size(task_id, "result", payload)
        conn.execute(
            self.q["result_store"],
            {
                "task_id": task_id,
                "status": meta["status"],
                "content_type": content_type,
                "content_encoding": content_encoding,
                "meta": payload,
                "date_done": meta.get("date_done"),
                "expires": self.expires if self.expires else None,
            },
        )
        conn.execute(self.q["result_notify"], {"channel": result_channel(self.schema, task_id)})

    def failure_meta(self, task_id: str, exc: BaseException) -> dict[str, Any]:
        """The meta of a FAILURE with ``exc`` (no traceback, no request)."""
        meta = self._get_result_meta(
            result=self.prepare_exception(exc), state=states.FAILURE, traceback=None, request=None
        )
        meta["task_id"] = task_id
        return meta  # type: ignore[no-any-return]

    def _read_meta(self, task_id: str) -> dict[str, Any] | None:
        def work(conn: psycopg.Connection[Any]) -> Any:
            return conn.execute(self.q["result_get"], {"task_id": task_id}).fetchone()

        row = self._run(work, "read a result")
        if row is None:
            return None
        _, content_type, content_encoding, meta = row
        return self.decode_row(content_type, content_encoding, bytes(meta))

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        # A duplicate unique task's state is its holder's: known to this process if it
        # published the duplicate, else from the stand-in row stored for it (one hop:
        # a holder is a task that was queued, never a stand-in).
        holder = unique.holder_of(task_id)
        meta = None
        if holder is None:
            meta = self._read_meta(task_id)
            holder = None if meta is None else alias_in(meta)
        if holder is not None:
            meta = self._read_meta(holder)
            if meta is not None and alias_in(meta) is None:
                return {**meta, "task_id": task_id}
            return {"status": states.PENDING, "result": None, "task_id": task_id}
        if meta is None:
            return {"status": states.PENDING, "result": None}
        return meta

    def on_task_call(self, producer: Any, task_id: str) -> dict[str, Any]:
        # Celery sends task_id now, on this thread, and wants its result.
        _calls.call = (task_id, self)
        return {}

    def store_alias(self, task_id: str, holder: str) -> None:
        """Store, for the duplicate ``task_id`` (never queued: ``holder`` held its unique
        key), a stand-in state naming ``holder``: ``AsyncResult(task_id)`` resolves to the
        holder's result in every process. Expires as results do."""
        meta = {
            "status": states.PENDING,
            "result": None,
            "traceback": None,
            "children": [],
            "date_done": None,
            "task_id": task_id,
            unique.RESULT_ALIAS: holder,
        }
        content_type, content_encoding, payload = self._encoded(meta)
        params = {
            "task_id": task_id,
            "status": states.PENDING,
            "content_type": content_type,
            "content_encoding": content_encoding,
            "meta": payload,
            "date_done": None,
            "expires": self.expires if self.expires else None,
        }
        notify = {"channel": result_channel(self.schema, task_id)}

        def work(conn: psycopg.Connection[Any]) -> None:
            with conn.pipeline():
                conn.execute(self.q["result_store"], params)
                conn.execute(self.q["result_notify"], notify)

        self._run(work, "store a duplicate's alias")

    def task_result_exists(self, task_id: str) -> bool:
        def work(conn: psycopg.Connection[Any]) -> bool:
            return conn.execute(self.q["result_get"], {"task_id": task_id}).fetchone() is not None

        return bool(self._run(work, "read a result"))

    def _forget(self, task_id: str) -> None:
        self._run(
            lambda conn: conn.execute(self.q["result_forget"], {"task_id": task_id}), "forget"
        )

    def forget(self, task_id: str) -> None:
        super().forget(task_id)
        self.result_consumer.cancel_for(task_id)

    # -- groups -------------------------------------------------------------------------
    def _save_group(self, group_id: str, result: Any) -> Any:
        content_type, content_encoding, payload = self._encoded({"result": result.as_tuple()})
        self._check_size(group_id, "group", payload)
        params = {
            "group_id": group_id,
            "content_type": content_type,
            "content_encoding": content_encoding,
            "meta": payload,
            "expires": self.expires if self.expires else None,
        }
        self._run(lambda conn: conn.execute(self.q["group_save"], params), "save a group")
        return result

    def _restore_group(self, group_id: str) -> dict[str, Any] | None:
        def work(conn: psycopg.Connection[Any]) -> Any:
            return conn.execute(self.q["group_get"], {"group_id": group_id}).fetchone()

        row = self._run(work, "read a group")
        if row is None:
            return None
        meta: dict[str, Any] = self._decoded(row[0], row[1], bytes(row[2]))
        meta["result"] = result_from_tuple(meta["result"], self.app)
        return meta

    def _delete_group(self, group_id: str) -> None:
        self._run(
            lambda conn: conn.execute(self.q["group_delete"], {"group_id": group_id}),
            "delete a group",
        )

    # -- chords -------------------------------------------------------------------------
    def _deferred_metas(self) -> dict[str, Mapping[str, Any]]:
        found: dict[str, Mapping[str, Any]] | None = getattr(self._deferred, "metas", None)
        if found is None:
            found = self._deferred.metas = {}
        return found

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> Any:
        group_id, results = header_result_args[0], header_result_args[1]
        # Before the chord is armed or any part sent (a part is refused as it is sent).
        unique.refuse_on_chord_body(body, self.app.tasks.get(getattr(body, "task", None)))
        if not self.chords.takes(results, body):
            return super().apply_chord(header_result_args, body, **kwargs)
        self.ensure_chords_allowed()
        self.chords.arm(group_id, results, body)
        return None

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        # Celery tells every chord's size before sending its header's last part; only a
        # streamed (generator) header's fan-in is waiting for it.
        if self.chords.usable():
            self.chords.set_size(str(group_id), int(chord_size))

    def add_to_chord(self, group_id: str, result: Any) -> None:
        """``Task.add_to_chord``: the chord waits for ``result``'s task too, whose result
        comes after the header's. A chord that fired, failed, is not native, or whose
        generator header is still being sent refuses it with a ChordError naming why."""
        if not self.chords.usable():
            super().add_to_chord(group_id, result)
            return
        self.chords.add(str(group_id), str(result.id))

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> None:
        stored = self._deferred_metas().pop(str(request.id), None)
        if not getattr(request, "group", None) or not self.chords.usable():
            return
        self.chords.part_returned(request, state, result, stored)

    def errback_is_in_process(self, sig: Any) -> bool:
        """Whether Celery calls errback ``sig`` in process (it takes request, exc,
        traceback) rather than sending it as a task with the failed task's id."""
        try:
            header = getattr(sig.type, "__header__", None)
            return (
                header is not None
                and not isinstance(header, partial)
                and bool(self._errback_arity_greater(sig, 1))
            )
        except NotRegistered:
            return False

    # -- expiry -------------------------------------------------------------------------
    # -- waiting inside the publishing transaction ------------------------------
    def wait_for_pending(self, result: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_uncommitted([result.id])
        return super().wait_for_pending(result, *args, **kwargs)

    def iter_native(self, result: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_uncommitted([node.id for node in result.results or ()])
        return super().iter_native(result, *args, **kwargs)

    def cleanup(self) -> None:
        """Delete results and groups past ``result_expires`` (Celery's backend_cleanup)."""
        while reap_expired(self.connector, self.schema) >= REAP_LIMIT:
            pass

    def on_after_fork(self) -> None:
        self._checked = False
