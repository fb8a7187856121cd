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

import select
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import abc, pq
from psycopg.adapt import PyFormat, Transformer

from pg_transport.sql import to_positional

__all__ = ["Row", "Statement", "run_apart"]

Row = tuple["bytes | None", ...]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


class Statement:
    """One named query of ``queries.sql``, ready to run through libpq."""

    def __init__(self, name: str, query: str) -> None:
        self.name = name
        text, self.params = to_positional(query)
        self.text = text.encode()
        self.key = f"pgq_{name}".encode()

    def values(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> Any:
        """Parameters as libpq text values (None is NULL, which libpq's types omit)."""
        if not self.params:
            return None  # (BEGIN, COMMIT: nothing to dump)
        formats = [PyFormat.TEXT] * len(self.params)
        return _transformer(conn).dump_sequence([params[n] for n in self.params], formats)

    def execute(
        self, conn: psycopg.Connection[Any], params: Mapping[str, Any], *, prepare: bool
    ) -> list[Row]:
        """Run it on ``conn`` and wait; the rows (as text), or the server's error."""
        pgconn = conn.pgconn
        values = self.values(conn, params)
        if prepare and self.ready(conn):
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

    def ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Prepare it on this session once (a blocking round trip, the first time)."""
        prepared: set[bytes] | None = getattr(conn, "_pgq_prepared", None)
        if prepared is None:
            prepared = set()
            conn._pgq_prepared = prepared  # type: ignore[attr-defined]
        if self.key not in prepared:
            check(conn.pgconn.prepare(self.key, self.text), conn)
            prepared.add(self.key)
        return True


def run_apart(
    conn: psycopg.Connection[Any],
    steps: Sequence[tuple[Statement, Mapping[str, Any]]],
    *,
    prepare: bool,
) -> list[psycopg.Error | None]:
    """Run ``steps`` (statement, parameters) on ``conn`` in order, each in a transaction
    of its own, all sent at once: one write and one round trip (libpq's pipeline mode,
    one synchronization point).

    Every step but the last is wrapped in BEGIN … COMMIT, so it commits (as the session
    says: durable by default) before the next one begins; the last commits at the
    synchronization point. Each step's error comes back, None for one that committed
    (rows are not read: statements run for their effect). A failed step ends the run:
    the steps after it did not run and get its error. Should the connection be
    lost, the steps not answered yet get the OperationalError; ``conn`` is then closed.
    Waits with the GIL released, as psycopg does (libpq's blocking read would hold it)."""
    pgconn = conn.pgconn
    last = len(steps) - 1
    if prepare:  # (a blocking round trip, once per session: not inside the pipeline)
        for statement in [_BEGIN, _COMMIT] if last else []:
            statement.ready(conn)
        for statement, _ in steps:
            statement.ready(conn)
    # The step each command sent belongs to (its BEGIN, its statement, its COMMIT).
    commands: list[int] = []
    outcomes: list[psycopg.Error | None] = [None] * len(steps)
    pgconn.enter_pipeline_mode()
    try:
        for index, (statement, params) in enumerate(steps):
            if index < last:
                _BEGIN.send(conn, {}, prepare=prepare)
                statement.send(conn, params, prepare=prepare)
                _COMMIT.send(conn, {}, prepare=prepare)
                commands += (index, index, index)
            else:
                statement.send(conn, params, prepare=prepare)
                commands.append(index)
        pgconn.pipeline_sync()
        send_buffered(pgconn)
        # Every command's result, and the synchronization point's.
        results, lost = _results(conn, len(commands) + 1)
        failure: psycopg.Error | None = None
        # (Fewer results than commands if the connection was lost: those are not read.)
        for index, result in zip(commands, results, strict=False):
            if result.status not in _OK:
                # The first error; every command after it was skipped (PIPELINE_ABORTED).
                failure = failure or psycopg.errors.error_from_result(
                    result, encoding=conn.info.encoding
                )
                outcomes[index] = failure
        if lost is not None:
            # A step is known committed once its COMMIT's result is read; the last
            # step, once the synchronization point's is.
            unknown = set(commands[len(results):]) | {last}
            for index in unknown:
                outcomes[index] = outcomes[index] or lost
            conn.close()
            return outcomes
        if pgconn.transaction_status == pq.TransactionStatus.INERROR:
            pgconn.exit_pipeline_mode()
            check(pgconn.exec_(b"ROLLBACK"), conn)  # a step failed inside its BEGIN
    finally:
        _leave_pipeline(conn)
    return outcomes


# A step that has others after it runs between these two (see run_apart).
_BEGIN = Statement("begin", "BEGIN")
_COMMIT = Statement("commit", "COMMIT")


def send_buffered(pgconn: pq.abc.PGconn) -> None:
    """Write out what libpq still holds of the statements sent (a connection in
    non-blocking mode may keep part of them), waiting until the socket takes it."""
    while pgconn.flush():
        select.select([], [pgconn.socket], [], 1.0)


def _results(
    conn: psycopg.Connection[Any], count: int
) -> tuple[list[pq.abc.PGresult], psycopg.OperationalError | None]:
    """The next ``count`` results of a pipeline, waited for with the GIL released; if
    the connection is lost first, those read before and the error."""
    pgconn = conn.pgconn
    results: list[pq.abc.PGresult] = []
    try:
        while len(results) < count:
            while pgconn.is_busy():
                if pgconn.status == pq.ConnStatus.BAD:
                    return results, _lost(conn)
                select.select([pgconn.socket], [], [])
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is not None:
                results.append(result)
            elif pgconn.status == pq.ConnStatus.BAD:
                return results, _lost(conn)
            # None: the end of one command's results; the next one's follow.
    except psycopg.OperationalError as exc:  # consume_input on a dead socket
        return results, exc
    return results, None


def _leave_pipeline(conn: psycopg.Connection[Any]) -> None:
    pgconn = conn.pgconn
    if pgconn.pipeline_status == pq.PipelineStatus.OFF:
        return
    try:
        pgconn.exit_pipeline_mode()
    except psycopg.Error:
        conn.close()  # answers left unread (interrupted): not reusable


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
    tx: abc.Transformer | None = getattr(conn, "_pgq_tx", None)
    if tx is None:
        tx = Transformer(conn)
        conn._pgq_tx = tx  # type: ignore[attr-defined]
    return tx
