"""The layer benchmark times the calls it says it times, and leaves nothing patched.

Small and quick (a few dozen publishes), so it runs with the default tests: real pgq on
the test Postgres, and the local Redis where one answers.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import redis
from kombu.messaging import Producer
from psycopg import sql

import pg_transport.publish.publisher as store
from benchmarks.layers import (
    Layers,
    insert_floor,
    main,
    measure,
    parse_args,
    targets_of,
    without_python,
)
from benchmarks.pgbench import find_pgbench
from benchmarks.targets import Target
from pg_transport.db import wire

TASKS, ROUNDS = 15, 2
REDIS_DB = 12


@pytest.fixture
def targets(pg_url: str) -> Iterator[dict[str, Target]]:
    # Made as the command makes them, Redis left out where none answers (a Redis
    # database of the test's own; fresh pgq schemas: a process migrates a schema once).
    args = parse_args(
        ["--brokers", "pgq,pgq-async,redis", "--pg-url", pg_url, "--redis-db", str(REDIS_DB)]
    )
    with targets_of(args) as made:
        assert {"pgq", "pgq-async"} <= set(made)  # (only Redis may be left out)
        yield made


def test_every_publish_is_timed_at_every_depth(targets: dict[str, Target], pg_url: str) -> None:
    found = measure(targets, TASKS, ROUNDS)
    assert set(found) == set(targets)
    for name, layers in found.items():
        assert layers.published == TASKS * ROUNDS
        s = layers.seconds
        assert [len(s[d]) for d in ("apply_async", "call", "wire")] == [TASKS * ROUNDS] * 3
        for total, call, trips in zip(s["apply_async"], s["call"], s["wire"], strict=True):
            # Each depth is inside the one above it, and every publish made a round trip.
            assert 0 < trips <= call <= total, (name, total, call, trips)
        summary = layers.summary()
        assert summary["python_in_call_us"] > 0 and summary["outside_call_us"] > 0
        assert summary["rate"] > 0
    # The publishes timed are real: every one is in its broker (and the untimed first).
    for name, target in targets.items():
        if name.startswith("pgq"):
            schema = sql.Identifier(target.transport_options["schema"])
            with psycopg.connect(pg_url, autocommit=True) as conn:
                query = sql.SQL("SELECT count(*) FROM {}.message WHERE queue = %s").format(schema)
                [(count,)] = conn.execute(query, (target.queue,)).fetchall()
        else:
            count = redis.Redis.from_url(target.broker_url).llen(target.queue)
        assert count == TASKS * ROUNDS + 1, name


def test_nothing_stays_patched(targets: dict[str, Target]) -> None:
    before = (Producer._publish, wire.run_apart, wire.Statement.execute, store.run_apart)
    measure(targets, 2, 1)
    after = (Producer._publish, wire.run_apart, wire.Statement.execute, store.run_apart)
    assert after == before


def test_a_round_trip_outside_any_publish_is_not_counted() -> None:
    layers = Layers()
    layers.seconds = {
        "apply_async": [3.0, 5.0, 4.0],
        "call": [2.0, 3.0, 2.5],
        "wire": [1.0, 1.0, 2.0],
    }
    layers.published, layers.elapsed = 3, 12.0
    summary = layers.summary()
    assert summary["apply_async_us"] == 4.0e6
    assert summary["python_in_call_us"] == 1.0e6  # medians of 1.0, 2.0, 0.5
    assert summary["outside_call_us"] == 1.5e6  # of 1.0, 2.0, 1.5
    assert summary["without_python_us"] == 3.0e6  # of 2.0, 3.0, 3.5
    assert summary["rate"] == 0.25


def test_without_python_compares_with_redis_as_measured() -> None:
    found = {
        "redis": {"apply_async_us": 300.0, "without_python_us": 200.0},
        "pgq": {"apply_async_us": 360.0, "without_python_us": 310.0},
        "pgq-async": {"apply_async_us": 270.0, "without_python_us": 200.0},
    }
    assert without_python(found) == {"pgq": 300.0 / 310.0, "pgq-async": 1.5}
    assert without_python({"pgq": found["pgq"]}) == {}  # nothing to compare with


def test_pgq_s_insert_is_run_with_a_message_the_run_published(
    targets: dict[str, Target], pg_url: str
) -> None:
    if find_pgbench() is None:
        pytest.skip("pgbench not installed")
    measure(targets, 2, 1)
    floor = insert_floor(pg_url, targets, 1)
    assert set(floor) == {"durable", "committed"}
    assert all(found["status"] == "ok" for found in floor.values()), floor
    assert [floor[kind]["durable"] for kind in ("durable", "committed")] == [True, False]
    # pgbench's rows went into the first pgq target's queue, each with that payload.
    target = targets["pgq"]
    schema = sql.Identifier(target.transport_options["schema"])
    query = sql.SQL(
        "SELECT count(DISTINCT payload::text), count(*) FROM {}.message WHERE queue = %s"
    ).format(schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        [(payloads, rows)] = conn.execute(query, (target.queue,)).fetchall()
    assert rows > 2 + 1 + 10  # measure's publishes (and the untimed one), and pgbench's
    # measure's three messages differ (each its own task id); pgbench copied the first.
    assert payloads == 3
    assert insert_floor(pg_url, targets, 0) == {}


def test_the_command_prints_a_row_per_broker(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--brokers", "pgq", "--tasks", "3", "--rounds", "1", "--pg-url", pg_url]
    assert main([*argv, "--pgbench-seconds", "0"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:2] == ["broker", "publish/s"]
    assert rows[1].split()[0] == "pgq" and len(rows[1].split()) == 7
    # Without Redis nothing to set against; without pgbench's runs no line of them.
    assert not any(row.startswith(("without python", "pgq's INSERT")) for row in rows)
