"""What sessions and rows that are not pgq's can do to pgq's consumers: nothing.

A role with no grant at all (only the CONNECT every role has) may still LISTEN and
NOTIFY on any channel, and one with CREATE on ``public`` may plant functions there.
Publishers may write any JSON into a message row. Each case runs against real
consumers on real Postgres: kombu's blocking ``drain_events`` and Celery's event loop
(kombu's ``Hub``, turned by hand).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import pg_transport
from pg_transport import identity
from pg_transport.fanin.backend import forget
from pg_transport.signals import message_poisoned
from pg_transport.sql import queue_channel
from tests.integration.conftest import Peek
from tests.integration.test_cli import invoke

# The statements pgq's sessions run (schema.sql and the migrations run only in
# ``pgq migrate``, DDL whose defaults are bound to functions when it runs).
SQL_FILES = [
    *(
        p
        for package in ("sql", "beat", "web", "ops")
        for p in Path(pg_transport.__file__).parent.joinpath(package).glob("*.sql")
        if p.name != "schema.sql"
    ),
    Path(pg_transport.__file__).parent.parent / "barrier" / "guards.sql",
]


@dataclass(frozen=True)
class Role:
    name: str
    pg_url: str

    def libpq(self) -> str:
        params = conninfo_to_dict(self.pg_url)
        host = params.get("host") or "127.0.0.1"
        return (
            f"postgresql://{self.name}@{host}:{params.get('port') or 5432}"
            f"/{params.get('dbname', '')}"
        )

    def broker(self) -> str:
        return "pgq" + self.libpq().removeprefix("postgresql")

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.libpq(), autocommit=True)


@pytest.fixture
def make_role(pg_url: str) -> Iterator[Callable[[str], Role]]:
    """Roles that can log in and have no grant (dropped with what they own)."""
    made: list[str] = []

    def make(kind: str) -> Role:
        name = f"pgq_t_{kind}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_url, autocommit=True) as admin:
            try:
                admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            except psycopg.errors.InsufficientPrivilege:
                pytest.skip("the test role cannot create roles")
        made.append(name)
        return Role(name, pg_url)

    yield make
    with psycopg.connect(pg_url, autocommit=True) as admin:
        for name in reversed(made):
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def task_payload(name: str, kwargs: dict[str, Any], task_id: str | None = None) -> str:
    """A Celery (protocol 2) message as kombu stores it: JSON text of the row's payload."""
    return json.dumps(
        {
            "body": json.dumps([[], kwargs, {}]),
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "headers": {"task": name, "id": task_id or str(uuid.uuid4())},
            "properties": {"delivery_info": {}, "body_encoding": None, "priority": 0},
        }
    )


