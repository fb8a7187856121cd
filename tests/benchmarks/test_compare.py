"""The comparison benchmark delivers every message it publishes, on every transport
that can run here, and says why it skipped the others.

Small and quick (a few dozen messages, short gaps), so it runs with the default tests
on the test Postgres. kombu's SQLAlchemy transport needs ``sqlalchemy`` (in the dev
extra), its pgmq transport the ``pgmq`` client (``pip install pgmq``, not a dependency
of pgq); each is reported as skipped where it is absent.
"""

from __future__ import annotations

import importlib.util
import json

import psycopg
import pytest

from benchmarks.compare import TRANSPORTS, WARMUP, main

MESSAGES, SAMPLES, ROUNDS = 20, 2, 2


def has_pgmq_extension(pg_url: str) -> bool:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        found = conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'pgmq'")
        return found.fetchone() is not None


def test_every_transport_delivers_what_it_publishes_or_says_why_it_was_skipped(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--pg-url", pg_url, "--messages", str(MESSAGES), "--samples", str(SAMPLES)]
    assert main([*argv, "--rounds", str(ROUNDS), "--max-gap", "0.05", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    runs = {"pgq"}
    if importlib.util.find_spec("sqlalchemy") is not None:
        runs.add("sqlalchemy")
    # pgmq's SQL: the server's extension, else the install the client ships (pgmq 1.1+).
    if importlib.util.find_spec("pgmq") is not None and (
        importlib.util.find_spec("pgmq.install") is not None or has_pgmq_extension(pg_url)
    ):
        runs |= {"pgmq", "pgmq-notify"}
    assert set(result["transports"]) == runs
    assert set(result["skipped"]) == set(TRANSPORTS) - runs
    assert all(reason for reason in result["skipped"].values())
    # Each round: the publish phase's messages (its first one, which connects and
    # declares, is purged before the rate and not counted) and each latency sample,
    # the warm-up ones too.
    published = ROUNDS * (MESSAGES + SAMPLES + WARMUP)
    for name, row in result["transports"].items():
        assert row["published"] == published, name
        assert row["consumed"] == row["published"], name
        assert row["left_in_queue"] == 0, name
        assert row["latency_samples"] == ROUNDS * SAMPLES, name
        assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"], name
        assert row["publish_per_s"] > 0 and row["consume_per_s"] > 0, name
    assert result["transports"]["pgq"]["publish_per_s_vs_pgq"] == 1.0
