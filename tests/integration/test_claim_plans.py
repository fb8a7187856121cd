"""Each gate of the claim uses its index, and a claim's cost does not grow with the queue.

The claim is one statement read as named parts (docs/design/claim.md). test_plans pins
the pick and the acks (message_claim_idx, message_pkey), test_ordering_plans the key
gate and the hold on a backlog of parked messages; here, the gates left: the follows
gate (message_task_idx) and the hand-off from an ack to its key's next message
(message_key_idx), and what one claim reads at two depths of a queue. Plans are the
generic ones pgq's sessions run, on a backlog of 100,000 rows (test_plans.backlog).
"""

from __future__ import annotations

from typing import Any

import pytest

from pg_transport.store import Lease, Store, claim_params
from tests.integration.conftest import Peek
from tests.integration.test_plans import backlog, generic_plan, no_seq_scan, scans, uses, walk

__all__ = ["backlog"]  # (the fixture, used by name)

LIMIT = 16


def message_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [node for node in walk(plan) if node.get("Relation Name") == "message"]


def subplan(plan: dict[str, Any], name: str) -> dict[str, Any]:
    [node] = [n for n in walk(plan) if n.get("Subplan Name") == f"CTE {name}"]
    return node


def claimed_in(store: Store, queue: str, acks: list[Lease] | None = None) -> dict[str, Any]:
    """One claim of LIMIT over ``queue``, executed and rolled back: its plan."""
    params = claim_params([queue], [30.0], LIMIT, [5], acks or [])
    return generic_plan(store, "claim", params, analyze=True)


def buffers(plan: dict[str, Any]) -> int:
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def unplaced(peek: Peek, query: str, *params: Any) -> None:
    """Rows inserted with their ordering places given (the place triggers skipped)."""
    with peek.conn.transaction():
        peek.conn.execute("SET LOCAL session_replication_role = replica")
        peek(query, *params)


def test_the_follows_gate_finds_the_followed_task_by_its_index(backlog: Store, peek: Peek) -> None:
    # LIMIT followers, each of a task whose message is still there (not run yet): the
    # gate finds that message by task id and parks the follower behind it.
    peek(
        "INSERT INTO {schema}.message (queue, payload, task_id)"
        " SELECT 'led', '{{}}', 't' || n FROM generate_series(1, %s) AS n",
        LIMIT,
    )
    peek(
        "INSERT INTO {schema}.message (queue, payload, follows, follow_until)"
        " SELECT 'f', '{{}}', 't' || n, now() + interval '1 hour'"
        " FROM generate_series(1, %s) AS n",
        LIMIT,
    )
    peek("ANALYZE {schema}.message")
    nodes = scans(generic_plan(backlog, "claim", claim_params(["f"], [30.0], LIMIT, [5], [])))
    assert uses(nodes, "message_task_idx"), nodes
    assert no_seq_scan(nodes), nodes
    plan = claimed_in(backlog, "f")
    assert subplan(plan, "held")["Actual Rows"] == LIMIT  # each parked behind its task
    probes = [n for n in message_nodes(plan) if n.get("Index Name") == "message_task_idx"]
    assert all(n["Actual Rows"] <= n["Actual Loops"] for n in probes), probes


def test_the_hand_off_finds_each_keys_next_message_by_the_key_index(
    backlog: Store, peek: Peek
) -> None:
    # LIMIT keys, each with its first message delivered (lease 1) and its next parked:
    # a claim carrying the acks of the first ones takes the next ones, found by key.
    unplaced(
        peek,
        "INSERT INTO {schema}.message"
        " (queue, payload, okey, oseq, visible_at, due_at, read_ct, lease)"
        " SELECT 'o', '{{}}', 'k' || k, s,"
        "   CASE WHEN s = 0 THEN now() + interval '1 hour' ELSE 'infinity' END,"
        "   CASE WHEN s = 1 THEN now() - interval '1 second' END,"
        "   1 - s, 1 - s"
        " FROM generate_series(1, %s) AS k, generate_series(0, 1) AS s ORDER BY k, s",
        LIMIT,
    )
    peek("ANALYZE {schema}.message")
    heads = peek("SELECT id FROM {schema}.message WHERE queue = 'o' AND oseq = 0 ORDER BY id")
    acks = [Lease(int(id_), 1, "o") for (id_,) in heads]
    handed = subplan(claimed_in(backlog, "o", acks), "handed")
    assert handed["Actual Rows"] == LIMIT, handed
    nodes = scans(handed)
    assert uses(nodes, "message_key_idx"), nodes
    assert no_seq_scan(nodes), nodes
    generic = scans(generic_plan(backlog, "claim", claim_params(["o"], [30.0], LIMIT, [5], acks)))
    assert uses(generic, "message_key_idx"), generic
    assert no_seq_scan(generic), generic


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "one key per message"])
def test_a_claim_reads_as_much_from_a_deep_queue_as_from_a_shallow_one(
    store: Store, peek: Peek, keyed: bool
) -> None:
    # Two queues of one table, 1,000 and 100,000 ready messages: a claim of LIMIT reads
    # the claim index's first LIMIT entries, a probe of each gate per candidate, and the
    # rows it updates, whatever lies behind them. (A third queue sorts last in the
    # indexes: the entries a claim adds at the right edge of an index cost less than
    # inside it, which is a matter of the name, not of the depth.)
    for queue, depth in (("shallow", 1_000), ("shallow_deep", 100_000), ("z", 1_000)):
        unplaced(
            peek,
            "INSERT INTO {schema}.message (queue, payload, okey, oseq)"
            " SELECT %s, '{{}}', CASE WHEN %s THEN %s || n END, CASE WHEN %s THEN n END"
            " FROM generate_series(1, %s) AS n",
            queue,
            keyed,
            queue,
            keyed,
            depth,
        )
    peek("VACUUM ANALYZE {schema}.message")
    shallow, deep = claimed_in(store, "shallow"), claimed_in(store, "shallow_deep")
    # (Keyed, the answer ends with the row featured: the claim met a keyed message.)
    assert shallow["Actual Rows"] == deep["Actual Rows"] == LIMIT + keyed
    for plan in (shallow, deep):
        # Nothing read and thrown away, but by the key gate's probe for another live
        # message of the key, which finds the candidate itself (one row a loop).
        for node in message_nodes(plan):
            live = node.get("Index Name") == "message_key_live_idx"
            assert node.get("Rows Removed by Filter", 0) <= live, node
    # The same plan over the same index: a deeper queue costs at most an index level.
    assert buffers(deep) <= buffers(shallow) + 10, (buffers(deep), buffers(shallow))


