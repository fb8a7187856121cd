"""A publish: its insert and its wake-up, two transactions sent at once.

Postgres commits the transactions that NOTIFY one at a time, each holding a lock until
its commit is done, WAL flush included; a publish's durable commit does without it.
A slow flush is made real here with the server's ``commit_delay`` (100 ms, on the
publisher's sessions only); the publisher's sessions and the listeners are real, and so
is the ``pg_terminate_backend`` that cuts a publish off in the middle of its commit.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from pg_transport.db.pool import Connector
from pg_transport.publish.publisher import WAYS, way_of
from pg_transport.store import Store
from tests.integration.conftest import Peek, PublishingStore

PAYLOAD = {"body": "x", "properties": {"delivery_info": {}}, "headers": {}}

# The server's longest commit_delay (µs): every commit of the slow publisher that
# writes WAL sleeps this long before its flush.
COMMIT_DELAY_US = 100_000
SLOW = "pgq-slow-flush"


@pytest.fixture
def slow_connector(pg_url: str, peek: Peek) -> Iterator[Connector]:
    """Sessions whose commits that flush take 100 ms."""
    [(superuser,)] = peek("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    if not superuser:
        pytest.skip("commit_delay may be set by a superuser only")
    connector = Connector(
        pg_url,
        application_name=SLOW,
        setup=(f"SET commit_delay = {COMMIT_DELAY_US}", "SET commit_siblings = 0"),
    )
    yield connector
    connector.close()


@pytest.fixture
def slow(slow_connector: Connector, store: Store) -> Store:
    """A publisher whose commits take 100 ms to flush (the schema made by ``store``)."""
    publisher = PublishingStore(slow_connector, store.schema)
    publisher.publisher.publish("q", PAYLOAD)  # a session, with its statements prepared
    return publisher


# How long another session's NOTIFY may wait for the lock a committing NOTIFY holds:
# half the slow flush. The server times that wait (lock_timeout), so a pause of this
# process (its garbage collector, say) or of the machine cannot fail a test.
LOCK_WAIT_MS = COMMIT_DELAY_US // 2000


@pytest.fixture
def other(pg_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A session that NOTIFYs, giving up on a lock it waits for over LOCK_WAIT_MS."""
    conn = psycopg.connect(pg_url, autocommit=True, options=f"-c lock_timeout={LOCK_WAIT_MS}")
    yield conn
    conn.close()


def notify_other(other: psycopg.Connection[tuple[object, ...]]) -> bool:
    """A NOTIFY on ``other``: whether it committed without waiting LOCK_WAIT_MS for
    another session's commit. (Notifying commits queue on one lock for the whole
    server: on a server shared with others, theirs may hold it too. A test publishes
    again then; with the wake-up in the insert's transaction, every NOTIFY waits.)"""
    try:
        other.execute("NOTIFY pgq_test_other")
    except psycopg.errors.LockNotAvailable:
        return False
    return True


