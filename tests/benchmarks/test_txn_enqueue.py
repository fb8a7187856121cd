"""The transactional-enqueue benchmark measures what it says and counts every task.

Small (a few dozen requests, three kills a way), deselected by default like the other
benchmarks: ``pytest -m benchmark tests/benchmarks/test_txn_enqueue.py``. Needs the
local Redis for the ``redis-on-commit`` way.
"""

from __future__ import annotations

import pytest
import redis

from benchmarks.txn_enqueue import WAYS, main, parse_args

pytestmark = pytest.mark.benchmark


def test_every_way_is_measured_and_pgq_in_the_transaction_loses_nothing(pg_url: str) -> None:
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/13").ping()
    except redis.RedisError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    result = main(
        [
            "--pg-url",
            pg_url,
            "--redis-url",
            "redis://127.0.0.1:6379/13",
            "--requests",
            "40",
            "--chunk",
            "10",
            "--kills",
            "3",
            "--kill-after",
            "0.05",
        ]
    )
    assert set(result["ways"]) == set(WAYS)
    assert result["ways"]["redis-on-commit"]["ratio_to_baseline"] == 1.0
    for way, found in result["ways"].items():
        assert found["requests_per_s"] > 0 and 0 < found["p50_ms"] <= found["p99_ms"], way
        assert found["kills"] == 3
        assert found["rows_committed"] > 0, way  # the producers got to commit
        assert found["phantom"] == 0, way  # no way sends a task for a rolled-back row
    txn = result["ways"]["pgq-txn"]
    assert txn["lost"] == 0
    assert txn["tasks"] == txn["rows_committed"]


def test_an_unknown_way_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--ways", "pgq-txn,kafka"])
