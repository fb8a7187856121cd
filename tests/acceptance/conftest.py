from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.acceptance.harness import Env, prepare
from tests.pg import created_session_database, drop_schema, new_schema_name


@pytest.fixture
def env(pg_url: str, schema: str) -> Env:
    return prepare(pg_url, schema)


@pytest.fixture(scope="module")
def module_env(pg_url: str) -> Iterator[Env]:
    """An :class:`Env` on a schema the module's tests share (a module's fleet works there)."""
    name = new_schema_name()
    yield prepare(pg_url, name)
    if not created_session_database():
        drop_schema(pg_url, name)
