"""The batch benchmark publishes what it says, batched where it says, and reports it.

Small and quick (a few dozen publishes), so it runs with the default tests: real pgq on
the test Postgres, and the local Redis where one answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
import redis
from psycopg import sql

from benchmarks.batch import main, measure, parse_args, summary
from benchmarks.layers import targets_of
from benchmarks.targets import Target

TASKS, ROUNDS, SIZE = 10, 2, 4
REDIS_DB = 11


@pytest.fixture
def targets(pg_url: str) -> Iterator[dict[str, Target]]:
    args = parse_args(["--brokers", "pgq,redis", "--pg-url", pg_url, "--redis-db", str(REDIS_DB)])
    with targets_of(args) as made:
        assert "pgq" in made  # (only Redis may be left out)
        yield made


def test_pgq_publishes_one_at_a_time_and_in_batches(
    targets: dict[str, Target], pg_url: str
) -> None:
    rates = measure(targets, TASKS, ROUNDS, SIZE)
    expected = {"pgq", "pgq batch 4"} | ({"redis"} if "redis" in targets else set())
    assert set(rates) == expected
    assert all(len(found) == ROUNDS and min(found) > 0 for found in rates.values())
    target = targets["pgq"]
    query = sql.SQL(
        "SELECT count(*), count(DISTINCT xmin::text) FROM {}.message WHERE queue = %s"
    ).format(sql.Identifier(target.transport_options["schema"]))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        [(messages, transactions)] = conn.execute(query, (target.queue,)).fetchall()
    # The untimed first publish, then each round's one-at-a-time and batched publishes:
    # a transaction per message one at a time, one per batch of 4 (4, 4 and 2) batched.
    assert messages == 1 + ROUNDS * TASKS * 2
    assert transactions == 1 + ROUNDS * TASKS + ROUNDS * 3
    if "redis" in targets:
        assert (
            redis.Redis.from_url(targets["redis"].broker_url).llen(targets["redis"].queue)
            == 1 + ROUNDS * TASKS
        )


def test_the_summary_sets_every_way_against_redis() -> None:
    found = summary(
        {
            "redis": [100.0, 300.0, 200.0],
            "pgq": [150.0, 160.0, 170.0],
            "pgq batch 100": [400.0, 500.0, 450.0],
        }
    )
    assert found["redis"] == {"rate": 200.0, "ratio_to_redis": 1.0}
    assert found["pgq"]["ratio_to_redis"] == 0.8
    assert found["pgq batch 100"]["ratio_to_redis"] == 2.25
    assert summary({"pgq": [1.0]}) == {"pgq": {"rate": 1.0}}  # nothing to compare with


def test_the_command_prints_json_and_a_table(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--brokers",
        "pgq",
        "--tasks",
        "3",
        "--rounds",
        "1",
        "--batch-size",
        "2",
        "--pg-url",
        pg_url,
    ]
    assert main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["batch_size"] == 2 and set(found["ways"]) == {"pgq", "pgq batch 2"}
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:2] == ["way", "publish/s"]
    assert [row.split()[0] for row in rows[1:3]] == ["pgq", "pgq"]


@pytest.mark.parametrize("bad", [["--batch-size", "0"], ["--tasks", "-1"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)
