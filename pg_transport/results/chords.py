"""Native chords: the header's parts are counted in Postgres, no ``chord_unlock`` task.

A chord is a fan-in barrier (``barrier`` and ``barrier_part``, :mod:`pg_transport.fanin.state`'s
tables and counting statements) named ``celery-chord:<group id>``, armed by
``apply_chord`` before the header is sent, with the chord's body as its callback and the
header's task ids in its metadata. Each header task's end is one transaction on the
broker's database:

* its result row is stored (the part's ``store_result`` is deferred to here), its waiters
  notified at commit;
* the part is recorded once (``barrier_part`` key: a redelivered part counts no more);
* a success decrements ``remaining``; the part that takes it to 0 flips the chord
  ``armed -> fired`` and inserts the body's message with the header's results, in part
  order, in the same transaction: a worker killed anywhere in it leaves either nothing
  (the part is delivered again, its lease lapsing) or everything (the redelivery is
  recorded as a duplicate and fires nothing);
* a failure flips ``armed -> failed`` (once, whichever part fails first), stores the body's
  result as FAILURE with a ``ChordError`` naming the part, and inserts the messages of the
  body's errbacks (``link_error``) in the same transaction; errbacks Celery calls in
  process (those taking ``request, exc, traceback``) are called once it committed.

Messages are built as Celery's ``apply_async`` would: an immutable body or errback
(``.si()``) gets no header results or body id; the body's parent is the part that
completed the chord; errbacks sent as tasks are the failed body's child group.

Each ``apply_chord`` is a run: a frozen chord applied again (same group id) resets its
fan-in. A generator header is streamed: armed with an unknown size (:data:`UNSIZED`),
its parts placed by arrival with their group index, sized by ``set_chord_size``.
``add_to_chord`` adds a part after the header's while the chord is armed and sized.

A body that is a chain, group or chord is sent by Celery's canvas, its messages joined to
the completing part's transaction (``pg_transport.transaction``); its failure is Celery's
``chord_error_from_stack``, after the commit.

It needs the queue and the results in one database and schema (broker ``pgq://`` on the
result backend's database and schema, the default). Anything else (nested groups in a
listed header, another broker) takes Celery's own way (``chord_unlock``).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from celery import states
from celery.canvas import Signature, maybe_signature
from celery.exceptions import ChordError
from celery.result import AsyncResult
from celery.utils import uuid
from celery.utils.functional import _regen
from psycopg.types.json import Jsonb

import pg_transport
from pg_transport.config import MAX_SECONDS
from pg_transport.db import completing
from pg_transport.db.pool import url_to_conninfo
from pg_transport.fanin.backend import Backend as FaninDb
from pg_transport.fanin.backend import backend_for, broker_url, uses_pgq
from pg_transport.fanin.codec import dumps as json_dumps
from pg_transport.fanin.codec import loads as json_loads
from pg_transport.fanin.messages import Outgoing, task_message
from pg_transport.fanin.state import publish_outgoing

__all__ = ["CHORD_PREFIX", "UNSIZED", "ChordHost", "Chords", "PartOutcome"]

logger = logging.getLogger("pg_transport.results")

CHORD_PREFIX = "celery-chord:"
# A chord waits for its parts as long as their results live: the barrier sweep never
# expires it (its result rows expire on their own).
_FOREVER = float(MAX_SECONDS)
#: The total of a streamed chord (a generator header) until ``set_chord_size`` tells its
#: size: every part counts against it, none can take it to 0.
UNSIZED = 2**31 - 1
# Group ids of the streamed chords this process armed and has not sized yet: Celery sizes
# every chord, in the process that applies it; only these need the round trip.
_unsized_here: set[str] = set()


@dataclass(frozen=True)
class PartOutcome:
    """What one part's end did to its chord."""

    recorded: bool
    fired: bool = False
    failed: bool = False


