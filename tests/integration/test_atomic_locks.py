"""An atomic task's fence (the ``complete`` statement, migration 0019's function, in its
own transaction; a run sends it with its COMMIT) against the
worker's own statements, on real concurrent sessions (docs/design/exactly-once.md,
"Locks"): the worker never waits on the task's row lock, a renewal meeting it is not a
lost lease, and the settle after a commit or a rollback does what each needs."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from pg_transport import fencing
from pg_transport.atomic.run import ANOTHER_TRANSACTION, LEASE_LAPSED, _q
from pg_transport.message.rows import Lease
from tests.integration.conftest import Peek, PublishingStore


def claimed(store: PublishingStore, queue: str = "q") -> Lease:
    store.declare_queue(queue)
    store.publisher.publish(queue, {"body": "b", "headers": {"id": "t1"}}, priority=0)
    (row,) = store.claim([queue], [30.0], 1)
    return Lease(row.id, row.lease, queue, "t1")


def fence(
    conn: psycopg.Connection[Any], schema: str, token: Lease, xid: str | None = None
) -> str | None:
    """The fence in ``conn``'s transaction (of id ``xid``, default: the one open): None
    when it deleted the row, else the SQLSTATE it refused with (the transaction aborted)."""
    if xid is None:
        xid = str(one(conn, "SELECT pg_current_xact_id()::text"))
    params = {"id": token.id, "lease": token.lease, "queue": token.queue, "xid": xid}
    try:
        conn.execute(_q(schema)["complete"], params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def one(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def rows(pg_url: str, schema: str, store: PublishingStore) -> Any:
    peek = Peek(pg_url, schema)
    yield peek
    peek.conn.close()


def test_renewal_and_settle_skip_a_row_a_task_is_completing(
    store: PublishingStore, rows: Peek, pg_url: str, schema: str
) -> None:
    token = claimed(store)
    before = fencing.counts()["renewal"]
    with psycopg.connect(pg_url) as task:
        assert fence(task, schema, token) is None  # the row is locked by the task now
        # Neither statement waits (each would block until the commit otherwise): they
        # return while the task's transaction is still open.
        assert store.renew([(token, 30.0)]) == 1  # still held: being completed, not lost
        assert store.settle([token]) == []  # left alone: the commit may still come
        assert fencing.counts()["renewal"] == before
        task.commit()
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]
    # After the commit the worker's settle finds nothing: a no-op, not a refusal.
    assert store.settle([token]) == []
    assert fencing.counts()["renewal"] == before


def test_a_settle_after_a_rolled_back_run_releases_the_message_at_once(
    store: PublishingStore, rows: Peek, pg_url: str, schema: str
) -> None:
    token = claimed(store)
    with psycopg.connect(pg_url) as task:
        assert fence(task, schema, token) is None
        task.rollback()
    assert store.settle([token]) == [token.id]
    (again,) = store.claim(["q"], [30.0], 1)
    assert (again.id, again.lease) == (token.id, token.lease + 2)  # released, claimed anew
    # The old delivery can no longer complete it.
    with psycopg.connect(pg_url) as late:
        assert fence(late, schema, token) == LEASE_LAPSED


def test_the_fence_of_a_stale_delivery_waits_on_a_claim_and_then_finds_no_row(
    store: PublishingStore, rows: Peek, pg_url: str, schema: str
) -> None:
    """The reverse direction, short and allowed: the fence waits on a claim in progress
    (seen waiting in pg_stat_activity), re-reads the row under READ COMMITTED and finds
    it claimed again (another lease): no row, refused with LeaseLost's SQLSTATE."""
    token = claimed(store)
    rows.expire_leases()
    with psycopg.connect(pg_url) as claimer, psycopg.connect(pg_url) as task:
        # A claim's effect held open: what another worker's claim does to the row.
        claimer.execute(
            psycopg.sql.SQL(
                "UPDATE {}.message SET lease = lease + 1, visible_at = now() + interval '30 s'"
                " WHERE id = %s"
            ).format(psycopg.sql.Identifier(schema)),
            [token.id],
        )
        pid = task.info.backend_pid
        found: list[str | None] = []
        fencing_thread = threading.Thread(target=lambda: found.append(fence(task, schema, token)))
        fencing_thread.start()
        rows.wait_for_lock(pid, "the fence to wait on the claim's row lock")
        claimer.commit()
        fencing_thread.join(10)
        assert found == [LEASE_LAPSED]
        task.rollback()
    assert rows("SELECT lease FROM {schema}.message WHERE id = %s", token.id) == [
        (token.lease + 1,)
    ]