def test_a_plain_queue_claim_reads_nothing_of_fair_share(backlog: Store) -> None:
    """The claim of plain queues holds nothing of fair share (fair_claim is another
    statement); fair_claim over a queue that is not fair (the backlog's 100,000 rows)
    has the fair pick's nodes but never runs them: no probe of message_fair_idx, no row
    of fair_cursor read, and it takes LIMIT rows by the claim index."""
    plain = claimed_in(backlog, "q1")
    assert not [n for n in walk(plain) if "fair" in str(n.get("Index Name") or "")]
    assert not [n for n in walk(plain) if n.get("Relation Name") == "fair_cursor"]
    params = claim_params(["q1"], [30.0], LIMIT, [5], [])
    plan = generic_plan(backlog, "fair_claim", params, analyze=True)
    fair = [n for n in message_nodes(plan) if n.get("Index Name") == "message_fair_idx"]
    assert fair and all(n["Actual Loops"] == 0 for n in fair), fair
    cursor = [n for n in walk(plan) if n.get("Relation Name") == "fair_cursor"]
    assert all(n["Actual Rows"] == 0 for n in cursor), cursor
    assert subplan(plan, "candidates")["Actual Rows"] == LIMIT


def test_a_fair_claim_walks_its_keys_by_the_fair_index(backlog: Store, peek: Peek) -> None:
    """A fair queue of 10,000 messages over 100 keys: the claim's pick descends
    message_fair_idx once per key visited (no scan of a key's backlog), reads no row of
    the claim index for it, and delivers one message of each of LIMIT keys."""
    backlog.declare_queue("fq", fair=True)
    peek(
        "INSERT INTO {schema}.message (queue, payload, fkey)"
        " SELECT 'fq', '{{}}', 'k' || lpad((n %% 100)::text, 3, '0')"
        " FROM generate_series(1, 10000) AS n"
    )
    peek("ANALYZE {schema}.message")
    params = claim_params(["fq"], [30.0], LIMIT, [5], [])
    nodes = scans(generic_plan(backlog, "fair_claim", params))
    assert uses(nodes, "message_fair_idx"), nodes
    assert no_seq_scan(nodes), nodes
    plan = generic_plan(backlog, "fair_claim", params, analyze=True)
    fair = [n for n in message_nodes(plan) if n.get("Index Name") == "message_fair_idx"]
    # every probe reads at most the rows its key gives (one ready head, or a share)
    assert all(n["Actual Rows"] <= n["Actual Loops"] * LIMIT for n in fair), fair
    assert sum(n["Actual Rows"] for n in fair) <= 6 * LIMIT, fair
    assert not [
        n
        for n in message_nodes(plan)
        if n.get("Index Name") == "message_claim_idx" and "fq" in str(n.get("Index Cond", ""))
    ]


FLOW_CTES = {"CTE flow_meets", "CTE slots", "CTE slotted", "CTE flow_wants", "CTE rate",
             "CTE flow_held", "CTE flow_parked"}  # fmt: skip


def flow_calls(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [n for n in walk(plan) if n.get("Function Name") in ("flow_tokens", "flow_slots")]


def test_a_claim_without_limits_carries_nothing_of_them(backlog: Store) -> None:
    """The plain claim holds no flow gate (flow_claim is another statement): no CTE of
    the flow parts, no call of flow_tokens or flow_slots; flow_limit is read only by
    its probes (claim_flow_on). With a limit defined it picks nothing: no candidate, not
    one row of the backlog read. flow_claim without a limit has the flow nodes but never
    runs them, and takes LIMIT rows."""
    params = claim_params(["q1"], [30.0], LIMIT, [5], [])
    plain = claimed_in(backlog, "q1")
    assert not {n.get("Subplan Name") for n in walk(plain)} & FLOW_CTES
    assert not flow_calls(plain)
    probes = [n for n in walk(plain) if n.get("Relation Name") == "flow_limit"]
    assert 0 < len(probes) <= 3, probes
    assert subplan(plain, "candidates")["Actual Rows"] == LIMIT
    limit = (
        f'INSERT INTO "{backlog.schema}".flow_limit (name, rate_count, rate_period, origin)'
        " VALUES ('task:elsewhere', 1, 1, 'command')"
    )
    stopped = generic_plan(backlog, "claim", params, analyze=True, setup=[limit])
    assert subplan(stopped, "candidates")["Actual Rows"] == 0
    assert all(n["Actual Rows"] == 0 for n in message_nodes(stopped)), message_nodes(stopped)
    flow = generic_plan(backlog, "flow_claim", params, analyze=True)
    assert {n.get("Subplan Name") for n in walk(flow)} >= FLOW_CTES
    assert flow_calls(flow) and all(n["Actual Loops"] == 0 for n in flow_calls(flow))
    assert subplan(flow, "candidates")["Actual Rows"] == LIMIT
