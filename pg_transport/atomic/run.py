"""One atomic task's run: its transaction from the body's start to the commit.

Steps (docs/design/exactly-once.md, "The run, step by step"): :func:`open_run` begins the
transaction on the provider's connection, checks it (READ COMMITTED, on the broker's
database), marks the body's start with a savepoint and opens a
``pg_transport.transaction()`` block and the result backend's completion context on it;
:meth:`Run.complete` says the run ends its delivery; :meth:`Run.finish` closes the
contexts and commits (the fence, which deletes the delivery's message row under its
fencing token, sent with the COMMIT in one round trip) or rolls back.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any

import psycopg
from psycopg import generators
from psycopg.rows import tuple_row

from pg_transport.atomic.errors import LeaseLost
from pg_transport.atomic.providers import SAVEPOINT, Handle, PsycopgHandle, handle_for
from pg_transport.config import Options
from pg_transport.db import completing
from pg_transport.db.pool import Connector, shared, url_to_conninfo
from pg_transport.db.retry import is_dead_connection
from pg_transport.errors import NotPermitted, TransactionRefused
from pg_transport.message.rows import Lease
from pg_transport.publish.callers import caller_for
from pg_transport.publish.joined import Joined, on_caller
from pg_transport.publish.joined import transaction as joined_transaction
from pg_transport.sql import load_named, load_queries
from pg_transport.store import Store

__all__ = ["Completion", "ConnectionLost", "Run", "current", "open_run", "refuse"]

logger = logging.getLogger("pg_transport.atomic")

_current: ContextVar[Run | None] = ContextVar("pgq_atomic_run", default=None)
_queries: dict[str, dict[str, str]] = {}


def _q(schema: str) -> dict[str, str]:
    found = _queries.get(schema)
    if found is None:
        found = {**load_named("atomic.sql", schema, "pg_transport.atomic")}
        found["server_identity"] = load_queries(schema)["server_identity"]
        _queries[schema] = found
    return found


#: Where a run finds its app's broker (schema, connector), kept on the app object per
#: process: Celery's settings cost microseconds a lookup, and a run needs them each time.
_BROKER_ATTR = "_pgq_atomic_broker"

#: Per connection and schema, the role its open found permitted to end a delivery: the
#: next run's open skips the four privilege lookups while its role is still that one (a
#: role changed or a new connection asks again). A right revoked since is refused by the
#: fence itself (it runs with the caller's rights), which drops the entry.
_permitted: weakref.WeakKeyDictionary[psycopg.Connection[Any], dict[str, str]] = (
    weakref.WeakKeyDictionary()
)


#: Per connection, the open's string (BEGIN, the open query with its values bound, the
#: savepoint) by those values: built once, not on every run (the values are pgq's own,
#: the schema and the role kept above: a few per connection; and its client encoding).
_open_texts: weakref.WeakKeyDictionary[
    psycopg.Connection[Any], dict[tuple[str, str, tuple[tuple[str, Any], ...]], bytes]
] = weakref.WeakKeyDictionary()


def _broker_of(app: Any) -> tuple[str, Connector]:
    """The broker's schema and this process's connector for it (read once per app and
    process: a run must not read or parse the configuration again)."""
    pid = os.getpid()
    kept: tuple[int, str, Connector] | None = getattr(app, _BROKER_ATTR, None)
    if kept is not None and kept[0] == pid:
        return kept[1], kept[2]
    conf = app.conf
    broker = str(conf.broker_write_url or conf.broker_url).split(";")[0]
    schema = Options.from_sources(conf.broker_transport_options, os.environ).schema
    connector = shared(url_to_conninfo(broker))
    setattr(app, _BROKER_ATTR, (pid, schema, connector))
    return schema, connector


def current() -> Run | None:
    """The atomic run open in this context (thread, greenlet), if any."""
    return _current.get()


class Completion:
    """What the task body sees as ``self.transaction``."""

    def __init__(self, run: Run) -> None:
        self._run = run

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The psycopg 3 connection the run's transaction is on."""
        return self._run.conn

    @property
    def session(self) -> Any:
        """The SQLAlchemy ``Session`` the run's transaction is on."""
        target = self._run.handle.target
        if type(target).__name__ != "Session":
            raise AttributeError(
                f"the run's transaction is on {self._run.handle.describe}, not on a "
                "SQLAlchemy Session"
            )
        return target

    def on_commit(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the run's transaction committed (never after a rollback)."""
        self._run.after_commit.append(fn)


def token_of(request: Any) -> Lease | None:
    """The fencing token of the delivery ``request`` runs (None: no delivery to complete,
    as with ``apply()`` or ``task_always_eager``). The transport writes it over anything
    a publisher put there (transport.py, ``as_payload``)."""
    props = getattr(request, "properties", None) or {}
    info = props.get("delivery_info") if isinstance(props, dict) else None
    if not isinstance(info, dict):
        return None
    pair, queue = info.get("pgq_token"), info.get("pgq_queue")
    if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(queue, str):
        return None
    task = getattr(request, "id", None)
    return Lease(int(pair[0]), int(pair[1]), queue, task if isinstance(task, str) else None)


class Run:
    def __init__(self, task: Any, handle: Handle, token: Lease | None, schema: str) -> None:
        self.task, self.handle, self.token, self.schema = task, handle, token, schema
        self.task_id: str | None = getattr(task.request, "id", None)
        self.after_commit: list[Callable[[], object]] = []
        #: Whether the run ends its delivery (its fence goes with its COMMIT).
        self.completes = False
        #: Why its commit was refused (LeaseLost, TransactionRefused), if it was.
        self.refused: LeaseLost | TransactionRefused | NotPermitted | None = None
        #: Whether :meth:`finish` logs a lost connection (False: already logged).
        self.report_lost = True
        self.conn: psycopg.Connection[Any]
        self._xid = ""
        self._role = ""
        self._joined: Joined | None = None
        self._tokens: list[Token[Any]] = []
        self._open = False

    # -- 1. open ---------------------------------------------------------------------
    def open(self) -> None:
        handle = self.handle
        self.conn = handle.begin()
        self._open = True
        q = _q(self.schema)
        connector = _broker_of(self.task.app)[1]

        caller = caller_for(handle.target)
        known = _permitted.get(self.conn)
        role = known.get(self.schema) if known else None
        params = {"schema": self.schema, "known": role}
        # The role found permitted before: only whether it is still the role (the short
        # open); otherwise the open that asks the rights.
        query = q["open"] if role is None else q["open_known"]
        # On a psycopg connection pgq drives itself, the BEGIN, this query and the body's
        # savepoint go in one pipeline flight (one round trip instead of three); a
        # framework's (SQLAlchemy, Django) begins and marks through its own API.
        pipelined = isinstance(handle, PsycopgHandle)
        row = on_caller(
            caller,
            connector,
            self.schema,
            q["server_identity"],
            (lambda conn: _open_pipelined(conn, query, params))
            if pipelined
            else (lambda conn: _one(conn, query, params)),
        )
        if role is not None and not row[3]:
            # Another role than the one found permitted: its rights are asked now, in
            # the same transaction, before the body (a read: whether the savepoint went
            # with the open or goes below changes nothing).
            row = _one(self.conn, q["open"], {"schema": self.schema, "known": None})
        self._xid, isolation, self._role = str(row[0]), str(row[1]), str(row[2])
        if row[3]:
            if known is None:
                _permitted[self.conn] = {self.schema: str(row[2])}
            else:
                known[self.schema] = str(row[2])
        else:
            raise NotPermitted(
                f"pgq cannot run an atomic task on {handle.describe}: its role "
                f"{row[2]!r} may not end a delivery in pgq's schema {self.schema!r} "
                f"(USAGE on the schema, SELECT and DELETE on {self.schema}.message, EXECUTE "
                f"on {self.schema}.atomic_complete), which the run's transaction does as it "
                "commits; give that role a worker's "
                "rights (docs/least-privilege.md: GRANT pgq_worker TO the role) or open "
                "the run's connection as the worker's role"
            )
        if isolation != "read committed":
            raise TransactionRefused(
                f"pgq cannot run an atomic task on {handle.describe}: its transaction is "
                f"{isolation.upper()}, and must be READ COMMITTED (a lease renewal "
                "updates the message row while the task runs: under a snapshot kept for "
                "the whole transaction the delivery's end would fail to serialize)"
            )
        if not pipelined:
            handle.savepoint()
        self._joined = joined_transaction(handle.target)
        self._joined.__enter__()
        self._tokens = [completing.enter(self.conn), _current.set(self)]

    # -- 3. the body's end -----------------------------------------------------------
    def rollback_body(self) -> None:
        self.handle.rollback_body()

    def complete(self) -> None:
        """The run ends its delivery: :meth:`finish` sends the fence with its COMMIT."""
        self.completes = True

    # -- 4. commit -------------------------------------------------------------------
    def finish(self, commit: bool, *, report: bool = True) -> bool:
        """Close the contexts and commit (``commit``) or roll back; whether it committed.
        A run that ends its delivery commits through its fence, sent with the COMMIT: a
        lost lease or another transaction refuses it, and nothing of the run commits
        (:attr:`refused` says why, in one log line). Never raises: a commit that fails is
        logged, and the worker's settle releases the message for another delivery
        (``report``: whether a lost connection is logged; not for a run refused at its
        open, which says so itself)."""
        self._close_contexts()
        done = lost = False
        try:
            if commit:
                self._commit()
                done = True
            else:
                self.handle.rollback()
        except _Refusal as refusal:
            self.refused = refusal.error
            logger.error("%s", refusal.error)
            self._rollback_after_failure()
        except Exception as exc:
            lost = self._lost(exc)
            if not lost:
                logger.exception(
                    "pgq: atomic task %s[%s]: its transaction could not commit; nothing of "
                    "its run is kept and its message is delivered again",
                    getattr(self.task, "name", "?"),
                    self.task_id,
                )
            self._rollback_after_failure()
        finally:
            self.handle.close()
        if report and self.report_lost and not done and (lost or self._lost(None)):
            # (found by the commit, or by a statement of Celery's success path before it)
            logger.error(
                "pgq: atomic task %s[%s]: its transaction's connection was lost; nothing "
                "of its run is kept and its message is delivered again",
                getattr(self.task, "name", "?"),
                self.task_id,
            )
        if done:
            hook = _after_commit_hook
            if hook is not None:
                hook(self)
            for fn in self.after_commit:
                try:
                    fn()
                except Exception:
                    logger.exception("pgq: an on_commit callback of task %s raised", self.task_id)
        return done

    def _commit(self) -> None:
        token = self.token
        if not self.completes or token is None:
            self.handle.commit()
            return
        query = _q(self.schema)["complete"]
        params = {"id": token.id, "lease": token.lease, "queue": token.queue, "xid": self._xid}
        try:
            if isinstance(self.handle, PsycopgHandle) and _fence_and_commit(
                self.conn, query, params
            ):
                return
            # A framework's transaction (SQLAlchemy, Django) ends through its own API: the
            # fence goes just before it.
            _one_or_none(self.conn, query, params)
        except psycopg.Error as exc:
            refused = self._refusal(exc, token)
            if refused is None:
                raise
            raise _Refusal(refused) from exc
        self.handle.commit()

    def _refusal(
        self, exc: psycopg.Error, token: Lease
    ) -> LeaseLost | TransactionRefused | NotPermitted | None:
        """What the fence's SQLSTATE (migration 0019) says, as pgq's error."""
        name = getattr(self.task, "name", "?")
        if exc.sqlstate == LEASE_LAPSED:
            return LeaseLost(
                f"pgq: atomic task {name}[{self.task_id}] not completed: its lease on "
                f"message {token.id} of queue {token.queue!r} lapsed and the message went "
                "to another delivery; its commit was refused, so nothing of its run is "
                "kept (its writes, result, chord count and follow-up tasks: another "
                "delivery's count)"
            )
        if exc.sqlstate == ANOTHER_TRANSACTION:
            return TransactionRefused(
                f"pgq: atomic task {name}[{self.task_id}] committed or rolled back pgq's "
                f"transaction on {self.handle.describe} itself: what it committed stays, "
                "the rest of its run is rolled back, and its delivery was not completed "
                "(it is delivered again)"
            )
        if exc.sqlstate == INSUFFICIENT_PRIVILEGE:
            # (a right revoked since this connection's open last asked: asked again next)
            known = _permitted.get(self.conn)
            if known is not None:
                known.pop(self.schema, None)
            return NotPermitted(
                f"pgq: atomic task {name}[{self.task_id}] not completed: its role "
                f"{self._role!r} on {self.handle.describe} may no longer end a delivery "
                f"in pgq's schema {self.schema!r} ({exc.diag.message_primary}); its commit "
                "was refused, so nothing of its run is kept, and its message is delivered "
                "again (give that role a worker's rights: docs/least-privilege.md, "
                "GRANT pgq_worker TO the role)"
            )
        return None

    def _lost(self, exc: BaseException | None) -> bool:
        """Whether the run's connection is gone (so is its transaction)."""
        conn: psycopg.Connection[Any] | None = getattr(self, "conn", None)
        if conn is not None and (conn.closed or conn.broken):
            return True
        return exc is not None and is_dead_connection(exc, conn)

    def _rollback_after_failure(self) -> None:
        try:
            self.handle.rollback()
        except Exception:  # the connection is gone: so is the transaction
            logger.debug("pgq: rollback after a failed commit failed", exc_info=True)

    def abandon(self) -> None:
        """A run refused as it opened: roll back only a transaction pgq began."""
        if self._open:
            self.finish(commit=False, report=False)
        else:
            self.handle.close()

    def _close_contexts(self) -> None:
        tokens, self._tokens = self._tokens, []
        if tokens:
            _current.reset(tokens[1])
            completing.leave(tokens[0])
        joined, self._joined = self._joined, None
        if joined is not None:
            joined.__exit__(None, None, None)


#: A test hook (pg_transport.testing's crash tests): called after each commit.
_after_commit_hook: Callable[[Run], object] | None = None


def _one(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any] | None = None
) -> tuple[Any, ...]:
    row = _one_or_none(conn, query, params)
    assert row is not None
    return row


