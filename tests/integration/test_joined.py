"""``pg_transport.transaction(conn)``: publishing in the application's own transaction
(a psycopg connection here; SQLAlchemy and Django in their own modules).

A message published in the block exists exactly when the application's transaction
commits: it is written in that transaction (same transaction id), gone on rollback,
gone with a rolled-back savepoint, and its wake-up goes out at the commit.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, group
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql
from psycopg.rows import dict_row

import pg_transport
from barrier import Barrier
from pg_transport import NotPermitted, TransactionRefused
from pg_transport.fanin.backend import forget
from pg_transport.sql import queue_channel
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.integration.test_trust import Role

MESSAGES = "SELECT count(*) FROM {schema}.message"


@pytest.fixture
def client(broker_url: str, schema: str, store: Store) -> Iterator[Celery]:
    """A publishing Celery app on the test schema (no worker: rows are looked at)."""
    app = Celery("joined-client", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    yield app
    forget(app)
    app.close()


@pytest.fixture
def app_conn(pg_url: str, schema: str, store: Store) -> Iterator[psycopg.Connection[Any]]:
    """The application's connection: not autocommit, with a table of its own and
    settings pgq must neither rely on nor change."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {}.orders (id bigserial PRIMARY KEY, label text)").format(
                sql.Identifier(schema)
            )
        )
        conn.commit()
        conn.row_factory = dict_row  # type: ignore[assignment]
        yield conn


def insert_order(conn: psycopg.Connection[Any], schema: str, label: str) -> None:
    conn.execute(
        sql.SQL("INSERT INTO {}.orders (label) VALUES (%s)").format(sql.Identifier(schema)),
        [label],
    )


def labels(peek: Peek) -> list[str]:
    """The first argument of every message in the table, sorted."""
    rows = peek("SELECT payload->>'body' FROM {schema}.message")
    return sorted(json.loads(body)[0][0] for (body,) in rows)


def test_a_message_published_in_the_transaction_commits_with_it(
    client: Celery, app_conn: psycopg.Connection[Any], schema: str, peek: Peek
) -> None:
    app_conn.execute("SET search_path TO nowhere")  # pgq names everything it uses
    app_conn.commit()
    with app_conn.transaction():
        insert_order(app_conn, schema, "a")
        with pg_transport.transaction(app_conn):
            client.send_task("shop.ship", args=["a"])
        xid = app_conn.execute("SELECT pg_catalog.pg_current_xact_id()::xid::text AS x")
        own_xid = xid.fetchone()["x"]  # type: ignore[index,call-overload]
        assert peek(MESSAGES) == [(0,)]  # nobody sees it before the commit
    # Written in the application's transaction: the same transaction id.
    assert peek("SELECT xmin::text FROM {schema}.message") == [(own_xid,)]
    assert labels(peek) == ["a"]
    # Nothing of pgq's stayed on the application's session.
    assert app_conn.execute("SHOW search_path").fetchone() == {"search_path": "nowhere"}
    prepared = app_conn.execute("SELECT count(*) AS n FROM pg_catalog.pg_prepared_statements")
    assert prepared.fetchone() == {"n": 0}


def test_a_rollback_takes_the_message_back(
    client: Celery, app_conn: psycopg.Connection[Any], schema: str, peek: Peek
) -> None:
    with pytest.raises(ZeroDivisionError), app_conn.transaction():
        insert_order(app_conn, schema, "a")
        with pg_transport.transaction(app_conn):
            client.send_task("shop.ship", args=["a"])
            1 / 0  # noqa: B018
    assert peek(MESSAGES) == [(0,)]
    assert peek("SELECT count(*) FROM {schema}.orders") == [(0,)]


def test_a_rolled_back_savepoint_takes_only_its_messages(
    client: Celery, app_conn: psycopg.Connection[Any], schema: str, peek: Peek
) -> None:
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        client.send_task("shop.ship", args=["before"])
        with pytest.raises(ZeroDivisionError), app_conn.transaction():  # a savepoint
            client.send_task("shop.ship", args=["inside"])
            1 / 0  # noqa: B018
        with app_conn.transaction():  # a savepoint released: its message stays
            client.send_task("shop.ship", args=["kept"])
        client.send_task("shop.ship", args=["after"])
    assert labels(peek) == ["after", "before", "kept"]


