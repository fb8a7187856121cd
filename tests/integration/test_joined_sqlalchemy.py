"""``pg_transport.transaction()`` with SQLAlchemy 2 (``postgresql+psycopg``): a Session
or a Connection's transaction carries the messages published in the block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

import pg_transport
from pg_transport import TransactionRefused
from pg_transport.fanin.backend import forget
from pg_transport.store import Store
from tests.integration.conftest import Peek

MESSAGES = "SELECT count(*) FROM {schema}.message"


def sqlalchemy_url(pg_url: str, dbname: str | None = None) -> str:
    url = pg_url.replace("postgresql://", "postgresql+psycopg://", 1)
    return url.rsplit("/", 1)[0] + f"/{dbname}" if dbname else url


@pytest.fixture
def engine(pg_url: str, schema: str, store: Store) -> Iterator[Engine]:
    eng = create_engine(sqlalchemy_url(pg_url), pool_size=2, max_overflow=0)
    with eng.begin() as conn:
        conn.execute(text(f'CREATE TABLE "{schema}".orders (id bigserial PRIMARY KEY, label text)'))
    yield eng
    eng.dispose()


@pytest.fixture
def client(broker_url: str, schema: str, store: Store) -> Iterator[Celery]:
    app = Celery("joined-sqlalchemy", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    yield app
    forget(app)
    app.close()


def labels(peek: Peek) -> list[str]:
    rows = peek("SELECT payload->>'body' FROM {schema}.message")
    return sorted(json.loads(body)[0][0] for (body,) in rows)


def order(schema: str, label: str) -> Any:
    return text(f'INSERT INTO "{schema}".orders (label) VALUES (:label)').bindparams(label=label)


def test_a_session_commits_its_rows_and_messages_in_one_transaction(
    engine: Engine, client: Celery, schema: str, peek: Peek
) -> None:
    with Session(engine) as session, pg_transport.transaction(session):
        session.execute(order(schema, "a"))
        client.send_task("shop.ship", args=["a"])
        own = session.execute(text("SELECT pg_catalog.pg_current_xact_id()::xid::text"))
        xid = own.scalar_one()
        assert peek(MESSAGES) == [(0,)]
        session.commit()
        # The session's next transaction (perhaps on another pooled connection) is the
        # one the next publish joins.
        client.send_task("shop.ship", args=["b"])
        assert peek(MESSAGES) == [(1,)]
        session.rollback()
    assert peek("SELECT xmin::text FROM {schema}.message") == [(xid,)]
    assert labels(peek) == ["a"]


def test_a_session_rollback_and_a_rolled_back_savepoint(
    engine: Engine, client: Celery, schema: str, peek: Peek
) -> None:
    with Session(engine) as session, pg_transport.transaction(session):
        client.send_task("shop.ship", args=["gone"])
        session.rollback()
        client.send_task("shop.ship", args=["kept"])
        nested = session.begin_nested()
        client.send_task("shop.ship", args=["savepoint"])
        nested.rollback()
        with session.begin_nested():
            client.send_task("shop.ship", args=["released"])
        session.commit()
    assert labels(peek) == ["kept", "released"]


def test_a_connection_commits_as_it_goes(
    engine: Engine, client: Celery, schema: str, peek: Peek
) -> None:
    with engine.connect() as conn, pg_transport.transaction(conn):
        # No statement yet: the publish begins the Connection's transaction, as
        # SQLAlchemy's autobegin would, and its commit() or rollback() ends it.
        client.send_task("shop.ship", args=["rolled back"])
        conn.rollback()
        conn.execute(order(schema, "a"))
        client.send_task("shop.ship", args=["a"])
        assert peek(MESSAGES) == [(0,)]
        conn.commit()
    assert labels(peek) == ["a"]
    assert peek("SELECT label FROM {schema}.orders") == [("a",)]


def test_a_session_on_another_database_is_refused_naming_both(
    pg_url: str, client: Celery, store: Store, peek: Peek
) -> None:
    elsewhere = create_engine(sqlalchemy_url(pg_url, "postgres"), pool_size=1)
    try:
        with Session(elsewhere) as session:
            with pytest.raises(TransactionRefused) as refused, pg_transport.transaction(session):
                client.send_task("shop.ship", args=["a"])
            session.execute(text("SELECT 1"))  # the session's transaction is untouched
    finally:
        elsewhere.dispose()
    assert "SQLAlchemy Session (postgresql+psycopg)" in str(refused.value)
    assert "database 'postgres'" in str(refused.value)
    assert peek(MESSAGES) == [(0,)]


def test_another_sqlalchemy_driver_is_refused_naming_it() -> None:
    with (
        Session(create_engine("sqlite://")) as session,
        pytest.raises(TransactionRefused, match=r"SQLAlchemy Session \(sqlite\+pysqlite\)"),
    ):
        pg_transport.transaction(session)
