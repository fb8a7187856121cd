"""Ordered delivery stays cheap under a deep backlog of parked messages.

A queue with many messages per ordering key holds one ready head per key and parks the
rest (visible_at 'infinity', due_at set), as the claim leaves them. The claim, next_due
and the trigger that promotes a key's next message must go straight to what they want
through message_claim_idx and message_key_idx: never read the parked rows, never scan
the table. Checked on the generic plans pgq's sessions run (PREPARE, then EXPLAIN
EXECUTE, as in test_plans) and on what one real execution reads (EXPLAIN ANALYZE, and
the transaction's own table and index statistics for the trigger).

The backlog: 1,000,000 messages over 10,000 keys in one queue, made once for the module
by one INSERT ... SELECT (some 8 to 15 s on a shared two-core machine).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector
from pg_transport.store import Lease, Store, claim_params
from tests.integration.test_plans import generic_plan, no_seq_scan, scans, uses, walk
from tests.pg import drop_schema, new_schema_name

# The sessions a test holds at most (measured peak, -n 0).
pytestmark = pytest.mark.sessions(4)

QUEUE = "q1"
MESSAGES = 1_000_000
PER_KEY = 100
LIMIT = 16
# What one claim of LIMIT heads may read: the claim index's first LIMIT entries, a key
# index descent per candidate, the LIMIT rows it updates and their index entries (some
# 500 pages). A claim that stepped over the parked rows would read tens of thousands:
# their claim-index entries alone fill some 5,000 leaf pages, their heap 28,000.
MAX_CLAIM_BUFFERS = 1000
MAX_LOOKUP_BUFFERS = 40


@dataclass(frozen=True)
class Backlog:
    store: Store
    conn: psycopg.Connection[Any]
    schema: str
    messages: int
    keys: int

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        text = sql.SQL(query).format(schema=sql.Identifier(self.schema))
        cur = self.conn.execute(text, params)
        return cur.fetchall() if cur.description else []


@pytest.fixture(scope="module")
def backlog(pg_url: str) -> Iterator[Backlog]:
    messages, keys = MESSAGES, MESSAGES // PER_KEY
    schema = new_schema_name()
    connector = Connector(pg_url)
    ensure_schema(connector, schema, auto_migrate=True)
    conn = psycopg.connect(pg_url, autocommit=True)
    found = Backlog(Store(connector, schema), conn, schema, messages, keys)
    try:
        # Unlogged (while it is still empty): plans and pages read are the same, and a
        # shared server is spared some 400 MB of WAL.
        found.sql("ALTER TABLE {schema}.message SET UNLOGGED")
        with conn.transaction():
            # One INSERT ... SELECT, key by key (each index filled in its own order, not
            # at random places). oseq interleaves the keys as a round-robin publisher
            # would; the place trigger (message_place) only numbers rows whose oseq is
            # unset, so it is skipped here (replica role: no triggers), saving a
            # function call per row. The head of each key is ready, the rest parked,
            # due an hour ago: promoted, they come before every head still waiting.
            conn.execute("SET LOCAL session_replication_role = replica")
            found.sql(
                "INSERT INTO {schema}.message (queue, payload, okey, oseq, visible_at, due_at)"
                " SELECT %s, '{{}}', 'k' || lpad(k::text, 5, '0'), s * %s + k,"
                "   CASE WHEN s = 0 THEN now() - interval '1 second' ELSE 'infinity' END,"
                "   CASE WHEN s > 0 THEN now() - interval '1 hour' END"
                " FROM generate_series(0, %s - 1) AS k, generate_series(0, %s - 1) AS s"
                " ORDER BY k, s",
                QUEUE,
                keys,
                keys,
                PER_KEY,
            )
        found.sql("SELECT setval(%s::regclass, %s)", f"{schema}.message_oseq", messages + 1)
        found.sql("ANALYZE {schema}.message")
        yield found
    finally:
        conn.close()
        connector.close()
        drop_schema(pg_url, schema)


def claim_16() -> dict[str, Any]:
    return claim_params([QUEUE], [30.0], LIMIT, [5], [])


def message_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [node for node in walk(plan) if node.get("Relation Name") == "message"]


def rows_thrown_away(plan: dict[str, Any]) -> int:
    return sum(
        node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        for node in message_nodes(plan)
    )


def buffers(plan: dict[str, Any]) -> int:
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def candidate_scan(plan: dict[str, Any]) -> dict[str, Any]:
    """The claim's scan of ready rows (the one bounded by visible_at <= now())."""
    [node] = [
        node
        for node in message_nodes(plan)
        if node.get("Index Name") == "message_claim_idx"
        and "visible_at <= now()" in node.get("Index Cond", "")
    ]
    return node


def test_the_generic_claim_plan_uses_the_claim_and_key_indexes(backlog: Backlog) -> None:
    nodes = scans(generic_plan(backlog.store, "claim", claim_16()))
    assert uses(nodes, "message_claim_idx"), nodes
    assert uses(nodes, "message_key_idx"), nodes
    assert no_seq_scan(nodes), nodes