class Consuming:
    """A kombu consumer of ``queue``, driven either way a worker drives one."""

    def __init__(self, conn: Connection, queue: str, way: str) -> None:
        self.conn, self.way = conn, way
        self.got: list[Any] = []
        consumer = Consumer(
            conn,
            [Queue(queue)],
            accept=["json"],
            callbacks=[lambda body, message: self._take(body, message)],
        )
        consumer.qos(prefetch_count=10)
        consumer.consume()
        self.hub: Hub | None = None
        if way == "hub":
            self.hub = Hub()
            conn.transport.register_with_event_loop(conn.connection, self.hub)

    def _take(self, body: Any, message: Any) -> None:
        self.got.append(body)
        message.ack()

    def until(self, done: Callable[[], bool], timeout: float = 15.0) -> None:
        """Consume until ``done()`` (at most ``timeout``: the test fails past it)."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the consumer never got there"
            if self.hub is not None:
                self.hub.run_once()
            else:
                with contextlib.suppress(TimeoutError):
                    self.conn.drain_events(timeout=0.2)

    def close(self) -> None:
        if self.hub is not None:
            self.conn.transport.hub.unregister()
            self.hub.close()


@pytest.fixture
def app(broker_url: str, schema: str) -> Iterator[Celery]:
    """The app of this test as Celery's current one: the handlers of message_poisoned
    other code connected (the barrier's) look at its broker, not at a server some
    earlier test's app named, which may be gone."""
    current = Celery("trust", broker=broker_url, set_as_current=True)
    current.conf.broker_transport_options = {"schema": schema}
    yield current
    forget(current)


@pytest.fixture(params=["blocking", "hub"])
def way(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def consuming(broker_url: str, schema: str, way: str) -> Iterator[Callable[..., Consuming]]:
    opened: list[tuple[Connection, Consuming]] = []

    def start(queue: str, **options: Any) -> Consuming:
        conn = Connection(
            broker_url, transport_options={"schema": schema, "polling_interval": 60, **options}
        )
        conn.connect()
        consuming = Consuming(conn, queue, way)
        opened.append((conn, consuming))
        return consuming

    yield start
    for conn, consuming in opened:
        consuming.close()
        conn.close()


# -- notifications ---------------------------------------------------------------------


def test_notifications_of_a_role_without_grants_run_nothing_and_stop_nothing(
    consuming: Callable[..., Consuming],
    conn: Connection,
    rows: Peek,
    make_role: Callable[[str], Role],
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Garbage, forged hand-offs naming a real message, and floods on every channel the
    intruder can name: the consumer delivers, acks and releases none of it, keeps
    consuming, and says it saw notifications pgq does not send."""
    jobs = consuming("jobs")
    jobs.until(lambda: jobs.conn.transport.engine.waiting)
    # A real message in flight on another queue: the old hand-off's forged ack deleted it.
    Producer(conn.channel(), routing_key="other").publish({"real": True})
    [held] = conn.transport.store.claim(["other"], [300.0], 1)
    forged = json.dumps([held.id, "jobs", 0, json.loads(task_payload("t.pwn", {"x": 1}))])
    intruder = make_role("intruder")
    with intruder.connect() as evil:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            evil.execute(sql.SQL("SELECT * FROM {}.message").format(sql.Identifier(schema)))
        channels = [queue_channel(schema, q) for q in ("jobs", "other", "celery")]
        channels += [f"pgq_{schema}", f"pgq_h00000000_{held.id}"]  # what pgq once used
        for channel in channels:
            for payload in ("not json", forged, "x" * 7999, "\\u0000", "[]", "{}", "null"):
                evil.execute("SELECT pg_notify(%s, %s)", [channel, payload])
            evil.execute("SELECT pg_notify(%s, '')", [channel])  # a bare wake-up, too
    with caplog.at_level("WARNING", logger="pg_transport.consume"):
        # A real publish after the flood: delivered, so the consumer is alive and well.
        Producer(conn.channel(), routing_key="jobs").publish({"n": 1})
        jobs.until(lambda: jobs.got == [{"n": 1}])
    assert "notification(s) with a payload" in caplog.text
    # Its ack rides on the consumer's next statement: consume until it has landed. The
    # message in flight on "other" is still there, under the lease it was claimed with.
    remaining = "SELECT queue, lease FROM {schema}.message ORDER BY id"
    jobs.until(lambda: rows(remaining) == [("other", held.lease)])
    assert conn.transport.store.ack([held.token]) == 1


def test_a_listener_without_grants_learns_no_payload(
    conn: Connection, make_role: Callable[[str], Role], schema: str
) -> None:
    intruder = make_role("intruder")
    secret = "sk-" + uuid.uuid4().hex
    queue = Queue("billing", Exchange("billing", type="direct"), routing_key="charge")
    with intruder.connect() as evil:
        for name in ("billing", "celery"):
            evil.execute(sql.SQL("LISTEN {}").format(sql.Identifier(queue_channel(schema, name))))
        evil.execute(sql.SQL("LISTEN {}").format(sql.Identifier(f"pgq_{schema}")))
        producer = Producer(conn.channel())
        producer.publish({"api_key": secret}, routing_key="billing")  # default exchange
        producer.publish(
            {"api_key": secret}, exchange=queue.exchange, routing_key="charge", declare=[queue]
        )  # routed
        heard = list(evil.notifies(timeout=2.0, stop_after=2))
    assert [(n.channel, n.payload) for n in heard] == [(queue_channel(schema, "billing"), "")] * 2


# -- search_path ------------------------------------------------------------------------


def called_functions() -> set[str]:
    """Every function pgq's SQL calls (by its qualified name)."""
    names: set[str] = set()
    for path in SQL_FILES:
        names |= set(re.findall(r"pg_catalog\.(\w+)\(", path.read_text(encoding="utf-8")))
    return names


# Argument lists a planted look-alike is given: the types pgq passes, as exact matches
# (an exact match beats pg_catalog's polymorphic or "any" functions wherever ``public``
# is on the search_path at all).
PLANTED_ARGS = [
    "",
    "text",
    "text[]",
    "bigint[]",
    "integer[]",
    "double precision[]",
    "json",
    "bytea",
    "text, text",
    "text, name",
    "bigint",
    "integer",
    "double precision",
    "text, text, boolean",
    "text, bigint, bigint",
    "text, integer, integer",
]


def unqualified_calls(text: str) -> list[str]:
    """Function calls in ``text`` not named by schema (SQL keywords that take
    parentheses, alias column lists and table column lists aside)."""
    keywords = {
        "values",
        "in",
        "any",
        "all",
        "array",
        "exists",
        "coalesce",
        "least",
        "greatest",
        "nullif",
        "cast",
        "from",
        "filter",
        "over",
        "key",
        "unique",
        "check",
        "references",
        "as",
        "on",
        "conflict",
        "and",
        "or",
        "not",
        "where",
        "with",
        "select",
        "into",
        "using",
        "lateral",
        "join",
        "by",
        "when",
        "then",
        "else",
        "case",
        "recursive",
        "materialized",
        "is",
        "like",
        "set",
        "returning",
        "row",
        "rows",
        "distinct",
        "union",
        "limit",
        "vacuum",
        "operator",
        "extract",
    }
    found = []
    for line in text.splitlines():
        code = re.sub(r"'[^']*'", "''", line.split("--", 1)[0])
        for match in re.finditer(r"(?<![\w.:\"}])([A-Za-z_]\w*)\s*\(", code):
            before = code[: match.start()].rstrip()
            if match.group(1).lower() in keywords or re.search(r"\b(AS|INTO|ON)$", before, re.I):
                continue
            if before.endswith("}."):  # {schema}.table (columns)
                continue
            found.append(match.group(1))
    return found


@pytest.mark.parametrize("path", SQL_FILES, ids=lambda p: p.name)
def test_every_function_pgq_calls_is_named_by_its_schema(path: Path) -> None:
    assert unqualified_calls(path.read_text(encoding="utf-8")) == [], path.name


@pytest.fixture
def planted(make_role: Callable[[str], Role], pg_url: str) -> Iterator[str]:
    """A role with CREATE on public (every role's, before Postgres 15) has planted a
    look-alike of every function pgq calls, and of the operators it uses, each bumping a
    sequence (which no rollback undoes) when called. Yields the sequence's name."""
    intruder = make_role("planter")
    seq = f"pwned_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(intruder.name))
        )
    planted_functions: list[str] = []
    with intruder.connect() as evil:
        evil.execute(sql.SQL("CREATE SEQUENCE public.{}").format(sql.Identifier(seq)))
        evil.execute(
            sql.SQL("GRANT USAGE, UPDATE ON SEQUENCE public.{} TO PUBLIC").format(
                sql.Identifier(seq)
            )
        )
        body = sql.SQL(
            "LANGUAGE plpgsql AS $f$ BEGIN PERFORM nextval({}); RETURN NULL; END $f$"
        ).format(sql.Literal(f"public.{seq}"))
        for name in sorted(called_functions()):
            for args in PLANTED_ARGS:
                signature = sql.SQL("public.{}({})").format(sql.Identifier(name), sql.SQL(args))
                evil.execute(sql.SQL("CREATE FUNCTION {} RETURNS text {}").format(signature, body))
                planted_functions.append(signature.as_string(evil))
        for op, left, right in [
            ("=", "bigint", "bigint"),
            ("=", "text", "text"),
            ("=", "integer", "integer"),
            ("||", "text", "text"),
            ("<=", "timestamptz", "timestamptz"),
            ("+", "timestamptz", "interval"),
        ]:
            fn = sql.Identifier(f"op_{uuid.uuid4().hex[:8]}")
            evil.execute(
                sql.SQL("CREATE FUNCTION public.{}(a {}, b {}) RETURNS boolean {}").format(
                    fn, sql.SQL(left), sql.SQL(right), body
                )
            )
            evil.execute(
                sql.SQL(
                    "CREATE OPERATOR public.{} (LEFTARG = {}, RIGHTARG = {}, FUNCTION = public.{})"
                ).format(sql.SQL(op), sql.SQL(left), sql.SQL(right), fn)
            )
    assert len(planted_functions) > 100
    yield seq
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("REVOKE CREATE ON SCHEMA public FROM {}").format(sql.Identifier(intruder.name))
        )


@pytest.mark.parametrize("own_sessions", [True, False], ids=["pinned", "pooled"])
def test_functions_planted_in_public_are_never_called(
    planted: str,
    make_role: Callable[[str], Role],
    pg_url: str,
    own_sessions: bool,
) -> None:
    """A worker role's whole round trip — publish direct and routed, claim, ack,
    requeue, renew, reject to dead letters, poison, pop, maintenance, the CLI — with
    the look-alikes in place: none is ever called. On pgq's own sessions (pinned
    search_path) even with ``public`` first in the role's search_path; behind a
    transaction pooler (no session settings: ``use_notify`` off) with the role's default
    search_path, where the schema-qualified names hold."""
    worker = make_role("worker")
    schema = f"pgq_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(schema), sql.Identifier(worker.name)
            )
        )
        if own_sessions:
            admin.execute(
                sql.SQL("ALTER ROLE {} SET search_path = public, pg_catalog").format(
                    sql.Identifier(worker.name)
                )
            )
    options = {
        "schema": schema,
        "use_notify": own_sessions,
        "max_attempts": 2,
        "polling_interval": 0.1,
    }
    try:
        with Connection(worker.broker(), transport_options=options) as conn:
            conn.connect()
            transport = conn.transport
            topic = Exchange("events", type="topic")
            routed = Queue("audit", topic, routing_key="user.*")
            producer = Producer(conn.channel())
            producer.publish({"n": 1}, routing_key="jobs", declare=[Queue("jobs")])
            producer.publish({"n": 2}, exchange=topic, routing_key="user.created", declare=[routed])
            jobs = conn.SimpleQueue("jobs")
            first = jobs.get(timeout=10)
            first.requeue()
            again = jobs.get(timeout=10)
            transport.store.renew(transport.held())
            again.reject()  # to the dead letters
            audit = conn.SimpleQueue(routed)
            audit.get(timeout=10).ack()
            # No consumer of this connection may take the next message before the store's
            # own claims below do (a consumer's claim ahead of them, under load, left them
            # nothing to claim).
            jobs.close()
            audit.close()
            producer.publish({"n": 3}, routing_key="jobs")
            for _ in range(2):  # delivered twice, never acked: poisoned at the third claim
                [taken] = transport.store.claim(["jobs"], [30.0], 1, [2])
                transport.store.release([taken.token])
            jobs = conn.SimpleQueue("jobs")
            with pytest.raises(jobs.Empty):
                jobs.get(timeout=0.5)
            assert conn.default_channel.basic_get("jobs", no_ack=True) is None
            transport.maintain()
        with psycopg.connect(pg_url, autocommit=True) as admin:
            dead = admin.execute(
                sql.SQL("SELECT reason FROM {}.dead_letter ORDER BY id").format(
                    sql.Identifier(schema)
                )
            ).fetchall()
        expected = ["rejected without requeue", "delivered 2 times; max_attempts is 2"]
        assert [r[0][: len(e)] for r, e in zip(dead, expected, strict=True)] == expected
        for args in (["status"], ["dead", "list"], ["dead", "requeue", "--all"], ["purge", "jobs"]):
            result = invoke(*args, "--url", worker.broker(), "--schema", schema)
            assert result.exit_code == 0, (args, result.output)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )
            [(called,)] = admin.execute(
                sql.SQL("SELECT is_called FROM public.{}").format(sql.Identifier(planted))
            ).fetchall()
    assert called is False, "a function planted in public was called by pgq"


