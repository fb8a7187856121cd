from __future__ import annotations

import pytest

from tests.acceptance.harness import Env, prepare


@pytest.fixture
def env(pg_url: str, schema: str) -> Env:
    return prepare(pg_url, schema)