def test_a_claim_reads_the_heads_and_nothing_of_what_is_parked(backlog: Backlog) -> None:
    plan = generic_plan(backlog.store, "claim", claim_16(), analyze=True)
    scan = candidate_scan(plan)
    # The ready rows come off the claim index in order, no further than the limit: the
    # parked ones (visible_at 'infinity') lie past the index condition, never reached.
    assert scan["Actual Rows"] * scan["Actual Loops"] == LIMIT, scan
    # Each head's check for another live message of its key (one in flight) reads its
    # key's live entries: the head itself, and nothing parked.
    live = [n for n in message_nodes(plan) if n.get("Index Name") == "message_key_live_idx"]
    assert live, scans(plan)
    assert all(n.get("Rows Removed by Filter", 0) <= 1 for n in live), live
    assert rows_thrown_away(plan) == sum(n.get("Rows Removed by Filter", 0) for n in live)
    assert sum(n["Actual Loops"] for n in live if n["Actual Loops"]) <= LIMIT, live
    # Each candidate's check for an earlier message of its key: one descent of the key
    # index, finding nothing (these are heads), not a walk over its parked messages.
    gates = [n for n in message_nodes(plan) if n.get("Index Name") == "message_key_idx"]
    assert gates, scans(plan)
    assert all(n["Actual Rows"] == 0 for n in gates), gates
    assert sum(n["Actual Loops"] for n in gates) <= 2 * LIMIT, gates
    assert buffers(plan) <= MAX_CLAIM_BUFFERS, buffers(plan)
    assert plan["Actual Rows"] == LIMIT + 1  # 16 delivered (rolled back), the row featured


def test_a_claim_parks_newcomers_to_busy_keys_without_reading_the_backlog(
    backlog: Backlog,
) -> None:
    # One new message for each of LIMIT keys, each due (its countdown over) before the
    # heads became ready: the first rows in claim order. The claim finds an earlier
    # message of each one's key and parks it.
    setup = [
        "INSERT INTO {schema}.message (queue, payload, okey, visible_at)"
        " SELECT {queue}, '{{}}', 'k' || lpad((k * 7)::text, 5, '0'), now() - interval '1 minute'"
        " FROM generate_series(1, {limit}) AS k",
    ]
    names = {
        "schema": sql.Identifier(backlog.schema),
        "queue": sql.Literal(QUEUE),
        "limit": sql.Literal(LIMIT),
    }
    plan = generic_plan(
        backlog.store,
        "claim",
        claim_16(),
        analyze=True,
        setup=[sql.SQL(s).format(**names) for s in setup],
    )
    scan = candidate_scan(plan)
    assert scan["Actual Rows"] * scan["Actual Loops"] == LIMIT, scan
    assert rows_thrown_away(plan) == 0
    assert plan["Actual Rows"] == LIMIT + 1  # all of them come back held, the row featured
    [held] = [n for n in walk(plan) if n.get("Subplan Name") == "CTE held"]
    assert held["Actual Rows"] == LIMIT, held
    assert buffers(plan) <= MAX_CLAIM_BUFFERS, buffers(plan)


def test_next_due_skips_the_parked_rows(backlog: Backlog) -> None:
    params = {"queues": [QUEUE, "q2"], "since": 0.0}
    nodes = scans(generic_plan(backlog.store, "next_due", params))
    assert uses(nodes, "message_claim_idx"), nodes
    assert no_seq_scan(nodes), nodes
    plan = generic_plan(backlog.store, "next_due", params, analyze=True)
    # Nothing falls due (heads are ready, the rest parked at 'infinity'): one descent.
    assert all(n["Actual Rows"] <= 1 for n in message_nodes(plan)), scans(plan)
    assert rows_thrown_away(plan) == 0
    assert buffers(plan) <= MAX_LOOKUP_BUFFERS, buffers(plan)


def head_lookup(backlog: Backlog) -> str:
    """The trigger's query for a key's head (in message_leave), as the function holds
    it, its row's queue and key as parameters $1 and $2."""
    [[source]] = backlog.sql(
        "SELECT prosrc FROM pg_proc WHERE oid = %s::regprocedure",
        f"{backlog.schema}.message_leave()",
    )
    found = re.search(r"SELECT h\.id FROM .*?LIMIT 1", source, re.DOTALL)
    assert found, source
    query = found.group(0).replace("OLD.queue", "$1").replace("OLD.okey", "$2")
    assert "$1" in query and "$2" in query and "OLD." not in query, query
    return query