# -- rows no pgq publisher would write ---------------------------------------------------


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**70, 1.5, -0.0])
    if kind == 3:
        return rng.choice(["", "\u0000", "body", "\u202e", "é" * 3, "x" * 50])
    if kind == 4:
        return {}
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = [
        "body",
        "properties",
        "headers",
        "content-type",
        "delivery_info",
        "body_encoding",
        "\u0000",
        "x",
    ]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def hostile_rows() -> list[tuple[str, str]]:
    """(why it is bad, the payload's JSON text) of rows a pgq publisher never writes."""
    good = json.loads(task_payload("t.ok", {}))
    shapes = [
        ("a JSON array", "[1, 2, 3]"),
        ("a JSON string", '"just text"'),
        ("a JSON number", "42"),
        ("JSON null", "null"),
        ("no body", json.dumps({"properties": {}})),
        ("a body that is a number", json.dumps({**good, "body": 7})),
        ("properties that are a list", json.dumps({**good, "properties": [1]})),
        ("headers that are a string", json.dumps({**good, "headers": "h"})),
        (
            "delivery_info that is a string",
            json.dumps({**good, "properties": {"delivery_info": "x"}}),
        ),
        (
            "an unknown body encoding",
            json.dumps({**good, "properties": {"body_encoding": "rot13"}}),
        ),
        (
            "a base64 body that does not decode",
            json.dumps({**good, "properties": {"body_encoding": "base64"}, "body": "@@@"}),
        ),
        ("a content type that is a number", json.dumps({**good, "content-type": 5})),
        ("nested past Python's recursion limit", '{"a": ' + "[" * 5000 + "]" * 5000 + "}"),
        ("NUL escapes everywhere", json.dumps({**good, "headers": {"task": "a\u0000b"}})),
        (
            "larger than max_message_bytes",
            json.dumps({**good, "body": json.dumps([["y" * 50_000], {}, {}])}),
        ),
    ]
    rng = random.Random(31)
    shapes += [(f"random shape {n}", json.dumps(random_json(rng))) for n in range(40)]
    return shapes