@pytest.fixture
def listener(pg_url: str, store: Store) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A session listening on the channels of queues q, bad and good."""
    conn = psycopg.connect(pg_url, autocommit=True)
    for queue in ("q", "bad", "good"):
        channel = psycopg.sql.Identifier(store.channel(queue))
        conn.execute(psycopg.sql.SQL("LISTEN {}").format(channel))
    yield conn
    conn.close()


def slow_backends(peek: Peek) -> list[int]:
    rows = peek(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s ORDER BY pid",
        f"{SLOW}:{os.getpid()}",
    )
    return [int(pid) for (pid,) in rows]


def wait_gone(peek: Peek, pid: int) -> None:
    """Until terminated backend ``pid`` has exited (``pg_terminate_backend`` only signals
    it: on a busy machine it may still be listed a moment later)."""
    peek.wait_until(
        "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)",
        pid,
        failure=f"backend {pid} was terminated and never exited",
    )


#: How long a test may go on publishing to catch one publish inside its slow flush:
#: the flush lasts 100 ms, on a loaded machine this process may sleep through all of it,
#: and on a busy server another session's flush may take the commit's WAL along before
#: the delay is over (the commit then does not wait at all).
ATTEMPT_SECONDS = 30.0


def attempts() -> Iterator[int]:
    """Numbers for publishes, one after another, until one is caught in its slow flush
    (the caller breaks out); fails once ATTEMPT_SECONDS went by with every one missed."""
    deadline = time.monotonic() + ATTEMPT_SECONDS
    n = 0
    while True:
        yield n
        n += 1
        assert time.monotonic() < deadline, (
            f"none of {n} publishes in {ATTEMPT_SECONDS:.0f} s was seen in a slow flush"
            " (with another session's NOTIFY committing meanwhile, where a test asks that)"
        )


def wait_for_insert(peek: Peek, pid: int, thread: threading.Thread) -> str | None:
    """Until backend ``pid`` has inserted (it has a transaction id, given at its first
    write; its commit, flush included, follows at once): that transaction's id, read in
    the same statement that saw it. None if the publish on ``thread`` was over before
    this process looked in time (it slept through the whole flush): the caller publishes
    again. (Its lock on the message table would not do: the PREPARE of a statement
    takes it too.)"""
    deadline = time.monotonic() + 10
    query = "SELECT backend_xid::text FROM pg_stat_activity WHERE pid = %s"
    while True:
        alive = thread.is_alive()
        [(xid,)] = peek(query, pid)
        if xid is not None:
            return str(xid)
        if not alive:
            thread.join()
            return None
        assert time.monotonic() < deadline, "the publish never inserted"


def publishing(store: Store, took: dict[str, float], **kwargs: object) -> threading.Thread:
    def publish() -> None:
        started = time.perf_counter()
        store.publisher.publish("q", PAYLOAD, **kwargs)  # type: ignore[arg-type]
        took["publish"] = time.perf_counter() - started

    thread = threading.Thread(target=publish)
    thread.start()
    return thread


def routing(store: Store, took: dict[str, float]) -> threading.Thread:
    def publish() -> None:
        started = time.perf_counter()
        assert store.publisher.publish_routed("tasks", "k", PAYLOAD) == ("direct", 1)
        took["publish"] = time.perf_counter() - started

    thread = threading.Thread(target=publish)
    thread.start()
    return thread


def received(listener: psycopg.Connection[tuple[object, ...]]) -> str:
    """The channel of the next wake-up (which carries nothing)."""
    for notify in listener.notifies(timeout=10.0, stop_after=1):
        assert notify.payload == ""
        return notify.channel
    raise AssertionError("no wake-up in 10 s")


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_a_publish_flushing_holds_up_no_other_notifying_commit(
    slow: Store, peek: Peek, other: psycopg.Connection[tuple[object, ...]]
) -> None:
    [pid] = slow_backends(peek)
    took: dict[str, float] = {}
    for _ in attempts():
        thread = publishing(slow, took)
        if wait_for_insert(peek, pid, thread) is not None:
            # Another session's NOTIFY commits while the publish's insert waits for its
            # flush. With the wake-up in the insert's transaction, the NOTIFY waited out
            # the delay (and gave up on its lock_timeout), every time.
            notified = notify_other(other)
            thread.join()
            if notified and took["publish"] >= COMMIT_DELAY_US / 1e6:
                return  # the flush was slow indeed
            # Another session's flush took this commit's WAL along (a busy server): the
            # commit did not wait, and the NOTIFY proved nothing. Publish again.


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_a_routed_publish_flushing_holds_up_no_other_notifying_commit(
    slow: Store, peek: Peek, other: psycopg.Connection[tuple[object, ...]]
) -> None:
    """As above, for a publish to an exchange: its copies' insert commits, flush and
    all, before its wake-ups are sent, in a transaction of their own."""
    slow.declare_exchange("tasks", "direct")
    slow.bind("tasks", "q", "k", "")
    [pid] = slow_backends(peek)
    took: dict[str, float] = {}
    for _ in attempts():
        thread = routing(slow, took)
        if wait_for_insert(peek, pid, thread) is not None:
            notified = notify_other(other)
            thread.join()
            if notified and took["publish"] >= COMMIT_DELAY_US / 1e6:
                return  # the flush was slow indeed, and the NOTIFY went through meanwhile


def test_a_routed_publish_wakes_the_queues_it_routed_to_after_its_commit(
    store: Store, peek: Peek, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The wake-ups, sent apart from the insert, go to the queues its route matched."""
    store.declare_exchange("tasks", "direct")
    store.bind("tasks", "q", "k", "")
    store.bind("tasks", "good", "other", "")
    assert store.publisher.publish_routed("tasks", "k", PAYLOAD) == ("direct", 1)
    assert store.publisher.publish_routed("tasks", "other", PAYLOAD) == ("direct", 1)
    wakes = listener.notifies(timeout=10.0, stop_after=2)
    assert [w.channel for w in wakes] == [store.channel("q"), store.channel("good")]
    assert sorted(peek("SELECT queue FROM {schema}.message")) == [("good",), ("q",)]


