"""The hot queries use their indexes: EXPLAIN (FORMAT JSON) pins each to its plan.

pgq's sessions plan every prepared statement once (``plan_cache_mode =
force_generic_plan``), so the plan that runs is the generic one, made without seeing
the parameters (a claim's limit, the number of queues). That is the plan checked
here: PREPARE, then EXPLAIN EXECUTE. A backlog of 100,000 rows in one queue (with
statistics) is enough for the planner to prefer a scan of the whole table whenever the
query's shape allows one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg.abc import Query

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.sql import load_named, to_positional
from pg_transport.store import Lease, Store, claim_params
from tests.integration.conftest import Peek, build_schema
from tests.pg import created_session_database, drop_schema, new_schema_name

# The sessions a test holds at most (measured peak, -n 0).
pytestmark = pytest.mark.sessions(4)


def walk(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from walk(child)


def scans(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(node type, index or relation name) of every node of a plan tree."""
    return [
        (node["Node Type"], node.get("Index Name") or node.get("Relation Name"))
        for node in walk(plan)
    ]


def load_backlog(peek: Peek) -> None:
    # One deep queue, the common case (Celery's default queue), is the hard one: with
    # one queue name in its statistics, the planner expects every row to match.
    peek(
        "INSERT INTO {schema}.message (queue, priority, payload)"
        " SELECT 'q1', n %% 3, '{{}}' FROM generate_series(1, 100000) AS n"
    )
    peek("ANALYZE {schema}.message")


@pytest.fixture
def backlog(store: Store, peek: Peek) -> Store:
    """A backlog of the test's own (for a test that adds rows to it)."""
    load_backlog(peek)
    return store


@pytest.fixture(scope="module")
def shared_backlog(pg_url: str) -> Iterator[Store]:
    """The backlog, made once for the module's tests that only plan on it (each plan is
    made in a transaction rolled back: rows and statistics stay as loaded)."""
    schema = new_schema_name()
    connector = Connector(pg_url)
    with connector.connection() as conn:
        build_schema(conn, schema)
    ensure_schema(connector, schema, auto_migrate=True)
    peek = Peek(pg_url, schema)
    try:
        load_backlog(peek)
    finally:
        peek.conn.close()
    yield Store(connector, schema)
    connector.close()
    if not created_session_database():
        drop_schema(pg_url, schema)


@pytest.fixture
def planned(shared_backlog: Store) -> Iterator[Store]:
    yield shared_backlog
    shared_backlog.connector.discard_idle()  # (no idle session kept between tests)


def generic_plan(
    store: Store,
    name: str,
    params: dict[str, Any],
    *,
    analyze: bool = False,
    setup: Sequence[Query] = (),
) -> dict[str, Any]:
    """The plan a pgq session runs for a named query (rolled back when analyzed), after
    the statements ``setup`` in the same transaction."""
    text, names = to_positional(store.q[name])
    with (
        psycopg.connect(store.connector.conninfo, autocommit=True) as conn,
        conn.transaction(force_rollback=True),
    ):
        conn.execute("SET LOCAL plan_cache_mode TO force_generic_plan")
        conn.execute("SET LOCAL jit TO off")  # (as in pgq's sessions: no_jit)
        for statement in setup:
            conn.execute(statement)
        conn.execute(f"PREPARE pinned AS {text}")
        options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
        cur = psycopg.ClientCursor(conn)
        arguments = ", ".join(["%s"] * len(names))
        cur.execute(f"EXPLAIN ({options}) EXECUTE pinned({arguments})", [params[n] for n in names])
        row = cur.fetchone()
        conn.execute("DEALLOCATE pinned")
    assert row is not None
    found = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return dict(found[0]["Plan"])


def uses(nodes: list[tuple[str, str | None]], index: str) -> bool:
    return any(name == index for _, name in nodes)


