"""Flow limits at the store (docs/flow-control.md): the claim's gates ``rate`` (GCRA per
bucket) and ``slots`` (at most N of a key in flight), on real sessions.

Races are stepped: one side's claim runs in a transaction held open (its row locks held)
while the other claims; every gate lock is SKIP LOCKED, so the other side gets ``held`` at
once. Times are the database's clock, written by a trigger in the statement that leases.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from kombu import Connection, Consumer, Producer, Queue

from pg_transport.db.pool import Connector
from pg_transport.message.rows import Lease
from pg_transport.ops.cli import main
from pg_transport.store import Claimed, Store, claim_params
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_metrics import parse_exposition
from tests.pg import to_broker_url

Q = "limited"
TASK = "app.call_api"


def message(n: int, **headers: Any) -> dict[str, Any]:
    return {
        "body": str(n),
        "headers": {"id": f"task-{n}", "task": TASK, **headers},
        "properties": {},
        "content-type": "text/plain",
    }


def keyed(n: int, key: str, limiter: str = "erp") -> dict[str, Any]:
    return message(n, **{"pgq-concurrency-limiter": limiter, "pgq-concurrency-key": key})


def define(peek: Peek, name: str, *, rate: tuple[int, float] | None = None, burst: int = 1,
           concurrency: int | None = None) -> None:  # fmt: skip
    peek(
        "INSERT INTO {schema}.flow_limit (name, rate_count, rate_period, burst, concurrency,"
        " origin) VALUES (%s, %s, %s, %s, %s, 'command')",
        name,
        rate[0] if rate else None,
        rate[1] if rate else None,
        burst,
        concurrency,
    )


def delivered(batch: list[Claimed]) -> list[int]:
    return [int(c.payload["body"]) for c in batch if not c.held and c.payload is not None]


def raw_claim(store: Store, conn: psycopg.Connection[Any], limit: int = 100) -> list[Any]:
    """The claim statement sent while limits exist (flow_claim) on ``conn``, in whatever
    transaction ``conn`` has open; its last row saying so (note limits) left out."""
    rows = conn.execute(
        store.q["flow_claim"], claim_params([Q], [30.0], limit, None, [])
    ).fetchall()
    return [r for r in rows if r[8] != "limits"]


@pytest.fixture
def session(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url) as conn:  # not autocommit: the test holds transactions
        yield conn


@pytest.fixture
def starts(peek: Peek) -> Peek:
    """A test hook: every lease a claim grants is recorded with the database's clock at
    that moment (after the gate decided, before the claim commits)."""
    peek(
        "CREATE TABLE {schema}.starts (id bigint, at timestamptz DEFAULT clock_timestamp());"
        " CREATE FUNCTION {schema}.record_start() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN INSERT INTO {schema}.starts (id) VALUES (NEW.id); RETURN NULL; END $$;"
        " CREATE TRIGGER record_start AFTER UPDATE ON {schema}.message FOR EACH ROW"
        " WHEN (NEW.read_ct > OLD.read_ct) EXECUTE FUNCTION {schema}.record_start()"
    )
    return peek


# -- rate ----------------------------------------------------------------------------


@pytest.mark.sessions(26)  # eight claiming sessions and their pools: 23 seen
def test_eight_sessions_claiming_at_once_never_exceed_the_rate(
    store: PublishingStore, starts: Peek, pg_url: str, schema: str
) -> None:
    """20/s burst 1 over 8 sessions claiming one message at a time as fast as they can
    for 3 s of database time: in any one-second window of the recorded lease times at most
    22 (the GCRA bound of 21 decisions, plus one: a lease is recorded after its decision,
    and the next decision waits for the previous claim's commit), and in all about
    20 per second."""
    define(starts, f"task:{TASK}", rate=(20, 1.0))
    for n in range(400):
        store.publisher.publish(Q, message(n))
    ready = threading.Barrier(8)
    errors: list[BaseException] = []

    def claimer() -> None:
        connector = Connector(pg_url)
        try:
            mine = Store(connector, schema)
            ready.wait()
            with psycopg.connect(pg_url, autocommit=True) as clock:
                start = clock.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
                while True:
                    for c in mine.claim([Q], [300.0], 1):
                        assert not c.held or c.payload is None
                    now = clock.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
                    if now - start > timedelta(seconds=3):
                        return
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            connector.close()

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    times: list[datetime] = [r[0] for r in starts("SELECT at FROM {schema}.starts ORDER BY at")]
    assert len(times) > 20
    worst = max(
        sum(1 for u in times[i:] if u - t <= timedelta(seconds=1)) for i, t in enumerate(times)
    )
    assert worst <= 22, worst
    elapsed = (times[-1] - times[0]).total_seconds()
    # Every grant is one emission interval after the previous at the earliest.
    assert len(times) <= 20 * elapsed + 2
    # And the claimers kept the bucket busy (a loaded machine may lose a few).
    assert len(times) >= 0.5 * 20 * elapsed


def test_a_bucket_another_claim_holds_is_busy_at_once(
    store: PublishingStore, peek: Peek, session: psycopg.Connection[Any], pg_url: str, schema: str
) -> None:
    """A claim meeting a bucket whose row another transaction holds returns the message
    held at once, left ready (not deferred, no token spent); once the holder commits the
    next claim delivers it. A wait for the lock would trip lock_timeout instead."""
    define(peek, f"task:{TASK}", rate=(1000, 1.0))
    store.publisher.publish(Q, message(1))
    peek("INSERT INTO {schema}.flow_state (limiter, key) VALUES (%s, '')", f"task:{TASK}")
    session.execute(
        f'SELECT 1 FROM "{schema}".flow_state WHERE limiter = %s FOR UPDATE', [f"task:{TASK}"]
    )
    with psycopg.connect(pg_url, autocommit=True, options="-c lock_timeout=5000") as impatient:
        blocked = raw_claim(store, impatient)
        assert [r[8] for r in blocked] == ["held"]
        assert peek("SELECT due_at, visible_at <= now() FROM {schema}.message") == [(None, True)]
        session.rollback()
        assert [r[8] for r in raw_claim(store, impatient)] == [None]


def test_a_refused_message_is_deferred_to_its_token(store: PublishingStore, peek: Peek) -> None:
    """1 per 2 s: the first is delivered, the others are deferred one interval apart from
    the bucket's next token (visible then: what next_due reports), their place kept."""
    define(peek, f"task:{TASK}", rate=(1, 2.0))
    for n in range(3):
        store.publisher.publish(Q, message(n))
    batch = raw_claim(store, peek.conn)
    assert [(r[5]["body"] if r[5] else None, r[8]) for r in batch] == [
        ("0", None), (None, "held"), (None, "held")
    ]  # fmt: skip
    rows = peek(
        "SELECT (m.visible_at - s.tat)::text, m.due_at IS NOT NULL FROM {schema}.message m,"
        " {schema}.flow_state s WHERE m.read_ct = 0 ORDER BY m.id"
    )
    # tat is the first grant + 2 s; burst 1: the next token is due at tat.
    assert rows == [("00:00:00", True), ("00:00:02", True)]
    (due,) = peek.conn.execute(store.q["next_due"], {"queues": [Q], "since": 0.0}).fetchone()  # type: ignore[misc]
    assert 0 < due <= 2.0


def test_per_key_buckets_are_separate_and_the_task_bucket_is_not_met(
    store: PublishingStore, peek: Peek
) -> None:
    """pgq-rate-key with the task's own limiter: one bucket per key (1 per minute each),
    not one for the task as a whole."""
    define(peek, f"task:{TASK}", rate=(1, 60.0))
    for n, key in enumerate(["a", "b", "a", "c"]):
        store.publisher.publish(Q, message(n, **{"pgq-rate-key": key}))
    assert delivered(store.claim([Q], [30.0], 10)) == [0, 1, 3]
    assert peek("SELECT limiter, key FROM {schema}.flow_state ORDER BY key") == [
        (f"task:{TASK}", "a"),
        (f"task:{TASK}", "b"),
        (f"task:{TASK}", "c"),
    ]


def test_queue_and_named_limiter_buckets_both_apply(store: PublishingStore, peek: Peek) -> None:
    """A message meets its queue's bucket and its named limiter's: each must grant."""
    define(peek, f"queue:{Q}", rate=(2, 60.0), burst=2)
    define(peek, "stripe", rate=(1, 60.0))
    for n in range(3):
        store.publisher.publish(
            Q, message(n, **{"pgq-rate-limiter": "stripe", "pgq-rate-key": "x"})
        )
    store.publisher.publish(Q, message(9))
    # stripe/x grants one (0); the queue grants two (0 and 1, in claim order), and the
    # token it granted 1, which stripe refused, is spent unused: under the queue's limit,
    # never over. 9 waits for the queue's next token.
    assert delivered(store.claim([Q], [30.0], 10)) == [0]
    assert peek(
        "SELECT key, tat > now() + interval '59 seconds' FROM {schema}.flow_state"
        " WHERE limiter = %s",
        f"queue:{Q}",
    ) == [("", True)]


def test_an_idle_consumer_is_woken_when_the_next_token_is_due(
    broker_url: str, schema: str, pg_url: str
) -> None:
    """1 per 2 s, two messages, a consumer polling only every 30 s: the second arrives
    about 2 s after the first, woken by its timer (next_due), not by a poll or a busy
    loop of claims."""
    options = {"schema": schema, "polling_interval": 30}
    queue = Queue(Q, routing_key=Q)
    with Connection(broker_url, transport_options=options) as conn:
        conn.connect()
        queue(conn.default_channel).declare()
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                f'INSERT INTO "{schema}".flow_limit (name, rate_count, rate_period, origin)'
                " VALUES (%s, 1, 2, 'command')",
                [f"task:{TASK}"],
            )
        producer = Producer(conn)
        for n in range(2):
            producer.publish(
                {"n": n}, routing_key=Q, headers={"id": f"t{n}", "task": TASK}, serializer="json"
            )
        got: list[float] = []
        consumer = Consumer(
            conn,
            [queue],
            accept=["json"],
            callbacks=[lambda b, m: (got.append(time.monotonic()), m.ack())],
        )
        with consumer:
            deadline = time.monotonic() + 25
            while len(got) < 2 and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=25)
                except TimeoutError:
                    break
    assert len(got) == 2
    gap = got[1] - got[0]
    # Never before its token (less the claim's own time), long before a poll would.
    assert 1.5 <= gap < 20, gap