def test_the_trigger_finds_a_keys_head_through_the_key_index(backlog: Backlog) -> None:
    key = f"k{backlog.keys // 2:05d}"
    # A session of its own: the prepared statement goes with it.
    with (
        psycopg.connect(backlog.store.connector.conninfo, autocommit=True) as conn,
        conn.transaction(force_rollback=True),
    ):
        conn.execute("SET LOCAL plan_cache_mode TO force_generic_plan")
        conn.execute(f"PREPARE head(text, text) AS {head_lookup(backlog)}")
        cur = psycopg.ClientCursor(conn)
        for options in ("FORMAT JSON", "ANALYZE, BUFFERS, FORMAT JSON"):
            cur.execute(f"EXPLAIN ({options}) EXECUTE head(%s, %s)", [QUEUE, key])
            [[found]] = cur.fetchall()
            plan = found[0]["Plan"]
            assert uses(scans(plan), "message_key_idx"), scans(plan)
            assert no_seq_scan(scans(plan)), scans(plan)
    assert plan["Actual Rows"] == 1
    assert rows_thrown_away(plan) == 0
    assert buffers(plan) <= MAX_LOOKUP_BUFFERS, buffers(plan)


def xact_counts(backlog: Backlog) -> tuple[int, int, int, int]:
    """What this transaction did so far: scans of the message table (sequential ones:
    its own count excludes index scans), rows of it updated, its heap blocks fetched,
    scans of message_key_idx."""
    table, key_index = f"{backlog.schema}.message", f"{backlog.schema}.message_key_idx"
    [row] = backlog.sql(
        "SELECT pg_stat_get_xact_numscans(%s::regclass),"
        " pg_stat_get_xact_tuples_updated(%s::regclass),"
        " pg_stat_get_xact_blocks_fetched(%s::regclass),"
        " pg_stat_get_xact_numscans(%s::regclass)",
        table,
        table,
        table,
        key_index,
    )
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


@pytest.mark.parametrize("mode", ["auto", "force_generic_plan"])
def test_acking_heads_promotes_the_next_of_each_key_by_index(backlog: Backlog, mode: str) -> None:
    # The trigger as it runs: acks of LIMIT heads in one transaction, whose own table and
    # index statistics (pg_stat_xact) count every scan the trigger made.
    heads = backlog.sql(
        "SELECT id FROM {schema}.message WHERE queue = %s AND visible_at <= now()"
        " ORDER BY id LIMIT %s",
        QUEUE,
        LIMIT,
    )
    with backlog.conn.transaction(force_rollback=True):
        backlog.sql(f"SET LOCAL plan_cache_mode TO {mode}")
        before = xact_counts(backlog)
        backlog.sql("DELETE FROM {schema}.message WHERE id = ANY(%s)", [h for (h,) in heads])
        after = xact_counts(backlog)
        [(ready,)] = backlog.sql(
            "SELECT count(*) FROM {schema}.message WHERE queue = %s AND visible_at <= now()",
            QUEUE,
        )
    seq_scans, updated, heap_blocks, key_scans = (a - b for a, b in zip(after, before, strict=True))
    assert seq_scans == 0
    assert updated == LIMIT  # each key's next message promoted
    assert key_scans >= LIMIT  # the head lookups
    # The DELETE's own reads and, per ack, the head's row and the promoted one.
    assert heap_blocks <= 20 * LIMIT, heap_blocks
    assert ready == backlog.keys  # still one ready head per key


def test_claims_with_acks_riding_deliver_each_key_in_order(backlog: Backlog) -> None:
    # As a worker runs: each claim lands the acks of the previous one. A promoted message
    # (due an hour ago) comes before every head still waiting; the claim that acks a head
    # does not see the promotion its own delete made (one snapshot per statement), the
    # claim after it does.
    rounds = 6
    acks: list[Lease] = []
    delivered: list[dict[str, int]] = []  # per claim: key -> oseq
    for _ in range(rounds):
        batch = backlog.store.claim([QUEUE], [30.0], LIMIT, [5], acks=acks)
        assert len(batch) == LIMIT
        rows = backlog.sql(
            "SELECT okey, oseq FROM {schema}.message WHERE id = ANY(%s)", [c.id for c in batch]
        )
        delivered.append(dict(rows))
        assert len(delivered[-1]) == LIMIT  # never two of one key at once
        acks = [c.token for c in batch]
    backlog.store.ack(acks)
    seen: dict[str, list[int]] = {}
    for claim in delivered:
        for okey, oseq in claim.items():
            seen.setdefault(okey, []).append(oseq)
    for okey, oseqs in seen.items():
        # Each key's messages in order, from its first: oseq steps by the number of keys.
        first = int(okey[1:])
        assert oseqs == [first + s * backlog.keys for s in range(len(oseqs))], (okey, oseqs)
    for n, claim in enumerate(delivered[:-2]):
        # Acked by claim n + 1, promoted: delivered by claim n + 2 at the latest.
        later = delivered[n + 1].keys() | delivered[n + 2].keys()
        assert claim.keys() <= later, (n, sorted(claim.keys() - later))
    [(ready, parked)] = backlog.sql(
        "SELECT count(*) FILTER (WHERE visible_at <= now()),"
        " count(*) FILTER (WHERE visible_at = 'infinity') FROM {schema}.message"
        " WHERE queue = %s",
        QUEUE,
    )
    assert ready == backlog.keys  # one head per key, no more
    assert parked == backlog.messages - backlog.keys - rounds * LIMIT
