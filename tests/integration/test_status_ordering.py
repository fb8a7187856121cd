"""`pgq status` and `pgq metrics` show ordered delivery held back: the ordering keys
blocked (messages a claim parked behind an earlier one of their key), those messages and
the age of the oldest, and the followers parked until the task they follow is done.

The rows are parked by real claims of keyed messages and followers published as
producers publish them (headers ``pgq-ordering-key``, ``pgq-follows``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pg_transport.ops import status as status_report
from pg_transport.store import Lease, Store
from pg_transport.web.reads import Reads
from tests.integration.conftest import Peek
from tests.integration.test_cli import invoke
from tests.integration.test_metrics import by_queue, parse_exposition


def keyed(name: str, key: str | None = None, **headers: Any) -> dict[str, Any]:
    """A message with task id ``name``, of ordering key ``key``."""
    if key is not None:
        headers["pgq-ordering-key"] = key
    return {"body": name, "properties": {}, "headers": {"id": name, **headers}}


@dataclass
class Held:
    """What :func:`hold_back` left in flight, by task id."""

    leases: dict[str, Lease]


def hold_back(store: Store, peek: Peek) -> Held:
    """Queue jobs: keys cust-1 (3 messages) and cust-2 (2), cust-3 (1), a plain message,
    a followable task p and a follower f of p, and a message delayed an hour. One claim
    takes the head of each key, the plain message and p, and parks the rest: cust-1's
    second and third (the second published 5 minutes ago), cust-2's second, and f."""
    for name, key in [
        ("a1", "cust-1"),
        ("a2", "cust-1"),
        ("a3", "cust-1"),
        ("b1", "cust-2"),
        ("b2", "cust-2"),
        ("c1", "cust-3"),
        ("plain", None),
    ]:
        store.publisher.publish("jobs", keyed(name, key))
    store.publisher.publish("jobs", keyed("p", **{"pgq-followable": True}))
    store.publisher.publish("jobs", keyed("f", **{"pgq-follows": "p"}))
    store.publisher.publish("jobs", keyed("later"), delay=3600)
    claimed = store.claim(["jobs"], [300.0], 20)
    leases = {c.payload["body"]: c.token for c in claimed if c.payload is not None}
    assert sorted(leases) == ["a1", "b1", "c1", "p", "plain"]
    peek(
        "UPDATE {schema}.message SET enqueued_at = now() - interval '300 seconds'"
        " WHERE payload->>'body' = 'a2'"
    )
    return Held(leases)


def status(url: str, schema: str) -> dict[str, dict[str, Any]]:
    result = invoke("status", "--json", "--url", url, "--schema", schema)
    assert result.exit_code == 0, result.output
    return {q.pop("queue"): q for q in json.loads(result.stdout)["queues"]}


