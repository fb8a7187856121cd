"""``get()`` on a task published in a transaction still open raises at once.

No worker can see the task before the application's transaction commits, so a wait
there could only run to its timeout (docs/transactional-enqueue.md). pgq knows which
tasks the open ``pg_transport.transaction()`` block published: the wait is refused with
:class:`~pg_transport.NotYetCommitted`, well before the timeout given. After the block,
the same result is waited for as any other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, group, states

import pg_transport
from pg_transport import NotYetCommitted

TIMEOUT = 60.0


@pytest.fixture
def app(broker_url: str, schema: str) -> Iterator[Celery]:
    app = Celery("joined-get", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.result_backend_transport_options = {"schema": schema}
    yield app
    app.close()


@pytest.fixture
def app_conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url) as conn:
        yield conn


def test_get_inside_the_publishing_transaction_raises_at_once(
    app: Celery, app_conn: psycopg.Connection[Any]
) -> None:
    app.backend  # noqa: B018 (the schema exists before the transaction)
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        result = app.send_task("shop.ship", args=[1])
        started = time.monotonic()
        with pytest.raises(NotYetCommitted, match="still open") as refused:
            result.get(timeout=TIMEOUT)
        assert time.monotonic() - started < TIMEOUT / 4
        assert result.id in str(refused.value)
    # Committed: the same result is waited for as usual (stored here, as a worker would).
    app.backend.store_result(result.id, 42, states.SUCCESS)
    assert result.get(timeout=TIMEOUT) == 42


def test_a_group_published_in_the_transaction_is_refused_too(
    app: Celery, app_conn: psycopg.Connection[Any]
) -> None:
    app.backend  # noqa: B018
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        results = group(app.signature("shop.ship", args=[n]) for n in range(3)).apply_async()
        with pytest.raises(NotYetCommitted):
            results.get(timeout=TIMEOUT)


def test_a_task_published_outside_the_block_is_waited_for(
    app: Celery, app_conn: psycopg.Connection[Any]
) -> None:
    elsewhere = app.send_task("shop.ship", args=[2])
    with app_conn.transaction(), pg_transport.transaction(app_conn):
        app.backend.store_result(elsewhere.id, 7, states.SUCCESS)
        assert elsewhere.get(timeout=TIMEOUT) == 7