def no_seq_scan(nodes: list[tuple[str, str | None]]) -> bool:
    """No scan of the whole message table (small tables are scanned, rightly)."""
    return ("Seq Scan", "message") not in nodes


TOKENS = {"ids": [1, 2, 3], "leases": [1, 1, 1], "queues": ["q1", "q1", "q1"]}
BOUND = {"max_bytes": 16 << 20, "max_message_bytes": 16 << 20}

# What a consumer's sessions run, planned once (generic): name -> (parameters, indexes).
CONSUMER = {
    # The acks riding on a claim find their rows by primary key, the picked rows too.
    "claim": (
        claim_params(
            ["q1", "q2"], [30.0, 30.0], 16, [5, 5], [Lease(1, 1, "q1"), Lease(2, 1, "q1")]
        ),
        ("message_claim_idx", "message_pkey"),
    ),
    "pop": ({"queues": ["q1"], "limit": 16, **BOUND}, ("message_claim_idx", "message_pkey")),
    "ack": (TOKENS, ("message_pkey",)),
    "release": ({**TOKENS, "channel_prefix": "c", "failed": True}, ("message_pkey",)),
    "renew": ({**TOKENS, "vts": [30.0, 30.0, 30.0]}, ("message_pkey",)),
    "settle": ({**TOKENS, "channel_prefix": "c"}, ("message_pkey",)),
    # An idle consumer's question: when does the first not-yet-visible message fall due?
    "next_due": ({"queues": ["q1", "q2"], "since": 0.0}, ("message_claim_idx",)),
}

# The rest run on sessions that plan for the values they get (a queue's size is best
# counted by a scan when that queue is most of the table): name -> (parameters, indexes).
OTHERS = {
    "size": ({"queue": "q7"}, ("message_claim_idx",)),
    "purge": ({"queue": "q7"}, ("message_claim_idx",)),
    "delete_queue": ({"queue": "q7"}, ("message_claim_idx",)),
    "dead_letter": ({"id": 7, "lease": 1, "queue": "q1", "reason": "r"}, ("message_pkey",)),
    "maintain": ({"queues": ["q1"], "follows_retention": 60.0}, ("message_expiring_idx",)),
    "drop_messages": ({"queues": ["gone.pidbox"]}, ("message_claim_idx",)),
}


