"""Migration 0018 (docs/design/flow-control.md): a flow bucket's first use in one function
both gates call, and the counts of unique keys and of flow limits that ``pgq status``,
``pgq metrics``, the console and ``pgq limit`` read through functions that return no key.

Races are stepped: one session holds a transaction open (its uncommitted bucket row)
while the other uses the same bucket; the other must give up at once, not wait.
The monitor role's view is tested in test_privileges.py, with the page's own grants.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from kombu import Connection, Producer, Queue

from pg_transport.errors import LimitError
from pg_transport.ops.cli import main
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_metrics import parse_exposition
from tests.integration.test_unique import message as unique_message
from tests.pg import to_broker_url


def source(peek: Peek, name: str) -> str:
    [(text,)] = peek(
        "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND p.proname = %s",
        peek.schema,
        name,
    )
    return str(text)


def test_flow_tokens_and_flow_slots_share_one_first_use_block(peek: Peek) -> None:
    """The subtransaction with lock_timeout 1 ms is flow_bucket's alone: each gate calls
    it and carries no copy of its own."""
    bucket = source(peek, "flow_bucket")
    assert "lock_timeout" in bucket and "ON CONFLICT DO NOTHING" in bucket
    for gate in ("flow_tokens", "flow_slots"):
        text = source(peek, gate)
        assert ".flow_bucket(limiter, bucket)" in text, gate
        assert "lock_timeout" not in text and "INSERT" not in text, gate


@pytest.mark.parametrize("gate", ["flow_tokens", "flow_slots"])
def test_a_bucket_another_claim_is_creating_is_busy_at_once(
    peek: Peek, pg_url: str, schema: str, gate: str
) -> None:
    """A claim creating a bucket's row (uncommitted) makes another claim of that new
    bucket give up at once (granted -1: busy), whatever its own lock_timeout, which is
    its own again afterwards; once the first commits, the bucket decides."""
    column = "rate_count, rate_period" if gate == "flow_tokens" else "concurrency"
    values = "5, 1" if gate == "flow_tokens" else "2"
    peek(
        f"INSERT INTO {{schema}}.flow_limit (name, {column}, origin)"
        f" VALUES ('new', {values}, 'command')"
    )
    call = f'SELECT granted FROM "{schema}".{gate}(%s, %s, 1)'
    with (
        psycopg.connect(pg_url) as first,
        psycopg.connect(pg_url, autocommit=True, options="-c lock_timeout=5000") as second,
    ):
        first.execute(f'SELECT "{schema}".flow_bucket(%s, %s)', ["new", "k"])
        began = time.monotonic()
        [(granted,)] = second.execute(call, ["new", "k"]).fetchall()
        waited = time.monotonic() - began
        assert granted == -1
        assert waited < 2.5, waited  # half the 5 s a wait would have taken to fail
        assert second.execute("SHOW lock_timeout").fetchone() == ("5s",)
        first.commit()
        [(granted,)] = second.execute(call, ["new", "k"]).fetchall()
        assert granted == 1


def test_flow_bucket_creates_the_row_once(peek: Peek) -> None:
    peek("SELECT {schema}.flow_bucket(%s, %s)", "lim", "k")
    peek("SELECT {schema}.flow_bucket(%s, %s)", "lim", "k")
    assert peek("SELECT limiter, key, tat = '-infinity' FROM {schema}.flow_state") == [
        ("lim", "k", True)
    ]


def held_keys(store: PublishingStore) -> None:
    """Queue a: two unique messages queued, one running with queued_or_running, one
    delivered in queued mode (its key freed); queue b: one queued; queue c: none."""
    publish = store.publisher.publish
    publish("a", unique_message("run", mode="queued_or_running"), publish_key="r")
    publish("a", unique_message("gone"), publish_key="g")
    assert len(store.claim(["a"], [300.0], 2)) == 2
    publish("a", unique_message("q1"), publish_key="q1")
    publish("a", unique_message("q2", mode="queued_or_running"), publish_key="q2")
    publish("b", unique_message("q3"), publish_key="q3")
    publish("c", unique_message(None), publish_key="plain")


def test_unique_counts_per_queue_queued_and_running(store: PublishingStore, peek: Peek) -> None:
    held_keys(store)
    rows = peek("SELECT * FROM {schema}.unique_counts()")
    assert rows == [("a", 2, 1), ("b", 1, 0)]
    # Defined as the owner's, with names resolved in pg_catalog only, for no one else.
    [(definer, config, acl)] = peek(
        "SELECT p.prosecdef, p.proconfig::text, p.proacl::text FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND p.proname = 'unique_counts'",
        peek.schema,
    )
    assert definer and config == '{"search_path=pg_catalog, pg_temp"}'
    assert not any(item.startswith("=") for item in str(acl).strip("{}").split(","))  # PUBLIC


def cli(pg_url: str, schema: str, *args: str) -> Any:
    done = CliRunner().invoke(main, [*args, "--url", to_broker_url(pg_url), "--schema", schema])
    assert done.exit_code == 0, done.output
    return done


def test_status_and_metrics_show_the_unique_keys_held(
    store: PublishingStore, pg_url: str, schema: str
) -> None:
    held_keys(store)
    figures = json.loads(cli(pg_url, schema, "status", "--json").stdout)
    by_queue = {q["queue"]: (q["unique_queued"], q["unique_running"]) for q in figures["queues"]}
    assert by_queue == {"a": (2, 1), "b": (1, 0), "c": (0, 0)}
    text = cli(pg_url, schema, "status").stdout
    section = text.split("unique keys held:\n", 1)[1].splitlines()
    assert section[0].split() == ["QUEUE", "QUEUED", "RUNNING"]
    assert [line.split() for line in section[1:3]] == [["a", "2", "1"], ["b", "1", "0"]]
    parsed = parse_exposition(cli(pg_url, schema, "metrics").stdout)
    for family, expected in (
        ("pgq_queue_unique_queued_messages", {"a": 2, "b": 1, "c": 0}),
        ("pgq_queue_unique_running_messages", {"a": 1, "b": 0, "c": 0}),
    ):
        samples = parsed[family].samples
        assert {dict(k)["queue"]: v for k, v in samples.items()} == expected
    assert "q1" not in text and "run" not in text.replace("RUNNING", "")


# -- no-ack consumption (the pop) and a queue's own limit ---------------------------------


def test_a_limited_queue_is_refused_to_a_consumer_without_acks(
    conn: Connection, rows: Peek
) -> None:
    """A pop takes and deletes without the claim's gates: a queue with a limit of its own
    is refused to no_ack consumption (consume and get), naming the limit and the way
    out; a consumer that acks gets its messages under the limit, and another queue's
    no-ack consumer is not affected."""
    rows(
        "INSERT INTO {schema}.flow_limit (name, rate_count, rate_period, burst, origin)"
        " VALUES ('queue:nq', 1, 3600, 1, 'command')"
    )
    channel = conn.default_channel
    Producer(channel).publish({"n": 1}, routing_key="nq", declare=[Queue("nq")])
    Producer(channel).publish({"n": 2}, routing_key="nq")
    refused = conn.SimpleBuffer("nq")
    with pytest.raises(LimitError, match=r"queue 'nq' has flow limit 'queue:nq'.*no_ack=True"):
        refused.get(timeout=10)
    refused.close()
    with pytest.raises(LimitError, match=r"pgq limit reset queue:nq"):
        channel.basic_get("nq", no_ack=True)
    assert rows("SELECT count(*) FROM {schema}.message") == [(2,)]
    # With acks: one start per hour, as the limit says.
    acking = conn.SimpleQueue("nq")
    acking.get(timeout=10).ack()
    assert channel.basic_get("nq") is None  # the second waits for its token
    acking.close()
    other = conn.SimpleBuffer("free")
    other.put({"n": 3})
    assert other.get(timeout=10).payload == {"n": 3}
    other.close()


def test_a_limit_set_while_a_no_ack_consumer_runs_stops_its_pops(
    conn: Connection, rows: Peek
) -> None:
    """A limit set on a queue after a no-ack consumer started: its pops take nothing
    more from that queue (the message stays, for a consumer that acks), other queues
    of the same pop still deliver."""
    buffer = conn.SimpleBuffer("nq")
    buffer.put({"n": 1})
    assert buffer.get(timeout=10).payload == {"n": 1}
    rows(
        "INSERT INTO {schema}.flow_limit (name, concurrency, origin)"
        " VALUES ('queue:nq', 1, 'command')"
    )
    buffer.put({"n": 2})
    conn.SimpleBuffer("free").put({"n": 3})
    store = conn.transport.store
    popped = store.pop(["nq", "free"], 10)
    assert [c.queue for c in popped] == ["free"]
    assert rows("SELECT queue, read_ct FROM {schema}.message") == [("nq", 0)]
    buffer.close()
