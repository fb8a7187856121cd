"""The hot queries use their indexes: EXPLAIN (FORMAT JSON) pins each to its plan.

A backlog of 20,000 rows in several queues (with statistics) is enough for the
planner to prefer an index when one fits; a sequential scan here would mean the
query reads every queued message on each call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pg_transport.store import Store, claim_params
from tests.integration.conftest import Peek


def scans(plan: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(node type, index name) of every node of a plan tree."""
    yield plan["Node Type"], plan.get("Index Name")
    for child in plan.get("Plans", []):
        yield from scans(child)


@pytest.fixture
def backlog(store: Store, peek: Peek) -> Store:
    peek(
        "INSERT INTO {schema}.message (queue, priority, payload)"
        " SELECT 'q' || (n %% 20), n %% 3, '{{}}' FROM generate_series(1, 20000) AS n"
    )
    peek("ANALYZE {schema}.message")
    return store


def explain(store: Store, name: str, params: dict[str, Any]) -> list[tuple[str, str | None]]:
    with psycopg.connect(store.connector.conninfo, autocommit=True) as conn, \
            conn.transaction(force_rollback=True):
        row = conn.execute("EXPLAIN (FORMAT JSON) " + store.q[name], params).fetchone()
    assert row is not None
    found = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return list(scans(found[0]["Plan"]))


def uses(nodes: list[tuple[str, str | None]], index: str) -> bool:
    return any(name == index for _, name in nodes)


def no_seq_scan_of_message(nodes: list[tuple[str, str | None]]) -> bool:
    return all(kind != "Seq Scan" for kind, _ in nodes)


def test_claim_walks_the_claim_index(backlog: Store) -> None:
    # The acks riding on the claim find their rows by primary key.
    params = claim_params(["q1", "q2"], [30.0, 30.0], 16, [5, 5], [(1, 1), (2, 1)])
    nodes = explain(backlog, "claim", params)
    assert uses(nodes, "message_claim_idx"), nodes
    assert uses(nodes, "message_pkey"), nodes
    assert no_seq_scan_of_message(nodes), nodes


def test_ack_release_and_renew_use_the_primary_key(backlog: Store) -> None:
    tokens = {"ids": [1, 2, 3], "read_cts": [1, 1, 1]}
    for name, params in [
        ("ack", tokens),
        ("release", {**tokens, "channel": "c"}),
        ("renew", {**tokens, "vts": [30.0, 30.0, 30.0]}),
    ]:
        nodes = explain(backlog, name, params)
        assert uses(nodes, "message_pkey"), (name, nodes)
        assert no_seq_scan_of_message(nodes), (name, nodes)


def test_size_counts_through_the_claim_index(backlog: Store) -> None:
    nodes = explain(backlog, "size", {"queue": "q7"})
    assert uses(nodes, "message_claim_idx"), nodes
    assert no_seq_scan_of_message(nodes), nodes


def claim_buffers(store: Store, queue: str, limit: int) -> tuple[int, int]:
    """(shared buffers touched, rows the message scan threw away) of one real claim,
    rolled back."""
    params = claim_params([queue], [30.0], limit, [5], [])
    with psycopg.connect(store.connector.conninfo, autocommit=True) as conn, \
            conn.transaction(force_rollback=True):
        row = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store.q["claim"], params
        ).fetchone()
    assert row is not None
    plan = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"]
    removed = sum(
        node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        for node in walk(plan) if node.get("Relation Name") == "message"
    )
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"], removed


def walk(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from walk(child)


@pytest.mark.parametrize("head", ["in flight", "delayed"])
def test_claim_never_reads_rows_that_are_not_visible(store: Store, peek: Peek, head: str) -> None:
    # 20,000 invisible rows published before the ready ones: the head of the queue in
    # arrival order. Leased (claimed, not acked) or delayed (ETA), a claim must go
    # straight to the ready rows instead of stepping over every one of them.
    ready = "INSERT INTO {schema}.message (queue, payload) SELECT %s, '{{}}'" \
        " FROM generate_series(1, 10)"
    peek(ready, "plain")
    peek(
        "INSERT INTO {schema}.message (queue, visible_at, read_ct, payload)"
        " SELECT 'q', now() + interval '1 hour', %s, '{{}}' FROM generate_series(1, 20000)",
        1 if head == "in flight" else 0,
    )
    peek(ready, "q")
    peek("VACUUM ANALYZE {schema}.message")
    baseline, _ = claim_buffers(store, "plain", 4)
    touched, removed = claim_buffers(store, "q", 4)
    assert removed == 0, f"the claim read {removed} rows it could not take"
    # The invisible head spans ~100 index leaf pages and hundreds of heap pages.
    assert touched <= baseline + 5, (touched, baseline)
    assert [c.read_ct for c in store.claim(["q"], [30.0], 4)] == [1, 1, 1, 1]