def _plain_task(body: Any) -> bool:
    if not isinstance(body, Signature) or body.get("subtask_type"):
        return False
    return not any(body.options.get(k) for k in ("chain", "chord", "group_id_chord"))


class ChordHost(Protocol):
    """What native chords use of the result backend that owns them, and nothing else of
    it: its app, schema and queries (``results.sql``), and how it stores, reads and fails
    a result row. The backend drives chords through :class:`Chords`' public methods; the
    chords reach back only through this, so neither reads the other's internals."""

    @property
    def app(self) -> Any: ...

    @property
    def schema(self) -> str: ...

    @property
    def q(self) -> Mapping[str, str]: ...

    def store_state_row(
        self, conn: psycopg.Connection[Any], task_id: str, meta: dict[str, Any]
    ) -> None: ...

    def decode_row(
        self, content_type: str, content_encoding: str, meta: bytes
    ) -> dict[str, Any]: ...

    def failure_meta(self, task_id: str, exc: BaseException) -> dict[str, Any]: ...

    def errback_is_in_process(self, sig: Any) -> bool: ...

    def chord_error_from_stack(self, callback: Any, exc: BaseException | None = None) -> Any: ...


class Chords:
    """The native chords of one result backend (a :class:`ChordHost`) whose sessions go
    to ``conninfo``; ``enabled`` is its ``native_chords`` option."""

    def __init__(self, backend: ChordHost, *, enabled: bool, conninfo: str) -> None:
        self.backend = backend
        self.app = backend.app
        self._enabled = enabled
        self._conninfo = conninfo
        self._usable: bool | None = None

    # -- can this app use them ----------------------------------------------------------
    def usable(self) -> bool:
        """The broker is pgq on the result backend's database and schema."""
        if self._usable is None:
            self._usable = (
                self._enabled
                and uses_pgq(self.app)
                and url_to_conninfo(broker_url(self.app)) == self._conninfo
                and self.db.schema == self.backend.schema
            )
        return self._usable

    @property
    def db(self) -> FaninDb:
        return backend_for(self.app)

    def takes(self, results: Sequence[Any], body: Any) -> bool:
        """Whether a chord of ``results`` (the frozen header) and ``body`` is native."""
        if not (self.usable() and isinstance(body, Signature)):
            return False
        if isinstance(results, _regen):
            # A generator header is streamed: nothing of it is read before its parts are
            # sent (each part is checked as it returns, by its group index).
            return True
        return all(type(r) is AsyncResult or type(r) is self.app.AsyncResult for r in results)

    # -- arming -------------------------------------------------------------------------
    def arm(self, group_id: str, results: Sequence[Any], body: Signature) -> int:
        """Arm the chord's fan-in (before its header is sent) for a new run: a chord
        applied again (frozen, so under the same group id) starts over, as a chord of
        Celery's Redis backend does. A generator header (``results`` lazy) is not read:
        its size comes with :meth:`set_size`. Returns the run's number."""
        backend = self.backend
        streamed = isinstance(results, _regen)
        metadata: dict[str, Any] = {"kind": "celery-chord"}
        if streamed:
            metadata.update(ids=[], streamed=True)
        else:
            metadata["ids"] = [r.id for r in results]
        params = {
            "id": CHORD_PREFIX + group_id,
            "total": UNSIZED if streamed else len(results),
            "callback": json_dumps(dict(body)),
            "metadata": Jsonb(metadata),
            "ttl": _FOREVER,
            "stuck_timeout": _FOREVER,
        }

        def work(conn: psycopg.Connection[Any]) -> int:
            with conn.transaction():
                row = conn.execute(backend.q["chord_arm"], params).fetchone()
                conn.execute(backend.q["chord_forget_parts"], {"id": params["id"]})
            return int(row[0]) if row else 1

        run: int = self.db.run(work)
        if streamed:
            _unsized_here.add(group_id)
        return run

    def set_size(self, group_id: str, size: int) -> None:
        """A streamed chord's size, told before its header's last part is sent. Parts
        that returned already counted; if they are all of them, the body fires now."""
        if group_id not in _unsized_here:
            return  # a listed header's size is known since it was armed
        db = self.db
        backend = self.backend
        chord_id = CHORD_PREFIX + group_id
        after: list[Any] = []

        def work(conn: psycopg.Connection[Any]) -> None:
            after.clear()
            with conn.transaction():
                row = conn.execute(
                    backend.q["chord_set_size"],
                    {"id": chord_id, "size": int(size), "unsized": UNSIZED},
                ).fetchone()
                if row is not None and int(row[0]) == 0:
                    try:
                        self._fire(db, conn, group_id, None)
                    except _Unstored as exc:
                        self._fail_chord(db, conn, group_id, str(exc), after)

        db.run(work)
        _unsized_here.discard(group_id)
        for call in after:
            call()

    def add(self, group_id: str, task_id: str) -> None:
        """``add_to_chord``: one more part, whose result comes after the header's."""
        backend = self.backend
        chord_id = CHORD_PREFIX + group_id
        params = {"id": chord_id, "task_id": task_id, "unsized": UNSIZED}

        def work(conn: psycopg.Connection[Any]) -> Any:
            with conn.transaction():
                if conn.execute(backend.q["chord_add"], params).fetchone() is not None:
                    return None
                return conn.execute(backend.q["chord_status"], params).fetchone()

        refused = self.db.run(work)
        if refused is None:
            return
        status, sized = refused if refused else (None, True)
        if status is None:
            why = "it is not a native chord of this backend (or its state is gone)"
        elif status != "armed":
            why = f"it is {status} already: a part can only be added before the body runs"
        elif not sized:
            why = "its header is a generator whose size is not known yet"
        else:
            why = f"task {task_id} was added to it already"
        raise ChordError(f"cannot add task {task_id} to chord {group_id}: {why}")

    # -- a part refused as it was sent --------------------------------------------------
    def refused(self, group_id: str, task_id: str, exc: BaseException) -> bool:
        """A part of the chord's header was refused by the transport as it was sent
        (``exc``, which its caller gets): it will never run, so the chord fails now, as
        a failed part fails it (the body's ``ChordError``, its errbacks), once. The parts
        sent before it run and count against a failed chord: nothing fires. Returns
        whether this call failed it (False: not an armed chord of this backend).

        Apart from whatever the refused publish was part of. The chord was armed on a
        session of pgq's own (``arm``), committed there: the flip, the body's result
        and the errbacks' messages are one transaction on such a session too, never
        the caller's (``pg_transport.transaction()``, ``pg_transport.batch()``, an
        atomic task's run), which holds no lock of the chord's and may still roll
        back. What Celery sends once it committed (a canvas body's failure, errbacks
        called in process) is sent from a context of its own (:func:`_apart`): in the
        caller's, it would join the caller's transaction or batch and vanish with it
        while the chord stays failed."""
        db = self.db
        after: list[Any] = []
        reason = f"Dependency {task_id} was refused as it was sent: {exc!r}"

        def work(conn: psycopg.Connection[Any]) -> PartOutcome:
            after.clear()
            with conn.transaction():
                return self._fail_chord(db, conn, group_id, reason, after, cause=exc)

        outcome: PartOutcome = db.run(work)
        _unsized_here.discard(group_id)
        for call in after:
            _apart(call)
        return outcome.failed

    # -- a part's end ---------------------------------------------------------------------
    def part_returned(
        self,
        request: Any,
        state: str,
        result: Any,
        stored: Mapping[str, Any] | None,
    ) -> PartOutcome:
        """Store the part's ``stored`` meta (if any), count the part, fire or fail the
        chord: one transaction. Idempotent, so retried on a dead connection."""
        db = self.db
        task_id = str(request.id)
        after: list[Any] = []

        def work(conn: psycopg.Connection[Any]) -> PartOutcome:
            after.clear()
            with conn.transaction():
                if stored is not None:
                    self.backend.store_state_row(conn, task_id, dict(stored))
                if state == states.SUCCESS:
                    return self._succeeded(db, conn, request, after)
                return self._failed(db, conn, request, result, after)

        run = completing.connection()
        # An atomic task's part: counted in its run's transaction (a savepoint there),
        # committed with its writes, its result and its delivery's end, or not at all.
        outcome: PartOutcome = work(run) if run is not None else db.run(work)
        for call in after:
            call()
        return outcome

    def _record(self, conn: psycopg.Connection[Any], request: Any, outcome: str, note: Any) -> bool:
        index = getattr(request, "group_index", None)
        params = {
            "id": CHORD_PREFIX + str(request.group),
            "task_id": str(request.id),
            "index": index if isinstance(index, int) else None,
            "outcome": outcome,
            "result": json_dumps(note),
        }
        q = self.backend.q
        if conn.execute(q["chord_part_record"], params).fetchone() is not None:
            return True
        # A part of a streamed header, placed under the chord's row lock.
        if conn.execute(q["chord_lock_streamed"], params).fetchone() is None:
            return False
        return conn.execute(q["chord_part_record_streamed"], params).fetchone() is not None

    def _succeeded(
        self,
        db: FaninDb,
        conn: psycopg.Connection[Any],
        request: Any,
        after: list[Any],
    ) -> PartOutcome:
        group_id = str(request.group)
        if not self._record(conn, request, "succeeded", None):
            return PartOutcome(recorded=False)
        row = conn.execute(db.q["barrier_count_part"], {"id": CHORD_PREFIX + group_id}).fetchone()
        if row is None or int(row[0]) > 0:
            return PartOutcome(recorded=True)
        try:
            self._fire(db, conn, group_id, request)
        except _Unstored as exc:
            # A part succeeded without storing its result (ignore_result): the body can
            # never get its arguments. The chord fails, as a join would, once.
            return self._fail_chord(db, conn, group_id, str(exc), after)
        return PartOutcome(recorded=True, fired=True)

    def _fire(
        self, db: FaninDb, conn: psycopg.Connection[Any], group_id: str, request: Any
    ) -> None:
        """Send the body with the header's results, sent (as Celery sends it) from the
        part that completed the chord: its parent, its root's child."""
        values = self._header_values(conn, group_id)
        fired = conn.execute(
            self.backend.q["chord_fire"], {"id": CHORD_PREFIX + group_id}
        ).fetchone()
        if fired is None:  # unreachable: we hold the row lock at remaining = 0, armed
            raise ChordError(f"chord {group_id} reached 0 but could not fire")
        if len(values) != int(fired[1]):
            # Never fire with a result missing: the whole completion rolls back.
            raise ChordError(f"chord {group_id} reached 0 with {len(values)} of {fired[1]} results")
        body = Signature.from_dict(json_loads(fired[0]), app=self.app)
        parent_id = getattr(request, "id", None)
        root_id = getattr(request, "root_id", None) or parent_id
        if not _plain_task(body):
            # A chain, group or chord (or a task with a chain to follow): Celery's canvas
            # sends it, as Celery's backends do (body.delay(results)), its messages
            # joined to this transaction: they commit with the chord's flip, or not at all.
            with pg_transport.transaction(conn):
                body.apply_async((values,), parent_id=parent_id, root_id=root_id)
            return
        out = task_message(
            self.app,
            body,
            args_prefix=(values,),
            parent_id=parent_id,
            root_id=root_id,
        )
        publish_outgoing(db, conn, out, "pgq-chord", group_id, str(fired[2]), "callback")

    def _header_values(self, conn: psycopg.Connection[Any], group_id: str) -> list[Any]:
        # A statement of its own, after the decrement's lock: under READ COMMITTED it sees
        # every part (and result row) whose transaction committed before ours got the lock.
        rows = conn.execute(
            self.backend.q["chord_results"], {"id": CHORD_PREFIX + group_id}
        ).fetchall()
        values: list[Any] = []
        for task_id, status, content_type, content_encoding, meta in rows:
            if status != states.SUCCESS:
                raise _Unstored(
                    f"chord {group_id}: part {task_id} succeeded but its result is "
                    f"{status or 'not stored (ignore_result?)'}"
                )
            decoded = self.backend.decode_row(content_type, content_encoding, bytes(meta))
            values.append(decoded["result"])
        return values

    def _failed(
        self,
        db: FaninDb,
        conn: psycopg.Connection[Any],
        request: Any,
        result: Any,
        after: list[Any],
    ) -> PartOutcome:
        group_id, task_id = str(request.group), str(request.id)
        if not self._record(conn, request, "failed", repr(result)):
            return PartOutcome(recorded=False)
        return self._fail_chord(
            db, conn, group_id, f"Dependency {task_id} raised {result!r}", after, cause=result
        )

    def _fail_chord(
        self,
        db: FaninDb,
        conn: psycopg.Connection[Any],
        group_id: str,
        reason: str,
        after: list[Any],
        cause: Any = None,
    ) -> PartOutcome:
        """Flip the chord failed (once), store its body's ChordError, send its errbacks.
        The part's exception is the error's ``__cause__``, as Celery sets it (a group body's
        tasks fail with it).

        What that takes in Python (the body, its errbacks' messages, its result: Celery's
        routing, serializers and clock, some of them looked at for the first time in this
        process) is made ready before the flip, which every other part of the chord then
        waits on until this transaction ends: under the row lock only SQL runs. Read
        before the lock, the chord may be armed again meanwhile (a frozen chord applied
        again: a new run); then it is made ready again, under the lock. (The chord's last
        part returning without its result stored, or a streamed chord sized after such a
        part, took the row with its count: that rare failure is made ready under it.)"""
        chord_id = CHORD_PREFIX + group_id
        ready = self._failure(conn, group_id, reason, cause)
        row = conn.execute(db.q["barrier_fail"], {"id": chord_id, "reason": reason}).fetchone()
        if row is None:  # failed by another part already, or fired
            return PartOutcome(recorded=True)
        if ready is None or ready.run != _run_of(row[1]):
            ready = self._failure(conn, group_id, reason, cause, armed=False)
            if ready is None:  # unreachable: the flip above returned the row
                raise ChordError(f"chord {group_id} failed but is gone")
        body, error = ready.body, ready.error
        if ready.canvas:
            # Celery's own failure of a canvas body (each task of a group failed, a chain's
            # rest failed, their errbacks called), once the flip has committed.
            after.append(lambda: _fail_canvas_body(self.backend, body, error))
            return PartOutcome(recorded=True, failed=True)
        request = _fake_request(body)
        after.extend(lambda s=sig: _call_quietly(s, request, error) for sig in ready.calls)
        for suffix, out in ready.sends:
            publish_outgoing(db, conn, out, "pgq-chord", group_id, ready.run, suffix)
        if ready.meta is not None:
            meta = dict(ready.meta)
            if ready.sends:
                # As Celery records it: the errbacks sent as tasks are one group, the
                # failed body's child (GroupResult.as_tuple's shape). Written as tuples,
                # not built as result objects: an AsyncResult subscribes its task to this
                # process's result listener (a session, a LISTEN, a thread to start, this
                # thread's backend to build), for an errback nobody here waits for.
                ids = [((out.task_id, None), None) for _, out in ready.sends]
                meta["children"] = [((uuid(), None), ids)]
            self.backend.store_state_row(conn, str(body.id), meta)
        return PartOutcome(recorded=True, failed=True)

    def _failure(
        self,
        conn: psycopg.Connection[Any],
        group_id: str,
        reason: str,
        cause: Any,
        *,
        armed: bool = True,
    ) -> _Failure | None:
        """The chord's failure made ready from its row (read, not locked): None if there
        is no row, or (``armed``) if it is not armed (fired or failed: nothing to do)."""
        found = conn.execute(
            self.backend.q["chord_callback"], {"id": CHORD_PREFIX + group_id}
        ).fetchone()
        if found is None or (armed and found[2] != "armed"):
            return None
        body = Signature.from_dict(json_loads(found[0]), app=self.app)
        error = ChordError(reason)
        if isinstance(cause, Exception):
            error.__cause__ = cause
        run = str(found[1])
        if not _plain_task(body):
            return _Failure(run, body, error, canvas=True)
        sends, calls = self._errbacks(body)
        meta = self.backend.failure_meta(str(body.id), error) if body.id else None
        return _Failure(run, body, error, sends=sends, calls=calls, meta=meta)

    def _errbacks(self, body: Signature) -> tuple[list[tuple[str, Outgoing]], list[Signature]]:
        """The body's errbacks, as Celery's chord_error_from_stack calls them: those
        taking (request, exc, traceback) are called in process, after commit (returned
        second); the others are sent as task messages with the body's id (unless
        immutable), as from the body (their parent and root), under the publish key's
        suffix each is given (returned first)."""
        sends: list[tuple[str, Outgoing]] = []
        calls: list[Signature] = []
        for n, errback in enumerate(body.options.get("link_error") or []):
            sig = maybe_signature(errback, app=self.app)
            if sig is None:
                continue
            if self.backend.errback_is_in_process(sig):
                calls.append(sig)
                continue
            out = task_message(
                self.app,
                sig.clone(),
                args_prefix=(body.id,),
                parent_id=body.id,
                root_id=body.id,
            )
            sends.append((f"errback-{n}", out))
        return sends, calls


