"""Real faults against the store: a publish whose commit answer is lost is not doubled."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pg_transport.publish.publisher import Publisher
from pg_transport.store import Store
from tests.integration.conftest import Peek


def test_publish_retried_after_an_ambiguous_commit_is_not_duplicated(
    pg_url: str, store: Store, peek: Peek, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Publisher._insert_on
    attempts: list[int] = []

    def commit_then_lose_the_connection(
        self: Store, conn: psycopg.Connection[Any], params: dict[str, Any]
    ) -> None:
        real(self, conn, params)  # autocommit: the row is committed here
        attempts.append(conn.info.backend_pid)
        if len(attempts) == 1:
            with psycopg.connect(pg_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s, 10000)", [conn.info.backend_pid])
            conn.execute("SELECT 1")  # what the client sees: its connection is gone

    monkeypatch.setattr(Publisher, "_insert_on", commit_then_lose_the_connection)
    store.publisher.publish("q", {"body": "once", "properties": {}}, publish_key="k-1")
    assert len(attempts) == 2 and attempts[0] != attempts[1]  # retried, on a new session
    assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]


def test_publish_without_a_key_is_not_retried(
    pg_url: str, store: Store, peek: Peek, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Publisher._insert_on
    attempts: list[int] = []

    def commit_then_lose_the_connection(
        self: Store, conn: psycopg.Connection[Any], params: dict[str, Any]
    ) -> None:
        real(self, conn, params)
        attempts.append(1)
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", [conn.info.backend_pid])
        conn.execute("SELECT 1")

    monkeypatch.setattr(Publisher, "_insert_on", commit_then_lose_the_connection)
    # Without a key a retry could duplicate: the error reaches the caller instead.
    with pytest.raises(psycopg.OperationalError):
        store.publisher.publish("q", {"body": "once", "properties": {}})
    assert attempts == [1]
    assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]
