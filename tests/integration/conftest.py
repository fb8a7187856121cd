from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Queue
from psycopg import sql

from pg_transport.db.migrate import current_version, ensure_schema, latest_version
from pg_transport.db.pool import Connector
from pg_transport.publish.publisher import Publisher
from pg_transport.sql import load_schema
from pg_transport.store import Store


def build_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    """Create ``schema`` at the latest version from schema.sql: what migrating builds
    (tests/integration/test_schema.py proves the catalogs equal) in about half the time
    of applying every migration in turn, for the many tests that only need a schema.
    Nothing, when another fixture has created it already."""
    if current_version(conn, schema) is not None:
        return
    with conn.transaction():
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(load_schema(schema))
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.schema_version (version) SELECT pg_catalog.generate_series(1, %s)"
            ).format(sql.Identifier(schema)),
            [latest_version()],
        )


class PublishingStore(Store):
    """A store with the publisher a transport composes beside it (``publisher``), so a
    test claims and publishes through one object as the transport does through two."""

    def __init__(
        self, connector: Connector, schema: str, *, publisher_flushes: bool = True, **options: Any
    ) -> None:
        super().__init__(connector, schema, **options)
        self.publisher = Publisher(
            connector, schema, flushes=publisher_flushes, max_message_bytes=self.max_message_bytes
        )


@pytest.fixture
def store(pg_url: str, schema: str) -> Iterator[PublishingStore]:
    connector = Connector(pg_url)
    with connector.connection() as conn:
        build_schema(conn, schema)
    ensure_schema(connector, schema, auto_migrate=True)  # (finds it at the latest version)
    yield PublishingStore(connector, schema)
    connector.close()


class Peek:
    """Direct SQL on a test schema, to look at rows behind the store's back."""

    def __init__(self, pg_url: str, schema: str) -> None:
        self.conn = psycopg.connect(pg_url, autocommit=True)
        self.schema = schema

    def __call__(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        text = sql.SQL(query).format(schema=sql.Identifier(self.schema))
        cur = self.conn.execute(text, params)
        return cur.fetchall() if cur.description else []

    def wait_for_backend(self, pid: int, condition: str, failure: str) -> None:
        """Until backend ``pid`` meets ``condition`` (SQL on its ``pg_stat_activity``
        row); ``failure`` if it has not in 10 s."""
        self.wait_until(
            f"SELECT {condition} FROM pg_stat_activity WHERE pid = %s", pid, failure=failure
        )

    def wait_until(self, query: str, *params: Any, failure: str) -> None:
        """Until ``query`` answers one row, true; ``failure`` if it has not in 10 s."""
        deadline = time.monotonic() + 10
        while self(query, *params) != [(True,)]:
            assert time.monotonic() < deadline, failure

    def wait_for_lock(self, pid: int, failure: str) -> None:
        """Until backend ``pid`` waits for a lock; ``failure`` if it has not in 10 s."""
        self.wait_for_backend(pid, "wait_event_type = 'Lock'", failure)

    def expire_leases(self) -> None:
        """What the passing of a visibility timeout does, without waiting for it."""
        self(
            "UPDATE {schema}.message SET visible_at = now() - interval '1 second'"
            " WHERE visible_at > now() AND visible_at < 'infinity'"  # (parked: not leased)
        )


@pytest.fixture
def peek(pg_url: str, schema: str, store: Store) -> Iterator[Peek]:
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


@pytest.fixture
def conn(broker_url: str, schema: str) -> Iterator[Connection]:
    """A connected kombu connection to the test schema (modules may define their own)."""
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()
        yield c


@pytest.fixture
def rows(pg_url: str, schema: str, conn: Connection) -> Iterator[Peek]:
    """Direct SQL on the schema ``conn`` created."""
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


@contextmanager
def idle_consumer(broker_url: str, options: dict[str, Any], queue: Queue) -> Iterator[list[float]]:
    """A consumer of ``queue`` draining events in a thread (20 s at most), entered once
    its claim has come back empty and it waits: from then on only a wake-up (or its
    poll, ``options['polling_interval']``) brings it a message. Yields the monotonic
    times its messages arrived; on the way out, waits for the thread to end."""
    got: list[float] = []
    with Connection(broker_url, transport_options=options) as consumer_conn:
        consumer = Consumer(
            consumer_conn,
            [queue],
            accept=["json"],
            callbacks=[lambda body, msg: (got.append(time.monotonic()), msg.ack())],
        )
        consumer.consume()
        thread = threading.Thread(target=consumer_conn.drain_events, kwargs={"timeout": 20})
        thread.start()
        engine = consumer_conn.transport.engine
        deadline = time.monotonic() + 10
        while not engine.waiting:  # its claim found nothing: from here only a wake-up helps
            assert time.monotonic() < deadline, "the consumer never came to wait"
            time.sleep(0.005)
        try:
            yield got
        finally:
            thread.join(20)
