"""The broker-agnostic suites, run on pgq."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection
from psycopg import sql

from tests.integration.suites.basic import BasicFunctionality
from tests.integration.suites.exchanges import ExchangeTypes
from tests.integration.suites.priority import Priority
from tests.integration.suites.ttl import MessageTTL


class PgqFixtures:
    @pytest.fixture
    def connection(self, broker_url: str, schema: str) -> Iterator[Connection]:
        with Connection(broker_url, transport_options={"schema": schema}) as conn:
            conn.connect()
            yield conn

    @pytest.fixture
    def other_connection(self, broker_url: str, schema: str) -> Iterator[Connection]:
        """A second, separate connection: routing state must not be per process."""
        with Connection(broker_url, transport_options={"schema": schema}) as conn:
            conn.connect()
            yield conn

    @pytest.fixture
    def dead_letters(self, pg_url: str, schema: str) -> Callable[[], list[tuple[Any, ...]]]:
        """(queue, reason) of every dead letter: where pgq keeps what it cannot route."""

        def read() -> list[tuple[Any, ...]]:
            with psycopg.connect(pg_url) as conn:
                return conn.execute(
                    sql.SQL("SELECT queue, reason FROM {}.dead_letter ORDER BY id").format(
                        sql.Identifier(schema)
                    )
                ).fetchall()

        return read


class TestBasicFunctionality(PgqFixtures, BasicFunctionality):
    pass


class TestExchangeTypes(PgqFixtures, ExchangeTypes):
    pass


class TestPriority(PgqFixtures, Priority):
    pass


class TestMessageTTL(PgqFixtures, MessageTTL):
    pass
