"""kombu's own integration base classes, run on pgq.

``t/integration/common.py`` of the installed kombu's sdist (fetched by
:mod:`tests.upstream`) holds the broker-agnostic classes every kombu transport's
integration test subclasses. Here they are subclassed for pgq as kombu's test_redis.py
does for Redis (plus the TTL class, as its py-amqp test does), each test on a fresh
schema. docs/conformance.md lists the results and the classes left out, with why.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
from kombu import Connection

from tests.upstream import UpstreamUnavailable, load_module


def _common() -> ModuleType:
    try:
        return load_module("kombu", "t/integration/common.py", "kombu_upstream_common")
    except UpstreamUnavailable as exc:
        pytest.skip(f"kombu's integration suite is not available: {exc}", allow_module_level=True)
        raise  # (skip raises)


common = _common()

# Nothing listens on port 1: every attempt to connect there is refused.
UNREACHABLE = "pgq://postgres@127.0.0.1:1/test?connect_timeout=2"


class PgqFixtures:
    @pytest.fixture
    def connection(self, broker_url: str, schema: str) -> Iterator[Connection]:
        conn = Connection(broker_url, transport_options={"schema": schema})
        yield conn
        conn.release()

    @pytest.fixture
    def invalid_connection(self, schema: str) -> Iterator[Connection]:
        conn = Connection(UNREACHABLE, transport_options={"schema": schema})
        yield conn
        conn.release()

    @pytest.fixture
    def failover_connection(self, broker_url: str, schema: str) -> Iterator[Connection]:
        """kombu's failover list: the unreachable URL first, then the test server's."""
        conn = Connection(f"{UNREACHABLE};{broker_url}", transport_options={"schema": schema})
        conn.transport  # noqa: B018 (the transport takes the list in: kombu's port is set)
        yield conn
        conn.release()


class TestPgqBasicFunctionality(PgqFixtures, common.BasicFunctionality):
    pass


class TestPgqExchangeTypes(PgqFixtures, common.BaseExchangeTypes):
    pass


class TestPgqPriority(PgqFixtures, common.BasePriority):
    # Higher numbers first, as on RabbitMQ (kombu's default for this class).
    PRIORITY_ORDER = "asc"


class TestPgqMessage(PgqFixtures, common.BaseMessage):
    pass


class TestPgqEventLoop(PgqFixtures, common.BaseEventLoop):
    pass


class TestPgqTimeToLive(PgqFixtures, common.BaseTimeToLive):
    pass


class TestPgqFailover(PgqFixtures, common.BaseFailover):
    pass
