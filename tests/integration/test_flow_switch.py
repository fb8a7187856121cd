"""The plain claim carries no flow gate; the flow claim is sent while limits exist.

``claim`` and ``lean_claim`` pick nothing when a flow limit exists in their snapshot and
say so (their last row, note ``limits``); the caller then sends ``flow_claim``, whose
answer without that row sends it back to ``lean_claim`` (docs/design/claim.md, "Flow
limits"). A fair queue's claim (``fair_claim``) keeps the flow gates. Real sessions; the
order of a limit's commit and a claim's snapshot is stepped by holding the limit's
transaction open.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from kombu import Connection, Consumer, Producer, Queue

from pg_transport.message.rows import Lease
from pg_transport.ops.cli import main
from pg_transport.store import claim_limits, claim_params
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_flow_limits import TASK, define, delivered, keyed, message
from tests.pg import to_broker_url

Q = "switched"


def ready(peek: Peek) -> list[int]:
    """Bodies of the messages a claim could take now (never delivered, visible)."""
    rows = peek(
        "SELECT payload->>'body' FROM {schema}.message"
        " WHERE read_ct = 0 AND visible_at <= now() ORDER BY id"
    )
    return [int(r[0]) for r in rows]


@pytest.mark.parametrize("plain_claim", ["claim", "lean_claim"])
def test_a_plain_claim_delivers_nothing_past_a_limit_committed_before_it(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str, plain_claim: str
) -> None:
    """A limit written but not committed is not there yet: the plain claim delivers. Once
    committed, the plain claim lands the ack it carries, picks nothing and answers only
    the row limits; flow_claim then keeps to the limit (1 an hour: one delivery, the rest
    deferred)."""
    for n in range(4):
        store.publisher.publish(Q, message(n))
    plain, flow = store.q[plain_claim], store.q["flow_claim"]
    with (
        psycopg.connect(pg_url) as setter,
        psycopg.connect(pg_url, autocommit=True) as claimer,
    ):
        setter.execute(
            f'INSERT INTO "{schema}".flow_limit (name, rate_count, rate_period, origin)'
            " VALUES (%s, 1, 3600, 'command')",
            [f"task:{TASK}"],
        )  # the setter's transaction stays open
        rows = claimer.execute(plain, claim_params([Q], [30.0], 1, None, [])).fetchall()
        assert [r[8] for r in rows] == [None] and not claim_limits(rows)
        first = Lease(int(rows[0][0]), int(rows[0][4]), Q)
        setter.commit()
        rows = claimer.execute(plain, claim_params([Q], [30.0], 10, None, [first])).fetchall()
        assert [(r[0], r[8]) for r in rows] == [(0, "limits")]
        assert peek("SELECT count(*) FROM {schema}.message WHERE id = %s", first.id) == [(0,)]
        assert ready(peek) == [1, 2, 3]  # nothing leased, nothing parked
        rows = claimer.execute(flow, claim_params([Q], [30.0], 10, None, [])).fetchall()
    assert [r[8] for r in rows] == [None, "held", "held", "limits"]
    assert int(rows[0][0]) != first.id and ready(peek) == []


def test_removing_every_limit_goes_back_to_the_plain_claim(
    store: PublishingStore, peek: Peek
) -> None:
    """The store's claim: plain while no limit exists; a limit switches it to flow_claim
    within the same call (nothing lost, nothing over the limit); once the last limit is
    removed, the next answer says so and the store claims plainly again."""
    store.publisher.publish(Q, message(0))
    assert delivered(store.claim([Q], [30.0], 10)) == [0] and store.flow is False
    define(peek, f"task:{TASK}", rate=(1, 3600))
    for n in (1, 2):
        store.publisher.publish(Q, message(n))
    assert delivered(store.claim([Q], [30.0], 10)) == [1] and store.flow is True
    peek("DELETE FROM {schema}.flow_limit")
    store.publisher.publish(Q, message(3))
    assert delivered(store.claim([Q], [30.0], 10)) == [3] and store.flow is False
    store.publisher.publish(Q, message(4))
    sent: list[str] = []
    plain = store.lean_claim_statement
    original = plain.execute

    def spy(conn: Any, params: Any, *, prepare: bool) -> Any:
        sent.append(plain.name)
        return original(conn, params, prepare=prepare)

    plain.execute = spy  # type: ignore[method-assign]
    assert delivered(store.claim([Q], [30.0], 10)) == [4]
    assert sent == ["lean_claim"]


def test_a_fair_queue_keeps_to_its_limits(store: PublishingStore, peek: Peek) -> None:
    """fair_claim carries the flow gates: at most one of key a in flight, while b goes
    on; the second of a waits parked for a's slot."""
    store.declare_queue("fq", fair=True)
    define(peek, "erp", concurrency=1)
    for n, key in enumerate("aab"):
        store.publisher.publish("fq", keyed(n, key))
    batch = store.claim(["fq"], [30.0], 10, fair=True)
    assert sorted(delivered(batch)) == [0, 2]
    assert peek("SELECT ckey, visible_at > now() FROM {schema}.message WHERE read_ct = 0") == [
        ("a", True)
    ]
    assert peek("SELECT count(*) FROM {schema}.message WHERE ckey IS NOT NULL") == [(3,)]