# -- run-time changes ------------------------------------------------------------------


def test_pgq_limit_set_takes_effect_at_the_next_claim(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """Lowered: the next message waits. Raised: what waits is brought forward and the
    next claim delivers it. No restart: the same store claims throughout."""
    runner = CliRunner()
    url = to_broker_url(pg_url)
    args = ["--url", url, "--schema", schema]
    done = runner.invoke(main, ["limit", "set", f"task:{TASK}", "--rate", "1/h", *args])
    assert done.exit_code == 0, done.output
    for n in range(3):
        store.publisher.publish(Q, message(n))
    assert delivered(store.claim([Q], [30.0], 10)) == [0]
    assert delivered(store.claim([Q], [30.0], 10)) == []  # deferred by an hour
    done = runner.invoke(
        main, ["limit", "set", f"task:{TASK}", "--rate", "100/s", "--burst", "5", *args]
    )
    assert done.exit_code == 0, done.output
    assert delivered(store.claim([Q], [30.0], 10)) == [1, 2]
    listed = runner.invoke(main, ["limit", "list", "--json", *args])
    assert '"rate": "100/s"' in listed.output and '"origin": "command"' in listed.output


@pytest.mark.parametrize(
    ("option", "value"),
    [("--rate", "ten per second"), ("--rate", "0/s"), ("--rate", "-3/m"),
     ("--rate", "10/fortnight"), ("--burst", "0"), ("--concurrency", "0"),
     ("--concurrency", "-2"), ("--concurrency", "2.5")],
)  # fmt: skip
def test_pgq_limit_set_refuses_a_bad_value_naming_the_option(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str, option: str, value: str
) -> None:
    url = to_broker_url(pg_url)
    done = CliRunner().invoke(
        main, ["limit", "set", "erp", option, value, "--url", url, "--schema", schema]
    )
    assert done.exit_code == 1
    assert f"{option}={value!r}" in done.output, done.output
    assert peek("SELECT count(*) FROM {schema}.flow_limit") == [(0,)]


def test_the_table_refuses_what_the_options_refuse(peek: Peek) -> None:
    """A hand-written row cannot get past the bounds either."""
    for values in ["0, 1, 1, NULL", "5, -1, 1, NULL", "5, 1, 0, NULL", "NULL, NULL, 1, 0",
                   "NULL, NULL, 1, NULL", "5, NULL, 1, NULL"]:  # fmt: skip
        with pytest.raises(psycopg.errors.CheckViolation):
            peek(
                "INSERT INTO {schema}.flow_limit (name, rate_count, rate_period, burst,"
                f" concurrency, origin) VALUES ('x', {values}, 'command')"
            )


# -- slots ------------------------------------------------------------------------------


def test_two_claims_of_one_key_at_n1_deliver_one(
    store: PublishingStore, peek: Peek, session: psycopg.Connection[Any]
) -> None:
    """A's claim holds the key's row: B's claim of the key's other message is busy (held,
    not parked). After A commits, B's claim finds the key full and parks the message until
    A's lease ends; A's ack promotes it (the trigger, not the lease), and it is delivered."""
    define(peek, "erp", concurrency=1)
    store.publisher.publish(Q, keyed(1, "c1"))
    store.publisher.publish(Q, keyed(2, "c1"))
    first = raw_claim(store, session, limit=1)
    assert [r[0] for r in first if r[8] is None] == [first[0][0]]
    b = raw_claim(store, peek.conn, limit=1)
    assert [r[8] for r in b] == ["held"]
    assert peek("SELECT count(*) FROM {schema}.message WHERE due_at IS NOT NULL") == [(0,)]
    session.commit()
    b = store.claim([Q], [30.0], 1)
    assert delivered(b) == []
    parked = peek(
        "SELECT w.visible_at = h.visible_at FROM {schema}.message w, {schema}.message h"
        " WHERE w.due_at IS NOT NULL AND h.read_ct = 1"
    )
    assert parked == [(True,)]  # until the holder's lease ends
    holder = first[0]
    assert store.ack([Lease(holder[0], holder[4], Q)]) == 1
    assert delivered(store.claim([Q], [30.0], 1)) == [2]


def test_at_most_n_of_a_key_in_flight_and_other_keys_go_on(
    store: PublishingStore, peek: Peek
) -> None:
    define(peek, "erp", concurrency=3)
    for n in range(10):
        store.publisher.publish(Q, keyed(n, "big"))
    store.publisher.publish(Q, keyed(10, "small"))
    assert delivered(store.claim([Q], [30.0], 20)) == [0, 1, 2, 10]
    assert delivered(store.claim([Q], [30.0], 20)) == []
    listed = peek(
        "SELECT ckey, count(*) FILTER (WHERE due_at IS NULL AND read_ct > 0),"
        " count(*) FILTER (WHERE due_at IS NOT NULL) FROM {schema}.message GROUP BY ckey"
        " ORDER BY ckey"
    )
    assert listed == [("big", 3, 7), ("small", 1, 0)]


@pytest.mark.parametrize("how", ["ack", "dead_letter", "release"])
def test_a_holder_leaving_frees_its_slot(store: PublishingStore, peek: Peek, how: str) -> None:
    """Ack and dead-letter: the parked message is promoted by the row's trigger. Release
    (requeue): the holder is out of flight at once, ready again ahead of the parked one."""
    define(peek, "erp", concurrency=1)
    store.publisher.publish(Q, keyed(1, "c1"))
    store.publisher.publish(Q, keyed(2, "c1"))
    batch = store.claim([Q], [30.0], 10)
    holder = next(c for c in batch if not c.held)
    token = Lease(holder.id, holder.lease, Q)
    if how == "ack":
        store.ack([token])
        assert delivered(store.claim([Q], [30.0], 10)) == [2]
    elif how == "dead_letter":
        assert store.dead_letter(token, "test") is not None
        assert delivered(store.claim([Q], [30.0], 10)) == [2]
    else:
        store.release([token])
        assert delivered(store.claim([Q], [30.0], 1)) == [1]


def test_purge_takes_what_waits_for_a_slot_or_a_token(store: PublishingStore, peek: Peek) -> None:
    """A parked or deferred message waits, even one delivered before: purge takes it; the
    holder in flight stays."""
    define(peek, "erp", concurrency=1)
    for n in range(3):
        store.publisher.publish(Q, keyed(n, "c1"))
    batch = store.claim([Q], [30.0], 10)
    holder = next(c for c in batch if not c.held)
    # One of the waiting ones was delivered before (read_ct 1), then parked again.
    peek("UPDATE {schema}.message SET read_ct = 1 WHERE due_at IS NOT NULL AND id ="
         " (SELECT min(id) FROM {schema}.message WHERE due_at IS NOT NULL)")  # fmt: skip
    assert store.purge(Q) == 2
    assert peek("SELECT id FROM {schema}.message") == [(holder.id,)]


def test_a_lapsed_slot_lease_comes_back_and_is_not_renewed(
    store: PublishingStore, peek: Peek
) -> None:
    """The holder's lease lapses (its worker gone): the key's next message gets the slot,
    and the holder's renewal is refused, so it cannot share the slot when it comes back."""
    define(peek, "erp", concurrency=1)
    store.publisher.publish(Q, keyed(1, "c1"))
    store.publisher.publish(Q, keyed(2, "c1"))
    batch = store.claim([Q], [30.0], 1)
    holder = next(c for c in batch if not c.held)
    peek.expire_leases()
    assert store.renew([(Lease(holder.id, holder.lease, Q), 30.0)]) == 0
    # The lapsed holder is ready again ahead of 2 and takes the one slot; 2 waits.
    assert delivered(store.claim([Q], [30.0], 10)) == [1]


def test_a_killed_claimer_s_slot_returns_when_its_lease_lapses(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    """A process that claimed the key's slot (vt 2 s) is SIGKILLed: the key's other
    message is delivered once the lease has lapsed, and not before."""
    define(peek, "erp", concurrency=1)
    store.publisher.publish(Q, keyed(1, "c1"))
    store.publisher.publish(Q, keyed(2, "c1"))
    code = (
        "import sys, time\n"
        "from pg_transport.db.pool import Connector\n"
        "from pg_transport.store import Store\n"
        f"s = Store(Connector({pg_url!r}), {schema!r})\n"
        f"got = [c for c in s.claim([{Q!r}], [2.0], 1) if not c.held]\n"
        "print(got[0].id, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, env=dict(os.environ), text=True
    )
    try:
        assert proc.stdout is not None
        held_id = int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (lease_end,) = peek("SELECT visible_at FROM {schema}.message WHERE id = %s", held_id)[0]
    # Before the lease ends: the key is full (2 is parked until the lease's end).
    if peek("SELECT now() < %s", lease_end) == [(True,)]:
        assert delivered(store.claim([Q], [30.0], 1)) == []
    peek.wait_until(
        "SELECT now() > visible_at FROM {schema}.message WHERE id = %s",
        held_id,
        failure="the lease never lapsed",
    )
    got = delivered(store.claim([Q], [30.0], 10))
    assert got in ([1], [2])  # the slot is free again: one of the key's two, not both


def test_pgq_status_and_metrics_count_each_limit_s_slots_in_use_and_waiting(
    store: PublishingStore, peek: Peek, pg_url: str, schema: str
) -> None:
    define(peek, "erp", concurrency=1)
    define(peek, f"task:{TASK}", rate=(600, 60.0), burst=3)
    for n in range(3):
        store.publisher.publish(Q, keyed(n, "c1"))
    assert delivered(store.claim([Q], [30.0], 10)) == [0]
    done = CliRunner().invoke(
        main, ["status", "--json", "--url", to_broker_url(pg_url), "--schema", schema]
    )
    assert done.exit_code == 0, done.output
    limits = json.loads(done.output)["limits"]
    assert limits == [
        {"name": "erp", "rate": None, "burst": 1, "concurrency": 1, "in_flight": 1,
         "waiting": 2, "per_second": None},
        {"name": f"task:{TASK}", "rate": "600/m", "burst": 3, "concurrency": None,
         "in_flight": 0, "waiting": 0, "per_second": 10.0},
    ]  # fmt: skip
    scraped = CliRunner().invoke(
        main, ["metrics", "--url", to_broker_url(pg_url), "--schema", schema]
    )
    assert scraped.exit_code == 0, scraped.output
    parsed = parse_exposition(scraped.stdout)

    def per_limit(family: str) -> dict[str, float]:
        return {dict(k)["limit"]: v for k, v in parsed[family].samples.items()}

    assert per_limit("pgq_limit_in_flight_messages") == {"erp": 1, f"task:{TASK}": 0}
    assert per_limit("pgq_limit_waiting_messages") == {"erp": 2, f"task:{TASK}": 0}
    assert per_limit("pgq_limit_concurrency") == {"erp": 1}
    assert per_limit("pgq_limit_rate_per_second") == {f"task:{TASK}": 10.0}
    assert per_limit("pgq_limit_burst") == {f"task:{TASK}": 3}
    # Per limit only: no key of the application's becomes a label.
    assert "c1" not in scraped.stdout


def test_a_deferred_message_past_its_ttl_expires_even_if_delivered_before(
    store: PublishingStore, peek: Peek
) -> None:
    """A message waiting for a token is queued, not in flight, whatever its read_ct:
    past its TTL, maintenance deletes it (and nothing in flight)."""
    define(peek, f"task:{TASK}", rate=(1, 3600.0))
    for n in range(2):
        store.publisher.publish(Q, message(n))
    assert delivered(store.claim([Q], [30.0], 10)) == [0]
    peek("UPDATE {schema}.message SET read_ct = 1, expires_at = now() - interval '1 second'")
    assert store.maintain([Q]) == (0, 1)
    assert peek("SELECT body FROM (SELECT payload->>'body' AS body FROM {schema}.message) m") == [
        ("0",)
    ]