def test_the_fence_completes_only_in_the_transaction_the_run_opened(
    store: PublishingStore, rows: Peek, pg_url: str, schema: str
) -> None:
    """The open's transaction id is what the fence checks: a task that committed the
    run's transaction itself is refused (another transaction), the row left."""
    token = claimed(store)
    with psycopg.connect(pg_url) as task:
        opened = task.execute(_q(schema)["open"], {"schema": schema, "known": None}).fetchone()
        assert opened is not None and opened[1] == "read committed"
        assert opened[3] is True  # its role may end a delivery here
        task.commit()  # what a body committing pgq's transaction behind its back does
        assert fence(task, schema, token, str(opened[0])) == ANOTHER_TRANSACTION
        task.rollback()
        assert rows("SELECT count(*) FROM {schema}.message") == [(1,)]
        opened = task.execute(_q(schema)["open"], {"schema": schema, "known": None}).fetchone()
        assert opened is not None
        assert fence(task, schema, token, str(opened[0])) is None
        task.commit()
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_maintain_and_purge_skip_a_lapsed_row_a_task_is_completing(
    store: PublishingStore, rows: Peek, pg_url: str, schema: str
) -> None:
    """The delivery's lease lapsed and its message's TTL passed while its task's
    transaction holds the row (the fence ran, the commit has not): purge and maintain's
    expiry would take such a row, and must skip it while it is locked, not wait for the
    commit (they return while the lock is held; one seen waiting on a lock in
    pg_stat_activity fails the test)."""
    token = claimed(store)
    rows(
        "UPDATE {schema}.message SET visible_at = now() - interval '1 second',"
        " expires_at = now() - interval '1 second' WHERE id = %s",
        token.id,
    )
    with psycopg.connect(pg_url) as task:
        assert fence(task, schema, token) is None  # the row is locked by the task now
        answers: dict[str, Any] = {}
        done = threading.Event()

        def housekeeping() -> None:
            try:
                answers["maintain"] = store.maintain(["q"])
                answers["purge"] = store.purge("q")
            finally:
                done.set()

        worker = threading.Thread(target=housekeeping, daemon=True)
        worker.start()
        waiting: list[tuple[Any, ...]] = []
        while not done.wait(0.02):
            waiting = rows(
                "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'"
            )
            if waiting:
                task.rollback()  # let it go, then fail
                done.wait(10)
                break
        assert waiting == [], f"housekeeping waited on the task's row lock: {waiting}"
        assert answers == {"maintain": (0, 0), "purge": 0}
        assert rows("SELECT count(*) FROM {schema}.message") == [(1,)]
        task.rollback()  # the run rolled back: the row is an expired, lapsed one again
    assert store.maintain(["q"]) == (0, 1)  # what only the lock kept it from
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_purge_skips_a_lapsed_row_a_task_is_completing(
    store: PublishingStore, rows: Peek, pg_url: str, schema: str
) -> None:
    """As above, for ``pgq purge`` alone (no TTL): skipped while locked, purged after."""
    token = claimed(store)
    rows.expire_leases()
    with psycopg.connect(pg_url) as task:
        assert fence(task, schema, token) is None
        answer: list[int] = []
        done = threading.Event()

        def purge() -> None:
            try:
                answer.append(store.purge("q"))
            finally:
                done.set()

        threading.Thread(target=purge, daemon=True).start()
        waiting: list[tuple[Any, ...]] = []
        while not done.wait(0.02):
            waiting = rows(
                "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'"
            )
            if waiting:
                task.rollback()
                done.wait(10)
                break
        assert waiting == [], f"purge waited on the task's row lock: {waiting}"
        assert answer == [0]
        task.rollback()
    assert store.purge("q") == 1