@pytest.mark.parametrize("name", sorted(CONSUMER))
def test_the_generic_plan_of_each_consumer_query_uses_its_index(planned: Store, name: str) -> None:
    params, indexes = CONSUMER[name]
    nodes = scans(generic_plan(planned, name, params))
    for index in indexes:
        assert uses(nodes, index), (name, index, nodes)
    assert no_seq_scan(nodes), (name, nodes)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_the_plan_of_each_other_queue_query_uses_its_index(planned: Store, name: str) -> None:
    params, indexes = OTHERS[name]
    with (
        psycopg.connect(planned.connector.conninfo, autocommit=True) as conn,
        conn.transaction(force_rollback=True),
    ):
        row = conn.execute("EXPLAIN (FORMAT JSON) " + planned.q[name], params).fetchone()
    assert row is not None
    nodes = scans((row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"])
    for index in indexes:
        assert uses(nodes, index), (name, index, nodes)
    assert no_seq_scan(nodes), (name, nodes)


def claim_buffers(store: Store, queue: str, limit: int) -> tuple[int, int]:
    """(shared buffers touched, rows the message scans threw away) of one real claim,
    rolled back."""
    plan = generic_plan(store, "claim", claim_params([queue], [30.0], limit, [5], []), analyze=True)
    removed = sum(
        node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        for node in walk(plan)
        if node.get("Relation Name") == "message"
    )
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"], removed


@pytest.mark.parametrize("head", ["in flight", "delayed", "in flight, higher priority"])
def test_claim_never_reads_rows_that_are_not_visible(store: Store, peek: Peek, head: str) -> None:
    # 20,000 invisible rows published before the ready ones: the head of the queue in
    # arrival order (or in priority order). Leased (claimed, not acked) or delayed (ETA),
    # a claim must go straight to the ready rows instead of stepping over every one.
    ready = (
        "INSERT INTO {schema}.message (queue, payload) SELECT %s, '{{}}'"
        " FROM generate_series(1, 10)"
    )
    peek(ready, "plain")
    peek(
        "INSERT INTO {schema}.message (queue, priority, visible_at, read_ct, payload)"
        " SELECT 'q', %s, now() + interval '1 hour', %s, '{{}}' FROM generate_series(1, 20000)",
        9 if "priority" in head else 0,
        0 if head == "delayed" else 1,
    )
    peek(ready, "q")
    peek("VACUUM ANALYZE {schema}.message")
    baseline, _ = claim_buffers(store, "plain", 4)
    touched, removed = claim_buffers(store, "q", 4)
    assert removed == 0, f"the claim read {removed} rows it could not take"
    # The invisible head spans ~100 index leaf pages and hundreds of heap pages.
    assert touched <= baseline + 10, (touched, baseline)
    assert [c.read_ct for c in store.claim(["q"], [30.0], 4)] == [1, 1, 1, 1]


def test_status_reads_the_parked_rows_of_a_backlog_and_nothing_else(
    backlog: Store, peek: Peek
) -> None:
    # Ordered messages parked behind their keys' heads (visible_at 'infinity') in the deep
    # queue, at each of its priorities, and in a small queue: status_blocked reaches them
    # from the end of the claim index, never by reading the backlog of 100,000.
    peek(
        "INSERT INTO {schema}.message (queue, priority, payload, okey, visible_at, due_at)"
        " SELECT %s, n %% 3, '{{}}', 'k' || n %% 4, 'infinity', now()"
        " FROM generate_series(1, %s) AS n",
        "q1",
        30,
    )
    peek(
        "INSERT INTO {schema}.message (queue, payload, okey, visible_at, due_at)"
        " SELECT 'q2', '{{}}', 'k', 'infinity', now() FROM generate_series(1, 5)"
    )
    peek("VACUUM ANALYZE {schema}.message")
    status = load_named("status.sql", backlog.schema, "pg_transport.ops")
    query = status["status_blocked"]

    def explained(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query).fetchone()
        assert row is not None
        return dict((row[0] if isinstance(row[0], list) else json.loads(row[0]))[0])

    with psycopg.connect(backlog.connector.conninfo, autocommit=True) as conn:
        assert conn.execute(query).fetchall() == [
            ("q1", 4, 30, pytest.approx(0.0, abs=60)),
            ("q2", 1, 5, pytest.approx(0.0, abs=60)),
        ]
        [(jit,)] = conn.execute("SELECT pg_jit_available() AND current_setting('jit')::bool")
        # Its estimate (the planner cannot tell how few levels it walks) is past
        # jit_above_cost: compiled, it would take hundreds of milliseconds. pgq status
        # runs it as here, in a transaction without JIT.
        assert not jit or "JIT" in explained(conn)
        with conn.transaction(force_rollback=True):
            conn.execute(status["status_snapshot"])
            conn.execute(status["status_no_jit"])
            top = explained(conn)
        [(pages,)] = peek("SELECT relpages FROM pg_class WHERE oid = '{schema}.message'::regclass")
    assert "JIT" not in top
    plan = top["Plan"]
    nodes = scans(plan)
    assert uses(nodes, "message_claim_idx"), nodes
    assert no_seq_scan(nodes) and ("Parallel Seq Scan", "message") not in nodes, nodes
    removed = sum(
        node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        for node in walk(plan)
        if node.get("Relation Name") == "message"
    )
    assert removed == 0, f"status_blocked read {removed} rows that are not parked"
    # A few index descents per queue and priority, and the parked rows' pages.
    touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert touched < 100 < pages, (touched, pages)
