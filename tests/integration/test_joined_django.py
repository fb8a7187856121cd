"""pgq in Django's transactions (the psycopg 3 backend, a real settings module:
tests/django_settings.py): ``pg_transport.transaction(connection)`` inside
``atomic()``, and ``join_atomic()``, which joins every ``atomic()`` on its database."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
django = pytest.importorskip("django")
django.setup()

from django.db import connection, connections, transaction  # noqa: E402

import pg_transport  # noqa: E402
from pg_transport import TransactionRefused  # noqa: E402
from pg_transport.fanin.backend import forget  # noqa: E402
from pg_transport.integrations.django import join_atomic, leave_atomic  # noqa: E402
from pg_transport.store import Store  # noqa: E402
from tests.integration.conftest import Peek  # noqa: E402

MESSAGES = "SELECT count(*) FROM {schema}.message"


@pytest.fixture
def client(broker_url: str, schema: str, store: Store) -> Iterator[Celery]:
    app = Celery("joined-django", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    with connection.cursor() as cur:
        cur.execute(f'CREATE TABLE "{schema}".orders (id bigserial PRIMARY KEY, label text)')
    yield app
    forget(app)
    app.close()
    connections.close_all()


@pytest.fixture
def joined_atomic() -> Iterator[None]:
    join_atomic()
    yield
    leave_atomic()


def labels(peek: Peek) -> list[str]:
    rows = peek("SELECT payload->>'body' FROM {schema}.message")
    return sorted(json.loads(body)[0][0] for (body,) in rows)


def order(schema: str, label: str) -> None:
    with connection.cursor() as cur:
        cur.execute(f'INSERT INTO "{schema}".orders (label) VALUES (%s)', [label])


def test_the_transaction_of_an_atomic_block_carries_the_message(
    client: Celery, schema: str, peek: Peek
) -> None:
    with transaction.atomic(), pg_transport.transaction(connection):
        order(schema, "a")
        client.send_task("shop.ship", args=["a"])
        with connection.cursor() as cur:
            cur.execute("SELECT pg_catalog.pg_current_xact_id()::xid::text")
            (xid,) = cur.fetchone()
        assert peek(MESSAGES) == [(0,)]
    assert peek("SELECT xmin::text FROM {schema}.message") == [(xid,)]
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        with pg_transport.transaction(connection):
            client.send_task("shop.ship", args=["rolled back"])
        1 / 0  # noqa: B018
    assert labels(peek) == ["a"]


@pytest.mark.usefixtures("joined_atomic")
def test_join_atomic_joins_every_atomic_block_and_its_savepoints(
    client: Celery, schema: str, peek: Peek
) -> None:
    with transaction.atomic():
        order(schema, "a")
        client.send_task("shop.ship", args=["a"])
        with pytest.raises(ZeroDivisionError), transaction.atomic():  # a savepoint
            client.send_task("shop.ship", args=["savepoint"])
            1 / 0  # noqa: B018
        with transaction.atomic():
            client.send_task("shop.ship", args=["released"])
        assert peek(MESSAGES) == [(0,)]
    assert labels(peek) == ["a", "released"]
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        client.send_task("shop.ship", args=["rolled back"])
        1 / 0  # noqa: B018
    assert labels(peek) == ["a", "released"]
    # Outside atomic(): as before, committed at once.
    client.send_task("shop.ship", args=["apart"])
    assert labels(peek) == ["a", "apart", "released"]


@pytest.mark.usefixtures("joined_atomic")
def test_on_commit_still_publishes_after_the_commit(client: Celery, peek: Peek) -> None:
    with transaction.atomic():
        transaction.on_commit(lambda: client.send_task("shop.ship", args=["on commit"]))
    assert labels(peek) == ["on commit"]


def test_a_transaction_outside_atomic_is_refused(client: Celery, peek: Peek) -> None:
    refused = pytest.raises(TransactionRefused, match=r"outside transaction\.atomic")
    with refused, pg_transport.transaction(connection):
        client.send_task("shop.ship", args=["a"])
    assert peek(MESSAGES) == [(0,)]


def test_another_database_is_refused_naming_both(client: Celery, peek: Peek) -> None:
    join_atomic("elsewhere")
    try:
        with pytest.raises(TransactionRefused) as refused, transaction.atomic(using="elsewhere"):
            client.send_task("shop.ship", args=["a"])
    finally:
        leave_atomic("elsewhere")
    assert "Django's connection 'elsewhere'" in str(refused.value)
    assert "database 'postgres'" in str(refused.value)
    assert peek(MESSAGES) == [(0,)]


def test_another_driver_is_refused_naming_it() -> None:
    with pytest.raises(TransactionRefused, match=r"'lite' \(backend 'sqlite'"):
        join_atomic("lite")
    with pytest.raises(TransactionRefused, match=r"'lite' \(backend 'sqlite'"):
        pg_transport.transaction(connections["lite"])