def _one_or_none(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any] | None
) -> tuple[Any, ...] | None:
    # A cursor of pgq's own (the application may have set a row factory); unprepared
    # (the session may be a transaction pooler's).
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        row: tuple[Any, ...] | None = cur.execute(query, params, prepare=False).fetchone()
        return row


def _fence_and_commit(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> bool:
    """The fence (``query``, values bound client-side) and the COMMIT as one simple-query
    string: one round trip. A refused fence aborts the transaction and the server skips
    the COMMIT (the caller rolls back); its error is raised. False (nothing sent): the
    connection is not in a transaction of its own outside a pipeline."""
    with conn.lock:
        ready = (
            conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            and conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
        )
        if ready:
            text = psycopg.ClientCursor(conn).mogrify(query, params)
            conn.pgconn.send_query(f"{text};\nCOMMIT".encode(conn.info.encoding))
            results = conn.wait(generators.execute(conn.pgconn))
    if not ready:
        return False
    for result in results:
        if result.status == psycopg.pq.ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    return True


def _open_pipelined(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any]
) -> tuple[Any, ...]:
    """The run's BEGIN, ``query`` and the body's savepoint in one round trip; ``query``'s
    row (as text: what it answers is text and booleans).

    psycopg begins a transaction with a round trip of its own before the first statement
    (in a pipeline too): on an idle connection the three go instead as one simple-query
    string, ``query``'s values bound client-side (they are pgq's own: the schema name).
    A connection already in a transaction (the server check of its first run ran a
    statement) takes the pipeline: the query and the savepoint in one flight."""
    with conn.lock:
        idle = (
            conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            and conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
        )
        if idle:
            texts = _open_texts.get(conn)
            if texts is None:
                texts = _open_texts[conn] = {}
            encoding = conn.info.encoding
            key = (query, encoding, tuple(sorted(params.items())))
            data = texts.get(key)
            if data is None:
                text = psycopg.ClientCursor(conn).mogrify(query, params)
                data = texts[key] = f"BEGIN;\n{text};\n{SAVEPOINT}".encode(encoding)
            conn.pgconn.send_query(data)
            results = conn.wait(generators.execute(conn.pgconn))
    if idle:
        for result in results:
            if result.status == psycopg.pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        answer = results[1]
        return tuple(
            _text_value(answer.get_value(0, i), answer.ftype(i)) for i in range(answer.nfields)
        )
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        with conn.pipeline():
            cur.execute(query, params, prepare=False)
            conn.execute(SAVEPOINT, prepare=False)
        row: tuple[Any, ...] | None = cur.fetchone()
    assert row is not None
    return row