def test_status_counts_blocked_keys_parked_messages_and_followers(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    held = hold_back(store, peek)
    store.declare_queue("idle")

    queues = status(broker_url, schema)
    jobs = queues["jobs"]
    age = jobs.pop("oldest_blocked_age_s")
    assert 300 <= age < 360
    # The delayed message falls due in an hour: neither a parked row (never due) nor the
    # follower (parked until its wait of 300 s runs out) counts as delayed.
    due = jobs.pop("next_due_in_s")
    assert 3500 < due <= 3600
    assert jobs == {
        "ready": 0,
        "in_flight": 5,
        "delayed": 1,
        "dead": 0,
        "oldest_ready_age_s": None,
        "blocked_keys": 2,
        "blocked": 3,
        "following": 1,
        "fair": False,
        "unique_queued": 0,
        "unique_running": 0,
    }
    assert queues["idle"] == {
        "ready": 0,
        "in_flight": 0,
        "delayed": 0,
        "dead": 0,
        "oldest_ready_age_s": None,
        "next_due_in_s": None,
        "blocked_keys": 0,
        "blocked": 0,
        "oldest_blocked_age_s": None,
        "following": 0,
        "fair": False,
        "unique_queued": 0,
        "unique_running": 0,
    }

    table = invoke("status", "--url", broker_url, "--schema", schema)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[2].split() == ["idle", "0", "0", "0", "0", "-", "-"]
    assert lines[3].split()[:5] == ["jobs", "0", "5", "1", "0"]
    at = lines.index("ordering:")
    assert lines[at + 1].split() == [
        "QUEUE",
        "BLOCKED",
        "KEYS",
        "MESSAGES",
        "BLOCKED",
        "OLDEST",
        "BLOCKED",
        "FOLLOWERS",
        "WAITING",
    ]
    # Only the queue holding messages back; "5m 0s" (or 5m 1s).
    assert lines[at + 2].split()[:4] == ["jobs", "2", "3", "5m"]
    assert lines[at + 2].split()[5:] == ["1"]
    assert lines[at + 3].startswith("clients: ")

    # cust-1's head is acked: its second message is promoted (ready), its third stays.
    assert store.ack([held.leases["a1"]]) == 1
    jobs = status(broker_url, schema)["jobs"]
    assert (jobs["ready"], jobs["in_flight"], jobs["blocked_keys"], jobs["blocked"]) == (1, 4, 2, 2)
    assert jobs["oldest_blocked_age_s"] < 60  # a3 and b2, published just now
    # p is done: its follower is woken.
    assert store.ack([held.leases["p"]]) == 1
    jobs = status(broker_url, schema)["jobs"]
    assert (jobs["ready"], jobs["in_flight"], jobs["following"]) == (2, 3, 0)
    # cust-2 is done with its head too; what is ready is taken, and cust-1's third
    # message is parked behind its second, now in flight.
    assert store.ack([held.leases["b1"]]) == 1
    claimed = store.claim(["jobs"], [300.0], 20)
    assert sorted(c.payload["body"] for c in claimed if c.payload) == ["a2", "b2", "f"]
    jobs = status(broker_url, schema)["jobs"]
    assert (jobs["ready"], jobs["in_flight"], jobs["blocked_keys"], jobs["blocked"]) == (0, 5, 1, 1)
    # cust-1's second is done: its third is promoted and taken; nothing is held back,
    # and the ordering table is gone.
    [a2] = [c.token for c in claimed if c.payload and c.payload["body"] == "a2"]
    assert store.ack([a2]) == 1
    [a3] = store.claim(["jobs"], [300.0], 20)
    assert a3.payload is not None and a3.payload["body"] == "a3"
    jobs = status(broker_url, schema)["jobs"]
    assert (jobs["blocked_keys"], jobs["blocked"], jobs["oldest_blocked_age_s"]) == (0, 0, None)
    assert "ordering:" not in invoke("status", "--url", broker_url, "--schema", schema).stdout


def test_metrics_expose_the_same_figures(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    hold_back(store, peek)
    store.declare_queue("idle")
    result = invoke("metrics", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    parsed = parse_exposition(result.stdout)
    assert by_queue(parsed, "pgq_queue_blocked_keys") == {"idle": 0, "jobs": 2}
    assert by_queue(parsed, "pgq_queue_blocked_messages") == {"idle": 0, "jobs": 3}
    assert by_queue(parsed, "pgq_queue_following_messages") == {"idle": 0, "jobs": 1}
    assert by_queue(parsed, "pgq_queue_delayed_messages") == {"idle": 0, "jobs": 1}
    ages = by_queue(parsed, "pgq_queue_oldest_blocked_age_seconds")
    assert ages["idle"] == 0
    assert 300 <= ages["jobs"] < 360
    for name in ("blocked_keys", "blocked_messages", "following_messages"):
        assert parsed[f"pgq_queue_{name}"].type == "gauge"

    # The same numbers as the status of the same moment.
    report = status_report.collect(store)
    jobs = next(q for q in report.queues if q.queue == "jobs")
    assert (jobs.blocked_keys, jobs.blocked, jobs.following) == (2, 3, 1)


def test_parked_messages_are_not_listed_as_delayed(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    # `pgq delayed` and the console's delayed messages list what waits for an ETA: not
    # a message parked behind its key (never due: visible_at 'infinity'), nor a follower.
    hold_back(store, peek)
    listed = invoke("delayed", "--json", "--url", broker_url, "--schema", schema)
    assert listed.exit_code == 0, listed.output
    assert [d["task_id"] for d in json.loads(listed.stdout)] == ["later"]
    [(later,)] = peek("SELECT id FROM {schema}.message WHERE payload->>'body' = 'later'")
    rows = Reads(store.connector, schema).messages("jobs", delayed=True, payloads=False)
    assert [r.id for r in rows] == [later]
