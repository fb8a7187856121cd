"""The producers benchmark runs its producers at once, counts what they published, and
names a producer's failure instead of waiting on it.

Small and quick (a few producers, a few publishes each), so it runs with the default
tests: real producer processes publishing through pgq on the test Postgres.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from benchmarks import brokers, layers, table_health
from benchmarks.layers import targets_of
from benchmarks.producers import Burst, burst, cpu_ticks, main, measure, parse_args, purge
from benchmarks.targets import Target

PRODUCERS, TASKS = 3, 40  # ~60 ms of publishing each: a late-scheduled producer still overlaps


@pytest.fixture
def target(pg_url: str) -> Iterator[Target]:
    # Made as the command makes it; a fresh schema (dropped on the way out).
    with targets_of(parse_args(["--brokers", "pgq", "--pg-url", pg_url])) as made:
        yield made["pgq"]


def queued(pg_url: str, target: Target) -> int:
    schema = sql.Identifier(target.transport_options["schema"])
    with psycopg.connect(pg_url, autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {}.message WHERE queue = %s").format(schema)
        [(count,)] = conn.execute(query, (target.queue,)).fetchall()
    return int(count)


def test_the_producers_publish_at_once_and_every_publish_is_counted(
    target: Target, pg_url: str
) -> None:
    found = burst(target, PRODUCERS, TASKS, timeout=60.0)
    assert len(found.spans) == PRODUCERS and found.published == PRODUCERS * TASKS
    # Released together: every producer started before any of them was done.
    assert max(start for start, _ in found.spans) < min(end for _, end in found.spans)
    assert found.seconds >= max(end - start for start, end in found.spans)
    # A burst this short may see no clock tick of /proc/stat (10 ms): then no share.
    assert found.cpu_busy is None or 0 <= found.cpu_busy <= 1
    # What they published is in the queue: the timed publishes and one untimed each.
    assert queued(pg_url, target) == PRODUCERS * (TASKS + 1)
    assert purge(target) == PRODUCERS * (TASKS + 1)
    assert queued(pg_url, target) == 0


def test_the_machine_s_busy_ticks_count_a_process_s_cpu_time() -> None:
    before = cpu_ticks()
    if before is None:
        pytest.skip("no /proc/stat here")
    spun = time.process_time() + 0.2
    while time.process_time() < spun:  # 0.2 s of this process's CPU: ~20 busy ticks
        pass
    after = cpu_ticks()
    assert after is not None
    busy, every = after[0] - before[0], after[1] - before[1]
    assert busy >= 10 and every >= busy


def test_every_burst_starts_on_an_empty_queue(target: Target, pg_url: str) -> None:
    found = measure({"pgq": target}, [1, 2], 2, rounds=2, timeout=60.0)
    assert {count: len(bursts) for count, bursts in found["pgq"].bursts.items()} == {1: 2, 2: 2}
    assert queued(pg_url, target) == 0


def test_a_producer_that_fails_is_named_not_waited_for(target: Target) -> None:
    unreachable = Target(
        "pgq://127.0.0.1:1/test", target.queue, dict(target.transport_options), dict(target.env)
    )
    with pytest.raises(RuntimeError, match=r"(?s)a producer failed:.*cannot connect to Postgres"):
        burst(unreachable, 2, TASKS, timeout=60.0)


def test_a_rate_is_every_publish_over_the_first_start_to_the_last_end() -> None:
    found = Burst([(10.0, 12.0), (11.0, 14.0)], tasks=100)
    assert found.published == 200 and found.seconds == 4.0 and found.rate == 50.0


@pytest.mark.parametrize(
    ("parse", "argv", "named"),
    [
        (parse_args, ["--producers", "2,0"], "at least 1"),
        (parse_args, ["--producers", "two"], "whole numbers"),
        (parse_args, ["--producers", ","], "no producer count"),
        (parse_args, ["--brokers", "rabbitmq"], "rabbitmq"),
        # benchmarks.layers, whose broker arguments the producers command takes
        (layers.parse_args, ["--brokers", "pgq,rabbitmq"], "rabbitmq"),
        (layers.parse_args, ["--tasks", "0"], "at least 1"),
        # the pgbench run's length, checked alike by both commands that take it
        (layers.parse_args, ["--pgbench-seconds", "-1"], "--pgbench-seconds: must be >= 0"),
        (brokers.parse_args, ["--pgbench-seconds", "-1"], "--pgbench-seconds: must be >= 0"),
        # the message table's fill factor, as Postgres takes it
        (
            table_health.parse_args,
            ["--fillfactor", "5"],
            "--fillfactor: must be between 10 and 100, got 5",
        ),
        (
            table_health.parse_args,
            ["--fillfactor", "ninety"],
            "--fillfactor: must be a whole number, got 'ninety'",
        ),
    ],
    ids=[
        "producers-zero",
        "producers-word",
        "producers-none",
        "producers-broker",
        "layers-broker",
        "layers-tasks",
        "layers-pgbench-seconds",
        "brokers-pgbench-seconds",
        "table-health-fillfactor-range",
        "table-health-fillfactor-word",
    ],
)
def test_bad_arguments_are_named(
    parse: Callable[[list[str]], object],
    argv: list[str],
    named: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
    assert named in capsys.readouterr().err


def test_the_command_reports_each_count_of_producers(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--brokers",
        "pgq",
        "--producers",
        "2,1",
        "--tasks",
        "3",
        "--rounds",
        "1",
        "--pg-url",
        pg_url,
        "--json",
    ]
    assert main(argv) == 0
    found = json.loads(capsys.readouterr().out)
    assert list(found) == ["pgq"] and list(found["pgq"]) == ["1", "2"]
    for count in ("1", "2"):
        assert len(found["pgq"][count]["rates"]) == 1 and found["pgq"][count]["rate"] > 0