#: The type oid of boolean (pg_type).
_BOOL_OID = 16


def _text_value(value: bytes | None, oid: int) -> str | bool | None:
    """A simple query's text value: a boolean's ``t``/``f`` as one, anything else as text."""
    if value is None:
        return None
    return value == b"t" if oid == _BOOL_OID else value.decode()


#: The fence's SQLSTATEs (migration 0019): no row under the token; another transaction.
LEASE_LAPSED = "PQ001"
ANOTHER_TRANSACTION = "PQ002"
#: A right the fence needs was revoked (since the connection's open asked).
INSUFFICIENT_PRIVILEGE = "42501"


class _Refusal(Exception):
    """The fence refused the run's commit: ``error`` says why."""

    def __init__(self, error: LeaseLost | TransactionRefused | NotPermitted) -> None:
        super().__init__(str(error))
        self.error = error


class ConnectionLost(Exception):
    """The run's connection was lost as the run opened (terminated, reaped while idle,
    a server restart): not a refusal; the delivery is requeued."""


def open_run(task: Any) -> Run:
    """Begin ``task``'s run (step 1). What cannot be run on is refused here. A kept
    connection found dead (reaped while idle) is replaced once; lost again:
    :class:`ConnectionLost`."""
    schema = _broker_of(task.app)[0]
    for attempt in (1, 2):
        run = Run(task, handle_for(task), token_of(task.request), schema)
        try:
            run.open()
            return run
        except (TransactionRefused, psycopg.Error) as exc:
            run.abandon()
            conn = getattr(run, "conn", None)
            if conn is None or not (conn.closed or conn.broken):
                raise
            if attempt == 2:
                raise ConnectionLost(str(exc)) from exc
        except BaseException:
            run.abandon()
            raise
    raise AssertionError("unreachable")


def refuse(task: Any, reason: str) -> None:
    """Dead-letter ``task``'s delivery with ``reason``, under its fencing token, on the
    broker's own connection (a run that was refused has no transaction to do it in).
    Never raises: the worker's own dead-lettering of the Reject that follows is the
    fallback, with Celery's reason."""
    token = token_of(task.request)
    if token is None:
        return
    try:
        schema, connector = _broker_of(task.app)
        store = Store(connector, schema)
        dead = store.dead_letter(token, reason[:1000])
        if dead is not None:
            store.identify_dead_letter(
                dead, task_id=token.task, task_name=task.name, identity={}, reasons=[]
            )
    except Exception:
        logger.exception("pgq: could not dead-letter refused atomic task %s", token.task)