def test_a_message_published_twice_in_the_transaction_is_one_message(
    store: Store, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        store.publisher.publish("q", {"n": 1}, publish_key="same")
        store.publisher.publish("q", {"n": 1}, publish_key="same")
    assert peek(MESSAGES) == [(1,)]


def test_consumers_are_woken_by_the_commit_not_before(
    pg_url: str, store: Store, app_conn: psycopg.Connection[Any]
) -> None:
    channel = queue_channel(store.schema, "q")
    with (
        psycopg.connect(pg_url, autocommit=True) as listener,
        psycopg.connect(pg_url, autocommit=True) as other,
    ):
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        with app_conn.transaction():
            with pg_transport.transaction(app_conn):
                store.publisher.publish("q", {"n": 1})
            # Notifications arrive in commit order: a later commit's one, received,
            # with none before it, shows ours was not sent.
            other.execute("SELECT pg_notify(%s, 'later')", [channel])
            first = next(listener.notifies(timeout=10))
            assert first.payload == "later"
        after = next(listener.notifies(timeout=10))
        assert (after.channel, after.payload) == (channel, "")


def test_outside_the_block_publishing_is_as_before(
    client: Celery, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    with app_conn.transaction():
        with pg_transport.transaction(app_conn):
            pass
        client.send_task("shop.ship", args=["apart"])  # its own commit, at once
        assert peek(MESSAGES) == [(1,)]


def test_a_transaction_on_another_database_is_refused_naming_both(
    pg_url: str, client: Celery, peek: Peek
) -> None:
    other = psycopg.conninfo.make_conninfo(pg_url, dbname="postgres")
    with psycopg.connect(other) as elsewhere, elsewhere.transaction():
        with pytest.raises(TransactionRefused) as refused, pg_transport.transaction(elsewhere):
            client.send_task("shop.ship", args=["a"])
        # The application's transaction is untouched: the refusal came before any write.
        assert elsewhere.execute("SELECT 1").fetchone() == (1,)
    text = str(refused.value)
    assert "database 'postgres'" in text
    assert (
        "database 'test'" in text
        or f"database {psycopg.conninfo.conninfo_to_dict(pg_url)['dbname']!r}" in text
    )
    assert peek(MESSAGES) == [(0,)]  # not published apart either


def test_another_driver_is_refused_at_once() -> None:
    with pytest.raises(TransactionRefused, match=r"sqlite3\.Connection.*psycopg 3"):
        pg_transport.transaction(sqlite3.connect(":memory:"))
    sqlalchemy = pytest.importorskip("sqlalchemy")
    engine = sqlalchemy.create_engine("sqlite://")
    with engine.connect() as conn, pytest.raises(TransactionRefused, match=r"sqlite\+pysqlite"):
        pg_transport.transaction(conn)


async def _async_refused(pg_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        with pytest.raises(TransactionRefused, match="AsyncConnection"):
            pg_transport.transaction(conn)


def test_an_asyncio_connection_is_refused(pg_url: str) -> None:
    import asyncio

    asyncio.run(_async_refused(pg_url))


def test_an_autocommit_connection_needs_a_transaction_open(
    pg_url: str, client: Celery, peek: Peek
) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        with pytest.raises(TransactionRefused, match="autocommit"), pg_transport.transaction(conn):
            client.send_task("shop.ship", args=["a"])
        assert peek(MESSAGES) == [(0,)]
        with conn.transaction(), pg_transport.transaction(conn):
            client.send_task("shop.ship", args=["b"])
            assert peek(MESSAGES) == [(0,)]
    assert labels(peek) == ["b"]


def test_a_failed_transaction_is_refused_clearly(
    client: Celery, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    with pg_transport.transaction(app_conn):
        with pytest.raises(psycopg.errors.DivisionByZero):
            app_conn.execute("SELECT 1 / 0")
        with pytest.raises(TransactionRefused, match="failed"):
            client.send_task("shop.ship", args=["a"])
    app_conn.rollback()
    assert peek(MESSAGES) == [(0,)]


def test_a_barrier_dispatched_in_the_transaction_is_armed_with_it(
    client: Celery, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    barrier = Barrier(client)
    with pytest.raises(ZeroDivisionError), app_conn.transaction():
        with pg_transport.transaction(app_conn):
            barrier.dispatch(
                "b-rolled-back",
                [client.signature("shop.part", args=[i]) for i in range(3)],
                client.signature("shop.done"),
            )
        1 / 0  # noqa: B018
    assert peek("SELECT count(*) FROM {schema}.barrier") == [(0,)]
    assert peek(MESSAGES) == [(0,)]
    with app_conn.transaction():
        with pg_transport.transaction(app_conn):
            barrier.dispatch(
                "b-committed",
                [client.signature("shop.part", args=[i]) for i in range(3)],
                client.signature("shop.done"),
            )
        assert peek(MESSAGES) == [(0,)]
    assert peek("SELECT id FROM {schema}.barrier") == [("b-committed",)]
    assert peek(MESSAGES) == [(3,)]
    # Nothing of pgq's stayed on the application's session, however often it dispatched.
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        for n in range(6):
            barrier.dispatch(f"b-{n}", [client.signature("shop.part")], client.signature("s"))
    prepared = app_conn.execute("SELECT count(*) AS n FROM pg_catalog.pg_prepared_statements")
    assert prepared.fetchone() == {"n": 0}


def test_a_publish_in_the_applications_pipeline_joins_its_transaction(
    client: Celery, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    with app_conn.transaction(), pg_transport.transaction(app_conn), app_conn.pipeline():
        for n in range(3):
            client.send_task("shop.ship", args=[f"piped-{n}"])
        assert peek(MESSAGES) == [(0,)]
    assert labels(peek) == ["piped-0", "piped-1", "piped-2"]


def test_a_block_is_used_once(app_conn: psycopg.Connection[Any]) -> None:
    block = pg_transport.transaction(app_conn)
    with block:
        pass
    with pytest.raises(RuntimeError, match="one with-block"), block:
        pass


def test_routed_and_unroutable_messages_follow_the_transaction(
    broker_url: str, schema: str, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    exchange = Exchange("shop", type="direct")
    queue = Queue("ship", exchange, routing_key="ship")
    with Connection(broker_url, transport_options={"schema": schema}) as kombu_conn:
        producer = Producer(kombu_conn)
        queue(producer.channel).declare()
        for outcome in ("rollback", "commit"):
            fails = pytest.raises(ZeroDivisionError) if outcome == "rollback" else nullcontext()
            with fails, app_conn.transaction(), pg_transport.transaction(app_conn):
                producer.publish({"n": outcome}, exchange=exchange, routing_key="ship")
                # Bound to nothing: kept as a dead letter, in the same transaction.
                producer.publish({"n": outcome}, exchange=exchange, routing_key="nobody")
                assert peek(MESSAGES) == [(0,)]
                if outcome == "rollback":
                    1 / 0  # noqa: B018
    assert peek("SELECT queue, payload->>'body' FROM {schema}.message") == [
        ("ship", '{"n": "commit"}')
    ]
    assert peek("SELECT queue, payload->>'body' FROM {schema}.dead_letter") == [
        ("nobody", '{"n": "commit"}')
    ]


def test_a_kombu_batch_inside_the_transaction_commits_with_it(
    broker_url: str, schema: str, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    with Connection(broker_url, transport_options={"schema": schema}) as kombu_conn:
        producer = Producer(kombu_conn)
        with app_conn.transaction(), pg_transport.transaction(app_conn):
            with producer.batch():
                for n in range(5):
                    producer.publish({"n": n}, routing_key="q")
            assert peek(MESSAGES) == [(0,)]  # the batch's flush is the application's commit
            with pytest.raises(ZeroDivisionError), app_conn.transaction():
                with producer.batch():
                    producer.publish({"n": "savepoint"}, routing_key="q")
                1 / 0  # noqa: B018
    assert peek("SELECT count(*), count(DISTINCT xmin::text) FROM {schema}.message") == [(5, 1)]


def test_delay_apply_async_and_canvas_join_the_transaction(
    client: Celery, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    @client.task(name="shop.ship")
    def ship(label: str) -> None: ...

    def publish_all(prefix: str) -> None:
        ship.delay(f"{prefix}-delay")
        ship.apply_async(args=[f"{prefix}-apply"], countdown=60)  # an ETA waits in Postgres
        group(ship.s(f"{prefix}-group-{n}") for n in range(2)).apply_async()
        chain(ship.si(f"{prefix}-chain-0"), ship.si(f"{prefix}-chain-1")).apply_async()

    with pytest.raises(ZeroDivisionError), app_conn.transaction():
        with pg_transport.transaction(app_conn):
            publish_all("gone")
        1 / 0  # noqa: B018
    assert peek(MESSAGES) == [(0,)]
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        publish_all("kept")
        assert peek(MESSAGES) == [(0,)]
    # A chain publishes its first task; the rest travel in that message.
    assert labels(peek) == [
        "kept-apply",
        "kept-chain-0",
        "kept-delay",
        "kept-group-0",
        "kept-group-1",
    ]


@pytest.fixture
def role_without_grants(pg_url: str) -> Iterator[Role]:
    name = f"pgq_t_app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield Role(name, pg_url)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_a_role_that_may_not_publish_is_told_which_grant_it_needs(
    client: Celery, role_without_grants: Role, peek: Peek
) -> None:
    refused = pytest.raises(NotPermitted, match="GRANT pgq_publisher")
    conn = role_without_grants.connect()
    with conn, conn.transaction(), refused, pg_transport.transaction(conn):
        client.send_task("shop.ship", args=["a"])
    assert peek(MESSAGES) == [(0,)]


def test_a_timeout_in_the_transaction_is_not_taken_for_a_lost_broker(
    pg_url: str, store: Store, app_conn: psycopg.Connection[Any], peek: Peek
) -> None:
    """A lock timeout while publishing (another open transaction published the same
    message) fails the publish as the application's, not as a broker connection error
    kombu would retry: the cause is kept."""
    with psycopg.connect(pg_url) as other, other.transaction():
        with pg_transport.transaction(other):
            store.publisher.publish("q", {"n": 1}, publish_key="contended")
        app_conn.execute("SET LOCAL lock_timeout = '50ms'")  # (begins its transaction)
        refused = pytest.raises(TransactionRefused, match="roll it back")
        with refused as caught, pg_transport.transaction(app_conn):
            store.publisher.publish("q", {"n": 1}, publish_key="contended")
        app_conn.rollback()
    assert isinstance(caught.value.__cause__, psycopg.errors.LockNotAvailable)
    assert peek(MESSAGES) == [(1,)]  # the other transaction's, committed


def test_a_lost_application_connection_fails_the_publish_and_publishes_nothing(
    client: Celery, pg_url: str, store: Store, peek: Peek
) -> None:
    with psycopg.connect(pg_url) as conn, pg_transport.transaction(conn):
        client.send_task("shop.ship", args=["first"])  # (its server is known from here)
        peek("SELECT pg_terminate_backend(%s)", conn.info.backend_pid)
        with pytest.raises(TransactionRefused, match="connection was lost"):
            client.send_task("shop.ship", args=["second"])
    assert peek(MESSAGES) == [(0,)]
    client.send_task("shop.ship", args=["apart"])  # pgq's own connections were not touched
    assert labels(peek) == ["apart"]


@pytest.fixture
def another_server(pg_url: str) -> Iterator[str]:
    """A second Postgres (embedded), with a database named as the broker's: only the
    server tells the two apart."""
    pgserver = pytest.importorskip("pgserver")
    server = pgserver.get_server(tempfile.mkdtemp(prefix="pgq-other-"), cleanup_mode="delete")
    try:
        dbname = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
        with psycopg.connect(server.get_uri(), autocommit=True) as admin:
            if (
                admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname]).fetchone()
                is None
            ):
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        yield psycopg.conninfo.make_conninfo(server.get_uri(), dbname=dbname)
    finally:
        server.cleanup()


def test_a_transaction_on_another_server_is_refused_naming_both(
    another_server: str, client: Celery, peek: Peek
) -> None:
    with psycopg.connect(another_server) as elsewhere, elsewhere.transaction():
        ids = elsewhere.execute("SELECT system_identifier::text FROM pg_control_system()")
        (theirs,) = ids.fetchone()  # type: ignore[misc]
        with pytest.raises(TransactionRefused) as refused, pg_transport.transaction(elsewhere):
            client.send_task("shop.ship", args=["a"])
    (ours,) = peek("SELECT system_identifier::text FROM pg_control_system()")[0]
    assert theirs != ours
    assert f"system identifier {theirs}" in str(refused.value)
    assert f"system identifier {ours}" in str(refused.value)
    assert peek(MESSAGES) == [(0,)]
