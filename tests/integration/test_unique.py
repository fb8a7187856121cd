"""Unique tasks (docs/flow-control.md): a publish whose unique key a queued (or running)
message holds inserts nothing, across concurrent publishers and application
transactions; the key leaves with its message (ack, dead-letter, expiry, purge) and a
crash leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection, Producer, Queue

import pg_transport
from pg_transport import DuplicateTask, UniqueBusy, UniqueError
from pg_transport.config import Options
from pg_transport.db.pool import Connector
from pg_transport.errors import ConfigurationError
from pg_transport.fanin.backend import forget
from pg_transport.publish.publisher import Publisher
from tests.integration.conftest import Peek, PublishingStore
from tests.pg import to_broker_url


def message(
    key: str | None,
    *,
    task_id: str | None = None,
    mode: str | None = None,
    conflict: str | None = "raise",
) -> dict[str, Any]:
    headers: dict[str, Any] = {"id": task_id or str(uuid.uuid4()), "task": "t"}
    if key is not None:
        headers["pgq-unique-key"] = key
    if mode is not None:
        headers["pgq-unique-while"] = mode
    if conflict is not None:
        headers["pgq-unique-conflict"] = conflict
    return {"body": "b", "properties": {"delivery_info": {}}, "headers": headers}


def keys(peek: Peek) -> list[tuple[str | None, str]]:
    return [(k, t) for k, t in peek("SELECT ukey, task_id FROM {schema}.message ORDER BY id")]


def test_a_duplicate_is_not_enqueued_and_names_the_holder(
    store: PublishingStore, peek: Peek
) -> None:
    first = message("report-1")
    store.publisher.publish("q", first, publish_key="p1")
    with pytest.raises(DuplicateTask) as refused:
        store.publisher.publish("q", message("report-1"), publish_key="p2")
    assert refused.value.existing_id == first["headers"]["id"]
    assert refused.value.key == "report-1"
    # conflict "return": nothing inserted, nothing raised
    store.publisher.publish("q", message("report-1", conflict=None), publish_key="p3")
    assert keys(peek) == [("report-1", first["headers"]["id"])]
    # another key is another task
    store.publisher.publish("q", message("report-2"), publish_key="p4")
    assert [k for k, _ in keys(peek)] == ["report-1", "report-2"]


def test_the_same_publish_sent_again_is_not_a_duplicate(store: PublishingStore, peek: Peek) -> None:
    """A publish retried after an ambiguous commit (same task id and publish key) finds
    its own message: no error even with conflict "raise", and still one row, also once
    the claim cleared the key (queued mode)."""
    sent = message("k")
    store.publisher.publish("q", sent, publish_key="same")
    store.publisher.publish("q", sent, publish_key="same")
    [_] = store.claim(["q"], [30.0], 10)
    assert keys(peek) == [(None, sent["headers"]["id"])]
    store.publisher.publish("q", sent, publish_key="same")
    assert len(keys(peek)) == 1


def test_queued_frees_the_key_at_delivery_queued_or_running_at_the_end(
    store: PublishingStore, peek: Peek
) -> None:
    store.publisher.publish("q", message("a"), publish_key="a1")
    store.publisher.publish("q", message("b", mode="queued_or_running"), publish_key="b1")
    claimed = store.claim(["q"], [30.0], 10)
    assert len(claimed) == 2
    # "a" runs and is no longer queued: a new one may queue; "b" still holds its key
    store.publisher.publish("q", message("a"), publish_key="a2")
    with pytest.raises(DuplicateTask):
        store.publisher.publish("q", message("b", mode="queued_or_running"), publish_key="b2")
    assert store.ack([c.token for c in claimed]) == 2
    store.publisher.publish("q", message("b", mode="queued_or_running"), publish_key="b3")
    assert sorted(k for k, _ in keys(peek) if k) == ["a", "b"]


@pytest.mark.parametrize("leaves", ["ack", "dead-letter", "purge", "delete queue"])
def test_the_key_leaves_with_its_message(store: PublishingStore, peek: Peek, leaves: str) -> None:
    store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="1")
    if leaves == "purge":
        assert store.purge("q") == 1
    elif leaves == "delete queue":
        store.delete_queue("q")
    else:
        [claimed] = store.claim(["q"], [30.0], 10)
        with pytest.raises(DuplicateTask):
            store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="x")
        if leaves == "ack":
            assert store.ack([claimed.token]) == 1
        else:
            assert store.dead_letter(claimed.token, "test") is not None
    assert keys(peek) == []
    store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="2")
    assert [k for k, _ in keys(peek)] == ["k"]


def test_expiry_by_maintenance_releases_the_key(store: PublishingStore, peek: Peek) -> None:
    store.publisher.publish("q", message("k"), publish_key="1", ttl=3600)
    peek("UPDATE {schema}.message SET expires_at = now() - interval '1 s'")  # an hour on
    store.maintain(["q"])
    assert keys(peek) == []
    store.publisher.publish("q", message("k"), publish_key="2")
    assert [k for k, _ in keys(peek)] == ["k"]


def test_a_retry_takes_the_key_over_from_its_running_original(
    store: PublishingStore, peek: Peek
) -> None:
    """Celery's retry publishes the same task id while the original runs: with
    queued_or_running it must not be refused as its own duplicate, and the key moves to
    it (the original's ack then frees nothing)."""
    task_id = str(uuid.uuid4())
    original = message("k", task_id=task_id, mode="queued_or_running")
    store.publisher.publish("q", original, publish_key="first")
    [claimed] = store.claim(["q"], [30.0], 10)
    store.publisher.publish("q", dict(original), publish_key="retry")
    assert sorted(keys(peek), key=str) == sorted([(None, task_id), ("k", task_id)], key=str)
    assert store.ack([claimed.token]) == 1
    assert keys(peek) == [("k", task_id)]
    with pytest.raises(DuplicateTask):
        store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="other")