def test_rows_no_publisher_would_write_are_dead_lettered_and_consuming_goes_on(
    consuming: Callable[..., Consuming],
    conn: Connection,
    rows: Peek,
    app: Celery,
) -> None:
    """Every row either reaches the consumer as a message or ends in dead_letter with
    its reason and a ``message_poisoned`` signal; the consumer never stops, and takes
    a good message published after all of them."""
    poisoned: list[int] = []

    def on_poison(sender: Any, dead_letter_id: int, **_: Any) -> None:
        poisoned.append(dead_letter_id)

    message_poisoned.connect(on_poison, weak=False)
    try:
        shapes = hostile_rows()
        for _, text in shapes:
            rows("INSERT INTO {schema}.message (queue, payload) VALUES ('fuzz', %s::json)", text)
        jobs = consuming("fuzz", max_message_bytes=4096)
        Producer(conn.channel(), routing_key="fuzz").publish({"last": True})
        jobs.until(lambda: {"last": True} in jobs.got)
        jobs.until(lambda: rows("SELECT count(*) FROM {schema}.message") == [(0,)])
        # The signals are sent off the consumer's thread: wait for every one.
        jobs.until(lambda: len(poisoned) == rows("SELECT count(*) FROM {schema}.dead_letter")[0][0])
    finally:
        message_poisoned.disconnect(on_poison)
    dead = rows("SELECT id, reason FROM {schema}.dead_letter ORDER BY id")
    # Nothing lost: each row was delivered (and acked) or kept with a reason.
    delivered = len(jobs.got) - 1
    assert delivered + len(dead) == len(shapes)
    assert len(dead) >= 14  # every named shape above but the NUL one is one kombu cannot take
    assert all(reason for _, reason in dead)
    assert sorted(poisoned) == [ident for ident, _ in dead]
    reasons = " | ".join(reason for _, reason in dead)
    for expected in (
        "not an object",
        "no body",
        "exceeds max_message_bytes",
        "does not decode",
        "body_encoding",
    ):
        assert expected in reasons