class Worker:
    """A kombu consumer on the engine, stepped by this thread: it runs only inside
    :meth:`until` (drain_events), so what it does between steps is what the test let it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.got: list[int] = []
        self.sent: list[str] = []
        queue = Queue(Q, routing_key=Q)
        queue(conn.default_channel).declare()
        self.consumer = Consumer(
            conn,
            [queue],
            accept=["json"],
            callbacks=[lambda b, m: (self.got.append(b["n"]), m.ack())],
        )
        self.consumer.consume()

    @property
    def engine(self) -> Any:
        return self.conn.transport.engine

    def spy(self) -> None:
        """Record the name of each statement the engine's session sends (and send it)."""
        session = self.engine.session
        send = session.send

        def recorded(name: str, params: Any) -> None:
            self.sent.append(name)
            send(name, params)

        session.send = recorded

    def until(self, done: Callable[[], bool], what: str) -> None:
        """Run the consumer until ``done``; a bound far past what one wake-up takes."""
        deadline = time.monotonic() + 20
        while not done():
            assert time.monotonic() < deadline, f"never: {what}"
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)


def test_a_limit_set_while_a_worker_claims_plainly_takes_effect(
    broker_url: str, schema: str, pg_url: str, peek: Peek
) -> None:
    """A running consumer (polling every 30 s, so only notifications and its own answers
    move it) claims plainly; `pgq limit set` while it runs: its next claim finds the limit,
    it switches to flow_claim without a restart and delivers one message of three (1 an
    hour), the two others deferred. `pgq limit reset`: its next claim goes back to plain."""
    runner = CliRunner()
    args = ["--url", to_broker_url(pg_url), "--schema", schema]
    options = {"schema": schema, "polling_interval": 30}
    with Connection(broker_url, transport_options=options) as conn:
        conn.connect()
        worker = Worker(conn)
        producer = Producer(conn)

        def publish(n: int) -> None:
            producer.publish(
                {"n": n}, routing_key=Q, headers={"id": f"t{n}", "task": TASK}, serializer="json"
            )

        publish(0)
        worker.until(lambda: worker.got == [0], "the first message")
        worker.spy()
        assert worker.engine.flow is False
        done = runner.invoke(main, ["limit", "set", f"task:{TASK}", "--rate", "1/h", *args])
        assert done.exit_code == 0, done.output
        for n in (1, 2, 3):
            publish(n)
        parked = "SELECT count(*) FROM {schema}.message WHERE visible_at > now() + interval '30 m'"
        worker.until(lambda: peek(parked) == [(2,)], "two messages deferred")
        worker.until(lambda: worker.got == [0, 1], "the one message the rate lets through")
        assert worker.engine.flow is True and worker.engine.statements.flow_switch >= 1
        assert "flow_claim" in worker.sent
        assert worker.sent[worker.sent.index("flow_claim") - 1] == "lean_claim"

        done = runner.invoke(main, ["limit", "reset", f"task:{TASK}", *args])
        assert done.exit_code == 0, done.output
        assert peek("SELECT count(*) FROM {schema}.flow_limit") == [(0,)]
        before = len(worker.sent)
        publish(4)
        worker.until(lambda: 4 in worker.got, "a message after the reset")
        publish(5)
        worker.until(lambda: 5 in worker.got, "the next message")
        after = [s for s in worker.sent[before:] if s.endswith("claim")]
        assert after[0] == "flow_claim" and after[-1] == "lean_claim", after
        assert worker.engine.flow is False