def test_bad_unique_headers_are_refused_naming_them(store: PublishingStore, peek: Peek) -> None:
    for bad, named in [
        (message("k", mode="sometimes"), "pgq-unique-while"),
        (message("k", conflict="maybe"), "pgq-unique-conflict"),
        (message(""), "pgq-unique-key"),
        (message("x" * 1025), "pgq-unique-key"),
    ]:
        with pytest.raises(UniqueError, match=named):
            store.publisher.publish("q", bad, publish_key=str(uuid.uuid4()))
    assert keys(peek) == []


# -- concurrent publishers -----------------------------------------------------------------


@pytest.mark.sessions(20)  # ten publishing threads: 17 seen
def test_concurrent_publishers_enqueue_each_key_once(
    pg_url: str, store: PublishingStore, peek: Peek, schema: str
) -> None:
    """10 publishers, each on a session of its own, publish 100 messages of 50 keys at
    once (a barrier before the first): 50 rows, and every refused publish names the task
    that holds its key."""
    publishers = 10
    start = threading.Barrier(publishers)
    refused: list[tuple[str, str]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def publish(n: int) -> None:
        connector = Connector(pg_url)
        publisher = Publisher(connector, schema)
        try:
            start.wait()
            for i in range(100):
                key = f"key-{(i + n) % 50}"
                try:
                    publisher.publish("q", message(key), publish_key=str(uuid.uuid4()))
                except DuplicateTask as dup:
                    with lock:
                        refused.append((key, dup.existing_id))
        except BaseException as exc:
            failures.append(exc)
        finally:
            connector.close()

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(publishers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    holders = dict(keys(peek))  # type: ignore[arg-type]
    assert len(holders) == 50
    assert len(refused) == publishers * 100 - 50
    assert all(holders[key] == existing for key, existing in refused)


# -- application transactions ------------------------------------------------------------


@pytest.fixture
def app_conns(pg_url: str, store: PublishingStore) -> Iterator[list[psycopg.Connection[Any]]]:
    conns = [psycopg.connect(pg_url) for _ in range(2)]
    yield conns
    for c in conns:
        c.close()


def publish_joined(
    publisher: Publisher, conn: psycopg.Connection[Any], payload: dict[str, Any], key: str
) -> None:
    with pg_transport.transaction(conn):
        publisher.publish("q", payload, publish_key=key)


@pytest.mark.parametrize("ending", ["rollback", "commit"])
@pytest.mark.sessions(11)  # 9 seen
def test_a_publish_waits_for_the_transaction_holding_its_key(
    store: PublishingStore, peek: Peek, app_conns: list[psycopg.Connection[Any]], ending: str
) -> None:
    """The first publisher's transaction is open with the key inserted; the second's
    publish waits for it (seen waiting for a lock). A rollback lets the second insert (no
    publish is lost, as with an advisory lock taken in a transaction that rolled back); a
    commit makes it a duplicate."""
    holder_conn, waiter_conn = app_conns
    first = message("k")
    publish_joined(store.publisher, holder_conn, first, "1")
    second = message("k")
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            publish_joined(store.publisher, waiter_conn, second, "2")
            waiter_conn.commit()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    peek.wait_for_lock(waiter_conn.info.backend_pid, "the second publish did not wait")
    getattr(holder_conn, ending)()
    waiter.join()
    if ending == "rollback":
        assert outcome == [None]
        assert keys(peek) == [("k", second["headers"]["id"])]
    else:
        [dup] = outcome
        assert isinstance(dup, DuplicateTask) and dup.existing_id == first["headers"]["id"]
        assert keys(peek) == [("k", first["headers"]["id"])]


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_a_transaction_left_open_is_waited_for_at_most_unique_wait(
    store: PublishingStore, peek: Peek, app_conns: list[psycopg.Connection[Any]], schema: str
) -> None:
    """UniqueBusy after unique_wait; the caller's own lock_timeout is put back once a
    unique publish returns in its transaction."""
    holder_conn, other = app_conns
    publish_joined(store.publisher, holder_conn, message("k"), "1")
    store.publisher.unique_wait = 0.05
    with pytest.raises(UniqueBusy, match="unique_wait"):
        store.publisher.publish("q", message("k"), publish_key="2")
    other.execute("SET lock_timeout = '7s'")
    other.commit()
    publish_joined(store.publisher, other, message("j"), "3")
    assert other.execute("SHOW lock_timeout").fetchone() == ("7s",)
    other.rollback()
    holder_conn.rollback()


@pytest.mark.sessions(11)  # side by side, the run's meter
def test_unique_wait_is_a_transport_option(
    pg_url: str, store: PublishingStore, app_conns: list[psycopg.Connection[Any]], schema: str
) -> None:
    """The transport option sets the publisher's wait (a publish behind an open
    transaction holding its key gives up after it), and a bad value is refused naming
    the option before anything connects."""
    holder_conn, _ = app_conns
    publish_joined(store.publisher, holder_conn, message("k"), "1")
    url = to_broker_url(pg_url)
    with Connection(url, transport_options={"schema": schema, "unique_wait": 0.05}) as conn:
        channel = conn.channel()
        Queue("q").bind(channel).declare()
        assert conn.transport.publisher.unique_wait == 0.05
        with pytest.raises(UniqueBusy, match=r"unique_wait \(0.05 s\)"):
            Producer(channel).publish(
                {"n": 1}, routing_key="q", headers={"id": "t2", "pgq-unique-key": "k"}
            )
    holder_conn.rollback()
    for bad in (0, -1, "soon", 1e7, True):
        with pytest.raises(ConfigurationError, match=f"unique_wait={bad!r}"):
            Options.from_sources({"unique_wait": bad}, {})
    with pytest.raises(ConfigurationError, match="PGQ_UNIQUE_WAIT"):
        Options.from_sources(None, {"PGQ_UNIQUE_WAIT": "0"})
    assert Options.from_sources(None, {"PGQ_UNIQUE_WAIT": "0.25"}).unique_wait == 0.25
    assert Options.from_sources(None, {}).unique_wait == 5.0


def test_a_killed_publisher_leaves_no_key_behind(
    pg_url: str, store: PublishingStore, peek: Peek, schema: str
) -> None:
    """A process that inserted a key in an open transaction is SIGKILLed: its
    transaction ends with its backend, the key with it; a waiting publish then inserts."""
    script = (
        "import sys, psycopg, pg_transport\n"
        "from pg_transport.db.pool import Connector\n"
        "from pg_transport.publish.publisher import Publisher\n"
        "conn = psycopg.connect(sys.argv[1])\n"
        "pub = Publisher(Connector(sys.argv[1]), sys.argv[2])\n"
        "with pg_transport.transaction(conn):\n"
        "    pub.publish('q', {'body': 'b', 'headers': {'id': 'dead', "
        "'pgq-unique-key': 'k'}}, publish_key='dead')\n"
        "print(conn.info.backend_pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, pg_url, schema],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        backend = int(proc.stdout.readline())
        peek.wait_for_backend(backend, "state = 'idle in transaction'", "no open transaction")
        done: list[BaseException | None] = []

        def publish() -> None:
            try:
                store.publisher.publish("q", message("k"), publish_key="alive")
                done.append(None)
            except BaseException as exc:
                done.append(exc)

        waiter = threading.Thread(target=publish)
        waiter.start()
        peek.wait_until(
            "SELECT count(*) = 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            backend,
            failure="the publish did not wait for the killed publisher's transaction",
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        waiter.join()
        assert done == [None]
        assert [t for _, t in keys(peek)] != ["dead"] and len(keys(peek)) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_consumer_keeps_the_key_with_its_message(
    pg_url: str, store: PublishingStore, peek: Peek, schema: str
) -> None:
    """A consumer that claimed a queued_or_running message is SIGKILLed: nothing is
    released, because nothing left: the message is still there (redelivered when its
    lease lapses) and still holds its key."""
    store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="1")
    script = (
        "import sys\n"
        "from pg_transport.db.pool import Connector\n"
        "from pg_transport.store import Store\n"
        "store = Store(Connector(sys.argv[1]), sys.argv[2])\n"
        "print(len(store.claim(['q'], [30.0], 1)), flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, pg_url, schema],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "1"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(DuplicateTask):
        store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="2")
    peek.expire_leases()
    [again] = store.claim(["q"], [30.0], 1)
    assert again.read_ct == 2
    with pytest.raises(DuplicateTask):
        store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="3")
    assert store.ack([again.token]) == 1
    store.publisher.publish("q", message("k", mode="queued_or_running"), publish_key="4")


# -- batches ------------------------------------------------------------------------------


def test_in_a_batch_a_duplicate_is_found_at_once(store: PublishingStore, peek: Peek) -> None:
    """A unique publish in pg_transport.batch() runs in the batch's transaction when it
    is made (its answer is needed then): the batch's second publish of a key is a
    duplicate, plain messages around it are still written together, and the commit keeps
    everything."""
    first = message("k")
    with pg_transport.batch():
        store.publisher.publish("q", message(None), publish_key="plain-1")
        store.publisher.publish("q", first, publish_key="u-1")
        with pytest.raises(DuplicateTask) as dup:
            store.publisher.publish("q", message("k"), publish_key="u-2")
        store.publisher.publish("q", message(None), publish_key="plain-2")
    assert dup.value.existing_id == first["headers"]["id"]
    assert [k for k, _ in keys(peek)] == [None, "k", None]


# -- Celery --------------------------------------------------------------------------------


@pytest.fixture
def celery_app(broker_url: str, schema: str, store: PublishingStore) -> Iterator[Celery]:
    app = Celery("unique-client", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    yield app
    forget(app)
    app.close()


def test_celery_task_defaults_and_call_options(celery_app: Celery, peek: Peek) -> None:
    """unique_key names an argument (the key is prefixed by the task's name); a
    UniqueTask's duplicate returns the holder's AsyncResult, or raises when the call
    asks; a call option overrides the task's default."""

    @celery_app.task(name="reports.build", base=pg_transport.UniqueTask, unique_key="report_id")
    def build(report_id: int, fmt: str = "pdf") -> None: ...

    first = build.delay(7)
    again = build.delay(report_id=7, fmt="csv")
    assert again.id == first.id
    with pytest.raises(DuplicateTask) as refused:
        build.apply_async((7,), unique_conflict="raise")
    assert refused.value.existing_id == first.id
    other = build.apply_async((7,), unique_key="by-hand")
    assert other.id != first.id
    assert sorted(k for k, _ in keys(peek)) == ["by-hand", "reports.build:7"]


def test_celery_unique_key_true_uses_all_arguments(celery_app: Celery, peek: Peek) -> None:
    @celery_app.task(name="sync.all", base=pg_transport.UniqueTask, unique_key=True)
    def sync(a: int, b: int = 0) -> None: ...

    one = sync.apply_async((1,), {"b": 2})
    assert sync.apply_async((1,), {"b": 2}).id == one.id
    assert sync.apply_async((1,), {"b": 3}).id != one.id
    assert len(keys(peek)) == 2


def test_a_unique_message_routed_to_two_queues_is_refused(celery_app: Celery, peek: Peek) -> None:
    from kombu import Exchange, Queue

    fan = Exchange("fan", type="fanout")
    with celery_app.connection_for_write() as conn:
        for name in ("q1", "q2"):
            Queue(name, fan, routing_key=name)(conn.default_channel).declare()
        producer = conn.Producer()
        with pytest.raises(UniqueError, match="2 queues"):
            producer.publish(
                {"x": 1}, exchange=fan, headers={"pgq-unique-key": "k", "id": "t1"}, retry=False
            )
    assert keys(peek) == []