@pytest.mark.parametrize("value", ["NaN", "Infinity", '"a\\u0000b"', '"\\ud800"'])
def test_a_poisoned_identity_jsonb_refuses_is_kept_sanitised_and_signalled(
    consuming: Callable[..., Consuming], rows: Peek, value: str, app: Celery
) -> None:
    """The identity jsonb would refuse (NaN, infinities, NUL, a lone surrogate) is
    stored as text it accepts; the signal carries what the message held."""
    identity.register("t.run", execution_id=0)
    signalled: list[dict[str, Any]] = []

    def on_poison(sender: Any, identity: dict[str, Any], **_: Any) -> None:
        signalled.append(identity)

    message_poisoned.connect(on_poison, weak=False)
    body = '[[], {"execution_id": ' + value + "}, {}]"
    payload = json.loads(task_payload("t.run", {}))
    payload["body"] = body
    try:
        # Delivered once already (read_ct 1) and max_attempts 1: poisoned at the claim.
        rows(
            "INSERT INTO {schema}.message (queue, read_ct, payload) VALUES ('p', 1, %s)",
            json.dumps(payload),
        )
        jobs = consuming("p", max_attempts=1)
        jobs.until(lambda: len(signalled) == 1)
    finally:
        message_poisoned.disconnect(on_poison)
        identity.clear()
    [(stored, reason)] = rows("SELECT identity, reason FROM {schema}.dead_letter")
    assert reason.startswith("delivered 1 times; max_attempts is 1")
    assert set(stored) == {"execution_id"}
    assert "\u0000" not in json.dumps(stored)
    assert "execution_id" in signalled[0]
    assert jobs.got == []