def test_the_wake_up_follows_the_committed_message(
    store: Store, peek: Peek, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    store.publisher.publish("q", PAYLOAD)
    assert received(listener) == store.channel("q")
    [(count,)] = peek("SELECT count(*) FROM {schema}.message WHERE queue = 'q'")
    assert count == 1


def test_a_failed_insert_raises_and_its_session_serves_the_next_publish(
    slow: Store, peek: Peek, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    before = slow_backends(peek)
    with pytest.raises(psycopg.errors.CheckViolation):
        slow.publisher.publish("bad", PAYLOAD, priority=300)  # priority is 0-255
    slow.publisher.publish("good", PAYLOAD)
    # The failed insert's wake-up ran all the same (its own transaction): a wake-up
    # too many, for a queue with nothing new in it. The next publish's follows it.
    wakes = listener.notifies(timeout=10.0, stop_after=2)
    assert [wake.channel for wake in wakes] == [slow.channel("bad"), slow.channel("good")]
    assert slow_backends(peek) == before  # the same session, not a new one
    assert peek("SELECT queue FROM {schema}.message WHERE queue <> 'q'") == [("good",)]


@pytest.fixture
def unflushed(pg_url: str, store: Store) -> Iterator[Store]:
    """A publisher as ``durable_publish`` off makes it: its sessions commit without
    waiting for their flush."""
    connector = Connector(pg_url, setup=("SET synchronous_commit = off",))
    publisher = PublishingStore(connector, store.schema, publisher_flushes=False)
    publisher.publisher.publish("q", PAYLOAD)  # a session, with its statements prepared
    yield publisher
    connector.close()


def test_with_no_flush_to_wait_for_the_wake_up_is_inside_the_insert_s_transaction(
    unflushed: Store, peek: Peek, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        unflushed.publisher.publish("bad", PAYLOAD, priority=300)  # priority is 0-255
    unflushed.publisher.publish("good", PAYLOAD)
    # One transaction: the failed insert's wake-up went with it (sent as a transaction
    # of its own, it would have come first; see the test above this one).
    wakes = listener.notifies(timeout=10.0, stop_after=1)
    assert [wake.channel for wake in wakes] == [unflushed.channel("good")]
    assert peek("SELECT queue FROM {schema}.message WHERE queue <> 'q'") == [("good",)]


def test_a_publish_cut_off_in_its_commit_is_published_once_and_wakes_its_consumers(
    slow: Store, peek: Peek, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    [pid] = slow_backends(peek)
    took: dict[str, float] = {}
    for attempt in attempts():
        key = f"once-{attempt}"
        thread = publishing(slow, took, publish_key=key)
        if wait_for_insert(peek, pid, thread) is not None:
            break
    peek("SELECT pg_terminate_backend(%s)", pid)
    thread.join()
    assert "publish" in took  # it returned
    wait_gone(peek, pid)
    assert pid not in slow_backends(peek)
    # Whether the insert's answer or only the wake-up's was lost with the session,
    # the message is there once, and the wake-up was sent again.
    assert peek("SELECT count(*) FROM {schema}.message WHERE publish_key = %s", key) == [(1,)]
    assert received(listener) == slow.channel("q")


def test_a_routed_publish_cut_off_in_its_commit_is_published_once_and_wakes_its_consumers(
    slow: Store, peek: Peek, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    slow.declare_exchange("tasks", "direct")
    slow.bind("tasks", "q", "k", "")
    [pid] = slow_backends(peek)
    for attempt in attempts():
        tag = f"once-{attempt}"
        outcome: list[tuple[str | None, int]] = []
        thread = threading.Thread(
            target=lambda tag=tag, outcome=outcome: outcome.append(
                slow.publisher.publish_routed("tasks", "k", PAYLOAD, publish_tag=tag)
            )
        )
        thread.start()
        xid = wait_for_insert(peek, pid, thread)  # its commit now waits out the slow flush
        if xid is not None:
            break
    peek("SELECT pg_terminate_backend(%s)", pid)
    thread.join()
    assert outcome == [("direct", 1)]  # it returned, sent again on another session
    wait_gone(peek, pid)
    assert pid not in slow_backends(peek)
    # One copy, whichever way the cut fell. Inside the commit (its flush: the usual
    # case), the cut-off transaction committed its copy (a commit under way is not
    # stopped) and its answer was lost with the session: the publish sent again inserted
    # nothing (the row is the first transaction's) and woke the queue's listeners all the
    # same. Before the commit began (a loaded machine stretches the moment between the
    # insert and the commit), the first transaction rolled back and the copy is the one
    # sent again.
    copies = peek(
        "SELECT xmin::text FROM {schema}.message WHERE queue = 'q' AND publish_key"
        " = md5(%s || 'q')",
        tag,
    )
    assert len(copies) == 1
    if copies != [(xid,)]:
        [(status,)] = peek("SELECT count(*) = 0 FROM {schema}.message WHERE xmin::text = %s", xid)
        assert status  # the first transaction left nothing: it rolled back
    assert received(listener) == slow.channel("q")


def test_each_publish_goes_the_way_its_connection_allows(pg_url: str, store: Store) -> None:
    """The publisher's table of ways, picked from the connection a publish runs on."""
    own = Connector(pg_url)  # prepares: a session of pgq's own
    pooled = Connector(pg_url, prepare_threshold=None)  # as behind a transaction pooler
    try:
        with own.connection() as conn:
            assert way_of(conn, flushes=True) == "apart"
            assert way_of(conn, flushes=False) == "together"  # durable off
            with conn.transaction():  # the caller's transaction: one statement in it
                assert way_of(conn, flushes=True) == "together"
            with conn.pipeline():  # a barrier arming its parts (fanin/state.py)
                assert way_of(conn, flushes=True) == "batched"
        with pooled.connection() as conn:
            assert way_of(conn, flushes=True) == "together"
        with psycopg.connect(pg_url) as app_conn:  # an application's: never prepared
            assert way_of(app_conn, flushes=True) == "joined"
            with app_conn.pipeline():
                assert way_of(app_conn, flushes=True) == "joined"
    finally:
        own.close()
        pooled.close()
    assert set(WAYS) == {"batched", "apart", "together", "joined"}
