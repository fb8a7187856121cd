"""A queue's own limits (docs/flow-control.md): the transport option queue_rate_limits,
written at worker start as `pgq limit set queue:<name>` would write them, and the
refusal of a queue-wide concurrency limit (concurrency limits are per key)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from click.testing import CliRunner

from pg_transport.errors import LimitError
from pg_transport.fanin.backend import forget
from pg_transport.kombu import hooks
from pg_transport.ops.cli import main
from pg_transport.ops.limits import Limits
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_flow_limits import Q, delivered, message
from tests.pg import to_broker_url


@pytest.fixture
def app(broker_url: str, schema: str, store: PublishingStore) -> Iterator[Celery]:
    made = Celery("queue-limits", broker=broker_url, set_as_current=False)
    made.conf.broker_transport_options = {
        "schema": schema,
        "queue_rate_limits": {Q: {"rate": "2/h", "burst": 2}, "other": "10/s"},
    }
    yield made
    forget(made)
    made.close()


def limits(peek: Peek) -> list[tuple[object, ...]]:
    return peek(
        "SELECT name, rate_count, rate_period, burst, concurrency, origin"
        " FROM {schema}.flow_limit ORDER BY name"
    )


def test_queue_rate_limits_are_written_at_worker_start_and_enforced(
    app: Celery, store: PublishingStore, peek: Peek
) -> None:
    """What a worker's start writes (the hook its worker_init runs): each queue's limit,
    origin config; the claim then starts at most its burst, and what it parked waits for
    the next token."""
    hooks._define_limits(app)
    assert limits(peek) == [
        (f"queue:{Q}", 2, 3600.0, 2, None, "config"),
        ("queue:other", 10, 1.0, 1, None, "config"),
    ]
    for n in range(4):
        store.publisher.publish(Q, message(n))
    assert delivered(store.claim([Q], [30.0], 10)) == [0, 1]
    assert delivered(store.claim([Q], [30.0], 10)) == []


def test_a_limit_the_command_set_is_kept_over_the_option(
    app: Celery, store: PublishingStore, peek: Peek
) -> None:
    """As for task limits: `pgq limit set` (origin command) is kept at the next worker
    start; after `pgq limit reset` the option's is written again."""
    hooks._define_limits(app)
    Limits(store).set(f"queue:{Q}", burst=5)
    hooks._define_limits(app)
    assert limits(peek)[0] == (f"queue:{Q}", 2, 3600.0, 5, None, "command")
    assert Limits(store).reset(f"queue:{Q}") == "command"
    hooks._define_limits(app)
    assert limits(peek)[0] == (f"queue:{Q}", 2, 3600.0, 2, None, "config")


def test_a_bad_queue_rate_limit_stops_the_worker_start_naming_the_option(
    app: Celery, peek: Peek
) -> None:
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "queue_rate_limits": {Q: "ten per second"},
    }
    with pytest.raises(LimitError, match=r"queue_rate_limits\['limited'\]='ten per second'"):
        hooks._define_limits(app)
    assert limits(peek) == []


def test_a_queue_wide_concurrency_is_refused_not_ignored(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """A queue's own limit with a concurrency was written and never applied (slots are
    counted per key): the command and the API refuse it, naming the option."""
    done = CliRunner().invoke(
        main,
        ["limit", "set", f"queue:{Q}", "--concurrency", "3", "--url", to_broker_url(pg_url),
         "--schema", schema],
    )  # fmt: skip
    assert done.exit_code == 1
    assert "--concurrency='3'" in done.output and "queue-wide" in done.output, done.output
    with pytest.raises(LimitError, match="concurrency=3"):
        Limits(store).set(f"queue:{Q}", concurrency=3)
    assert limits(peek) == []
