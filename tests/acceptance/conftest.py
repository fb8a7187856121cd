from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.acceptance.failover_load import Record
from tests.acceptance.harness import Env, prepare
from tests.pg import created_session_database, drop_schema, new_schema_name


@pytest.fixture
def env(pg_url: str, schema: str) -> Iterator[Env]:
    made = prepare(pg_url, schema)
    yield made
    made.close()


@pytest.fixture(scope="module")
def module_env(pg_url: str) -> Iterator[Env]:
    """An :class:`Env` on a schema the module's tests share (a module's fleet works there)."""
    name = new_schema_name()
    made = prepare(pg_url, name)
    yield made
    made.close()
    if not created_session_database():
        drop_schema(pg_url, name)


def uses_fleet(item: pytest.Item) -> bool:
    return any(name.endswith("_fleet") for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within a module, the tests served by its fleet (a ``*_fleet`` fixture) run last:
    the fleet starts at the first of them and stops at the module's end, so it is never
    running beside a test's own workers (their sessions would add up)."""
    first: dict[str, int] = {}
    for n, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], n)
    items.sort(key=lambda item: (first[item.nodeid.split("::", 1)[0]], uses_fleet(item)))


@pytest.fixture
def record(pg_url: str, schema: str) -> Record:
    """Where the failover tests' workers record their runs (the test's own server)."""
    return Record(pg_url, schema)