@dataclass(frozen=True)
class _Failure:
    """A chord's failure, ready to be written: its run (the errbacks' publish keys name
    it), its body and the body's ChordError; a canvas body is failed by Celery after the
    commit; else the errbacks' messages (with their key suffixes), those called in
    process, and the body's FAILURE meta (None: the body has no id)."""

    run: str
    body: Signature
    error: ChordError
    canvas: bool = False
    sends: list[tuple[str, Outgoing]] = field(default_factory=list)
    calls: list[Signature] = field(default_factory=list)
    meta: dict[str, Any] | None = None


def _run_of(metadata: Any) -> str:
    """A chord's run as ``chord_callback`` reads it, from the metadata a flip returns."""
    if isinstance(metadata, str):
        metadata = json_loads(metadata)
    run = metadata.get("run", 1) if isinstance(metadata, Mapping) else 1
    return str(run)


def _apart(call: Callable[[], Any]) -> None:
    """Run ``call`` in an empty context: no ``pg_transport.transaction()`` block, batch
    or atomic run of the caller's (context variables, all of them) is open in it, so
    what it publishes or stores commits on pgq's own sessions."""
    contextvars.Context().run(call)


class _Unstored(ChordError):  # type: ignore[misc]  # Celery is untyped
    """A part's result is not in the table when the chord completes."""


def _fake_request(body: Signature) -> Any:
    from celery.app.task import Context

    return Context(
        {
            "id": body.id,
            "task": body.task,
            "args": body.args,
            "kwargs": body.kwargs,
            "errbacks": body.options.get("link_error") or [],
            "delivery_info": {},
        }
    )


def _fail_canvas_body(backend: ChordHost, body: Signature, error: ChordError) -> None:
    try:
        # Celery fails the body from the stack (its traceback): raised here, as the
        # Redis backend calls it while handling the chord's error.
        try:
            raise error
        except ChordError as exc:
            backend.chord_error_from_stack(body, exc)
    except Exception:  # as Celery's on_chord_part_return: logged, the chord stays failed
        logger.exception("failing chord body %r raised", body.task)


def _call_quietly(sig: Signature, request: Any, error: BaseException) -> None:
    try:
        sig(request, error, None)
    except Exception:  # as Celery: an errback that raises is logged, nothing else
        logger.exception("chord errback %r raised", sig.task)
