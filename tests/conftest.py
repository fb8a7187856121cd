from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pg import drop_schema, find_postgres, new_schema_name, to_broker_url


@pytest.fixture(scope="session")
def pg_url() -> str:
    return find_postgres()


@pytest.fixture
def schema(pg_url: str) -> Iterator[str]:
    name = new_schema_name()
    yield name
    drop_schema(pg_url, name)


@pytest.fixture(autouse=True)
def _results_listeners() -> Iterator[None]:
    """Each test's result waiters' sessions end with it (one per schema otherwise)."""
    yield
    from pg_transport.results.listener import stop_listeners

    stop_listeners()


@pytest.fixture
def broker_url(pg_url: str) -> str:
    return to_broker_url(pg_url)
