"""The three ways an application holds a Postgres transaction, as the transactional
enqueue tests drive them: ``order(label)`` inserts an order row and enqueues the task
about it (``find_order``) in the same transaction, ``savepoint()`` opens a nested one.

Leaving :func:`transaction`'s block commits; an exception rolls back. Run by the tests
and by their producer subprocess (tests/acceptance/txn_producer.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

import pg_transport

FRONTS = ("psycopg", "sqlalchemy", "django")
TASK = "tests.acceptance.app.find_order"


@dataclass
class Txn:
    order: Callable[[str], None]
    savepoint: Callable[[], AbstractContextManager[Any]]


def client(broker_url: str, schema: str) -> Celery:
    app = Celery("txn-client", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    return app


def insert_sql(schema: str) -> str:
    return (
        sql.SQL("INSERT INTO {}.orders (label) VALUES (%s)")
        .format(sql.Identifier(schema))
        .as_string(None)
    )


class Fronts:
    """One application's handles on its database, for each of the three ways."""

    def __init__(self, pg_url: str, broker_url: str, schema: str) -> None:
        self.pg_url, self.schema = pg_url, schema
        self.app = client(broker_url, schema)
        self._engine: Any = None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
        if "django" in sys.modules:
            from django.db import connections

            from pg_transport.integrations.django import leave_atomic

            leave_atomic()
            connections.close_all()
        self.app.close()

    def enqueue(self, label: str) -> None:
        self.app.send_task(TASK, args=[label])

    @contextmanager
    def transaction(self, front: str) -> Iterator[Txn]:
        with getattr(self, f"_{front}")() as txn:
            yield txn

    @contextmanager
    def _psycopg(self) -> Iterator[Txn]:
        with psycopg.connect(self.pg_url) as conn:
            insert = insert_sql(self.schema)

            def order(label: str) -> None:
                conn.execute(insert, [label])  # type: ignore[arg-type]
                self.enqueue(label)

            with conn.transaction(), pg_transport.transaction(conn):
                yield Txn(order, conn.transaction)

    @contextmanager
    def _sqlalchemy(self) -> Iterator[Txn]:
        from sqlalchemy import create_engine, text
        from sqlalchemy.orm import Session

        if self._engine is None:
            url = self.pg_url.replace("postgresql://", "postgresql+psycopg://", 1)
            self._engine = create_engine(url, pool_size=1, max_overflow=0)
        statement = text(insert_sql(self.schema).replace("%s", ":label"))
        with Session(self._engine) as session, pg_transport.transaction(session):

            def order(label: str) -> None:
                session.execute(statement, {"label": label})
                self.enqueue(label)

            yield Txn(order, session.begin_nested)
            session.commit()

    @contextmanager
    def _django(self) -> Iterator[Txn]:
        from django.db import connection, transaction

        from pg_transport.integrations.django import join_atomic

        join_atomic()  # every atomic() on "default" is joined: no block of pgq's
        insert = insert_sql(self.schema)

        def order(label: str) -> None:
            with connection.cursor() as cur:
                cur.execute(insert, [label])
            self.enqueue(label)

        with transaction.atomic():
            yield Txn(order, transaction.atomic)


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
    import django

    django.setup()
