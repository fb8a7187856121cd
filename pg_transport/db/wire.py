"""Named queries sent through libpq directly, for the statements that run per message.

psycopg's cursor costs tens of microseconds per statement in Python (its query and
prepared-statement bookkeeping, result objects), as much as a round trip on a local
socket. The statements pgq runs once per message (publish, claim) skip it: each is
prepared once per session under a name of ours, its parameters are dumped by psycopg's
own adapters, and its rows come back as libpq's text values for the caller to decode.

Behind a transaction pooler nothing is prepared: the statement is sent whole each time.

:func:`run_apart` sends several statements at once, each a transaction of its own
(libpq's pipeline mode): one round trip for all of them.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import abc, pq
from psycopg.adapt import PyFormat, Transformer

from pg_transport.db import waits
from pg_transport.db.params import render
from pg_transport.sql import to_positional

__all__ = ["Row", "Statement", "run_apart"]

Row = tuple["bytes | None", ...]

# What pgq keeps per connection, beside it rather than on it (psycopg's object is not
# ours to add attributes to): the statements prepared on its session, its adapters.
_prepared: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[bytes]] = (
    weakref.WeakKeyDictionary()
)
_transformers: weakref.WeakKeyDictionary[psycopg.Connection[Any], abc.Transformer] = (
    weakref.WeakKeyDictionary()
)

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_ONE_TEXT = [PyFormat.TEXT]


class Statement:
    """One named query of ``queries.sql``, ready to run through libpq."""

    def __init__(self, name: str, query: str) -> None:
        self.name = name
        text, self.params = to_positional(query)
        self.text = text.encode()
        # The text's digest in the name: one session may serve several schemas (a
        # process's pools are shared), whose statements of one name differ.
        digest = hashlib.blake2b(self.text, digest_size=6).hexdigest()
        self.key = f"pgq_{name}_{digest}".encode()

    def values(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> Any:
        """Parameters as libpq text values (None is NULL, which libpq's types omit):
        plain ones written directly (``params.py``), the rest by psycopg's dumpers."""
        if not self.params:
            return None  # (flush_wal, ping: nothing to dump)
        ordered = [params[n] for n in self.params]
        tx = _transformer(conn)
        if conn.info.encoding != "utf-8":
            return tx.dump_sequence(ordered, [PyFormat.TEXT] * len(ordered))
        return render(ordered, lambda value: tx.dump_sequence([value], _ONE_TEXT)[0])

    def execute(
        self, conn: psycopg.Connection[Any], params: Mapping[str, Any], *, prepare: bool
    ) -> list[Row]:
        """Run it on ``conn`` and wait; the rows (as text), or the server's error."""
        pgconn = conn.pgconn
        values = self.values(conn, params)
        if prepare and self.ready(conn):
            idle = pgconn.transaction_status == pq.TransactionStatus.IDLE
            result = pgconn.exec_prepared(self.key, values)
            if idle and _deallocated(result):
                # Outside a transaction the failed call changed nothing: prepare again.
                self.forget(conn)
                self.ready(conn)
                result = pgconn.exec_prepared(self.key, values)
        else:
            result = pgconn.exec_params(self.text, values)
        return rows(result, conn)

    def send(
        self, conn: psycopg.Connection[Any], params: Mapping[str, Any], *, prepare: bool
    ) -> None:
        """Put it on the wire without waiting (``conn`` in non-blocking mode)."""
        pgconn = conn.pgconn
        values = self.values(conn, params)
        if prepare and self.ready(conn):
            pgconn.send_query_prepared(self.key, values)
        else:
            pgconn.send_query_params(self.text, values)

    def forget(self, conn: psycopg.Connection[Any]) -> None:
        """Forget that it was prepared on ``conn``: it is gone. psycopg sends ``DEALLOCATE
        ALL`` on a session where it prepared statements of its own once a DROP, ALTER or
        ROLLBACK ran there, and ours go with them (those prepared since stay)."""
        prepared = _prepared.get(conn)
        if prepared is not None:
            prepared.discard(self.key)

    def ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Prepare it on this session once (a blocking round trip, the first time)."""
        prepared = _prepared.get(conn)
        if prepared is None:
            prepared = _prepared[conn] = set()
        if self.key not in prepared:
            check(conn.pgconn.prepare(self.key, self.text), conn)
            prepared.add(self.key)
        return True


def _deallocated(result: pq.abc.PGresult) -> bool:
    """Whether a call failed because its prepared statement is gone (SQLSTATE 26000)."""
    if result.status in _OK:
        return False
    return result.error_field(pq.DiagnosticField.SQLSTATE) == b"26000"


def run_apart(
    conn: psycopg.Connection[Any],
    steps: Sequence[tuple[Statement, Mapping[str, Any]]],
    *,
    prepare: bool,
) -> list[list[Row] | psycopg.Error]:
    """:func:`_run_apart`; the steps that found their prepared statement gone (see
    :meth:`Statement.forget`) did not run, and are prepared and run again once."""
    outcomes = _run_apart(conn, steps, prepare=prepare)
    gone = [
        n for n, o in enumerate(outcomes) if isinstance(o, psycopg.errors.InvalidSqlStatementName)
    ]
    if prepare and gone and not conn.closed:
        for n in gone:
            steps[n][0].forget(conn)
        again = _run_apart(conn, [steps[n] for n in gone], prepare=True)
        for n, outcome in zip(gone, again, strict=True):
            outcomes[n] = outcome
    return outcomes


def _run_apart(
    conn: psycopg.Connection[Any],
    steps: Sequence[tuple[Statement, Mapping[str, Any]]],
    *,
    prepare: bool,
) -> list[list[Row] | psycopg.Error]:
    """Run ``steps`` (statement, parameters) on ``conn`` in order, each in a transaction
    of its own, all sent at once: one round trip (libpq's pipeline mode, a
    synchronization point after each step, where it commits as the session says:
    durable by default, before the next one begins).

    Each step's outcome comes back: its rows (as text) once it committed, or its error.
    A step runs whatever the steps before it did. Should the connection be lost, the
    steps not answered yet get the OperationalError; ``conn`` is then closed (so too
    when reading the answers fails otherwise: nothing raised here says a step failed
    that may have committed). Waits with the GIL released, as psycopg does (libpq's
    blocking read would hold it), on ``poll`` (:mod:`~pg_transport.db.waits`).

    (A synchronization point per step, not BEGIN … COMMIT around each but the last
    under one: measured, the explicit transactions cost 3-4 times as much more than a
    lone statement, the points' extra write included.)"""
    pgconn = conn.pgconn
    if prepare:  # (a blocking round trip, once per session: not inside the pipeline)
        for statement, _ in steps:
            statement.ready(conn)
    outcomes: list[list[Row] | psycopg.Error] = []
    sent = False
    pgconn.enter_pipeline_mode()
    try:
        for statement, params in steps:
            statement.send(conn, params, prepare=prepare)
            pgconn.pipeline_sync()
        sent = True
        send_buffered(pgconn)
        for _ in steps:
            outcomes.append(_step(conn))
    except psycopg.OperationalError as lost:  # the connection, with what was unanswered
        outcomes += [lost] * (len(steps) - len(outcomes))
        conn.close()
    except Exception as exc:
        if not sent:
            raise
        # Sent, and reading the answers failed otherwise (a wait refused, a bug): the
        # steps may have committed, their answers are unread. That is what a lost
        # connection leaves, and it is reported so (the session closed): the callers'
        # keys make their retries safe (a publish sent again finds its row taken),
        # where this exception would report a committed publish as failed.
        outcomes += [_unread(exc)] * (len(steps) - len(outcomes))
        conn.close()
    finally:
        _leave_pipeline(conn)
    return outcomes


def _step(conn: psycopg.Connection[Any]) -> list[Row] | psycopg.Error:
    """One step's results, up to its synchronization point: its rows, or the first
    error (the statement's, or its commit's)."""
    found: list[Row] | psycopg.Error = []
    while (result := _next_result(conn)).status != pq.ExecStatus.PIPELINE_SYNC:
        if isinstance(found, psycopg.Error):
            continue  # (the commands skipped after it: PIPELINE_ABORTED)
        if result.status in _OK:
            found = rows(result, conn)
        else:
            found = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    return found


def send_buffered(pgconn: pq.abc.PGconn) -> None:
    """Write out what libpq still holds of the statements sent (a connection in
    non-blocking mode may keep part of them), waiting until the socket takes it."""
    while pgconn.flush():
        waits.writable(pgconn.socket, 1.0)


def _next_result(conn: psycopg.Connection[Any]) -> pq.abc.PGresult:
    """A pipeline's next result, waited for with the GIL released; OperationalError if
    the connection is lost first."""
    pgconn = conn.pgconn
    while True:
        while pgconn.is_busy():
            if pgconn.status == pq.ConnStatus.BAD:
                raise _lost(conn)
            waits.readable((pgconn.socket,), None)
            pgconn.consume_input()  # (OperationalError on a dead socket)
        result = pgconn.get_result()
        if result is not None:
            return result
        if pgconn.status == pq.ConnStatus.BAD:
            raise _lost(conn)
        # None: the end of one command's results; the next one's follow.


def _leave_pipeline(conn: psycopg.Connection[Any]) -> None:
    pgconn = conn.pgconn
    if pgconn.pipeline_status == pq.PipelineStatus.OFF:
        return
    try:
        pgconn.exit_pipeline_mode()
    except psycopg.Error:
        conn.close()  # answers left unread (interrupted): not reusable


def _unread(cause: Exception) -> psycopg.OperationalError:
    lost = psycopg.OperationalError(
        f"the connection was closed: reading the server's answers failed ({cause!r})"
    )
    lost.__cause__ = cause
    return lost


def _lost(conn: psycopg.Connection[Any]) -> psycopg.OperationalError:
    message = conn.pgconn.get_error_message().strip()
    return psycopg.OperationalError(message or "the connection to the server was lost")


def rows(result: pq.abc.PGresult, conn: psycopg.Connection[Any]) -> list[Row]:
    check(result, conn)
    fields = range(result.nfields)
    return [tuple(result.get_value(r, c) for c in fields) for r in range(result.ntuples)]


def check(result: pq.abc.PGresult, conn: psycopg.Connection[Any]) -> None:
    """Raise the server's error as psycopg would (a dead session as OperationalError)."""
    if result.status in _OK:
        return
    if conn.pgconn.status == pq.ConnStatus.BAD:
        raise _lost(conn)
    raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)


def _transformer(conn: psycopg.Connection[Any]) -> abc.Transformer:
    tx = _transformers.get(conn)
    if tx is None:
        tx = _transformers[conn] = Transformer(conn)
    return tx
