"""The publisher's boundary, kept by the database (migration 0013_publish_boundary.sql,
one function since 0015_admit_once.sql): a role granted what docs/least-privilege.md
gives ``pgq_publisher`` publishes task messages and nothing else — nothing a worker's
control, reply or event queue receives, and no value of a column the claim trusts. Real
roles, made by the page's own blocks.

And, for every writer, the times a claim waits on keep their bounds: a message of an
ordering key holds its key a day at most, so no publish blocks a key for good (refused
in Python for every pgq publisher, in the database for the publisher-only role).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql

import pg_transport
import pg_transport.sql
from pg_transport.errors import NotPermitted
from pg_transport.message.ordering import MAX_FOLLOWS_TIMEOUT, MAX_KEY_HOLD, OrderingError
from tests.integration.test_privileges import (
    Roles,
    grant,
    options,
    page_roles,
    publisher_app,
    throwaway_database,
)

NODE = "w1@host.example"
CONTROL = f"{NODE}.celery.pidbox"  # a worker's mailbox (kombu: <node>.<namespace>.pidbox)
REPLY = "3f2a.reply.celery.pidbox"  # a client's reply queue (<oid>.reply.<namespace>.pidbox)
EVENTS = "celeryev.5c1e"  # an event receiver's queue (<event_queue_prefix>.<id>)
SHUTDOWN = {"method": "shutdown", "arguments": {}, "destination": None}


@pytest.fixture(scope="module")
def database(pg_url: str) -> Iterator[str]:
    with throwaway_database(pg_url) as url:
        yield url


@pytest.fixture
def granted(database: str) -> Iterator[Roles]:
    with page_roles(database) as made:
        yield grant(made)


def declared_by_a_worker(roles: Roles) -> None:
    """What a worker and a client of remote control declare: the worker's mailbox bound
    to the fanout exchange celery.pidbox, a reply queue on reply.celery.pidbox, an event
    receiver's queue on celeryev; a task queue, and a direct exchange with no binding."""
    with Connection(roles.url(roles.worker), transport_options=options(roles)) as conn:
        channel = conn.channel()
        Queue("jobs").bind(channel).declare()
        Queue(CONTROL, Exchange("celery.pidbox", "fanout")).bind(channel).declare()
        Queue(REPLY, Exchange("reply.celery.pidbox", "direct"), routing_key="3f2a").bind(
            channel
        ).declare()
        Queue(EVENTS, Exchange("celeryev", "topic"), routing_key="#").bind(channel).declare()
        Exchange("tasks", "direct").bind(channel).declare()


def stored(roles: Roles) -> list[tuple[str, str]]:
    """Every message and dead letter: (table, queue)."""
    with psycopg.connect(roles.pg_url) as admin:
        return admin.execute(
            sql.SQL(
                "SELECT 'message', queue FROM {s}.message UNION ALL"
                " SELECT 'dead_letter', queue FROM {s}.dead_letter ORDER BY 1, 2"
            ).format(s=sql.Identifier(roles.schema))
        ).fetchall()


def no_declare(name: str, kind: str) -> Exchange:
    return Exchange(name, kind, no_declare=True)


def test_a_publisher_reaches_no_control_reply_or_event_queue(granted: Roles) -> None:
    declared_by_a_worker(granted)
    role = granted.publisher
    with Connection(granted.url(role), transport_options=options(granted)) as conn:
        attempts: list[tuple[str, Any]] = [
            # The shutdown: one plain publish, nothing declared, to the fanout.
            (CONTROL, lambda: Producer(conn.channel(), no_declare("celery.pidbox", "fanout"))),
            (REPLY, lambda: Producer(conn.channel(), no_declare("reply.celery.pidbox", "direct"))),
            (EVENTS, lambda: Producer(conn.channel(), no_declare("celeryev", "topic"))),
            (CONTROL, lambda: Producer(conn.channel())),  # straight to the mailbox by name
        ]
        for queue, producer in attempts:
            key = {REPLY: "3f2a", EVENTS: "task.succeeded", CONTROL: CONTROL}[queue]
            with pytest.raises(NotPermitted) as raised:
                producer().publish(SHUTDOWN, routing_key=key)
            assert str(raised.value) == (
                f"role {role!r} may not publish this message in pgq schema "
                f"{granted.schema!r}: role {role} may publish task messages only, not to "
                f"'{queue}': a worker's control or reply queue (kombu pidbox) or an event "
                "queue (celeryev) takes messages from the workers' role only (see "
                "docs/least-privilege.md); nothing was published"
            )
            assert isinstance(raised.value.__cause__, psycopg.errors.InsufficientPrivilege)
            assert raised.value.__cause__.diag.constraint_name == "message_admit"
        # A key nothing is bound to on a direct exchange is kept as a dead letter under
        # the key's name, which an operator's `pgq dead requeue` would publish: refused.
        with pytest.raises(NotPermitted, match=f"not to '{CONTROL}'"):
            Producer(conn.channel(), no_declare("tasks", "direct")).publish(
                SHUTDOWN, routing_key=CONTROL
            )
        # In a batch: refused too, and the batch's task message goes with it.
        with pytest.raises(NotPermitted), pg_transport.batch():
            Producer(conn.channel()).publish({"n": 1}, routing_key="jobs")
            Producer(conn.channel()).publish(SHUTDOWN, routing_key=CONTROL)
        # In the application's transaction (pg_transport.transaction), on its connection.
        with (
            psycopg.connect(granted.libpq(role)) as app_conn,
            pytest.raises(NotPermitted, match=f"only, not to '{CONTROL}'"),
            app_conn.transaction(),
            pg_transport.transaction(app_conn),
        ):
            Producer(conn.channel()).publish(SHUTDOWN, routing_key=CONTROL)
        assert stored(granted) == []
        # A task message, the publisher's job, goes.
        Producer(conn.channel()).publish({"n": 2}, routing_key="jobs")
    assert stored(granted) == [("message", "jobs")]

    # The workers' role still drives workers: the same publishes are stored.
    with Connection(granted.url(granted.worker), transport_options=options(granted)) as conn:
        Producer(conn.channel(), no_declare("celery.pidbox", "fanout")).publish(SHUTDOWN)
        Producer(conn.channel(), no_declare("reply.celery.pidbox", "direct")).publish(
            {"ok": "pong"}, routing_key="3f2a"
        )
        Producer(conn.channel(), no_declare("celeryev", "topic")).publish(
            {"type": "worker-heartbeat"}, routing_key="worker.heartbeat"
        )
    assert sorted(stored(granted)) == sorted(
        [("message", CONTROL), ("message", EVENTS), ("message", REPLY), ("message", "jobs")]
    )


def test_a_celery_publisher_cannot_send_remote_control(granted: Roles) -> None:
    """Celery's own control client, as the publisher role: every command refused."""
    declared_by_a_worker(granted)
    app = publisher_app(granted, ["jobs"])
    try:
        for command in (
            lambda: app.control.shutdown(),
            lambda: app.control.revoke("t-1", terminate=True),
            lambda: app.control.pool_restart(),
            lambda: app.control.rate_limit("t.any", "1/h"),
            lambda: app.control.cancel_consumer("jobs"),
        ):
            with pytest.raises(NotPermitted):
                command()
    finally:
        app.close()
    assert stored(granted) == []


ROW = {"queue": "jobs", "payload": "{}"}
LATER = "now() + interval '2 days'"
# Column values no publisher-only role may insert, each with the database's reason.
FORGED: list[tuple[dict[str, str], str]] = [
    ({"queue": f"'{CONTROL}'"}, f"not to '{CONTROL}'"),
    ({"queue": f"'{EVENTS}'"}, f"not to '{EVENTS}'"),
    ({"read_ct": "3"}, "read_ct must be 0"),
    ({"lease": "7"}, "lease must be 0"),
    ({"okey": "'k'", "oseq": "1"}, "oseq is given by pgq"),
    ({"due_at": "now()"}, "due_at is set by a claim"),
    ({"enqueued_at": "now() - interval '1 day'"}, "enqueued_at must be now()"),
    ({"visible_at": "'-infinity'"}, "visible_at must not be before now()"),
    ({"visible_at": "now() - interval '1 hour'"}, "visible_at must not be before now()"),
    ({"visible_at": "'infinity'"}, "visible_at must be a finite time"),
    ({"okey": "'k'", "visible_at": "'infinity'"}, "visible_at must be a finite time"),
    ({"okey": "'k'", "visible_at": LATER}, "within 1 day of now(): it holds every later"),
    ({"follows": "'t'"}, "follow_until must be set on a follower"),
    ({"follows": "'t'", "follow_until": "'infinity'"}, "follow_until must be a finite time"),
    (
        {"follows": "'t'", "follow_until": "now() + interval '366 days'"},
        "follow_until must be within 365 days of visible_at",
    ),
    (
        {"okey": "'k'", "follows": "'t'", "follow_until": LATER},
        "follow_until of a message with an ordering key must be within 1 day",
    ),
]


def insert(conn: psycopg.Connection[Any], schema: str, values: dict[str, str]) -> None:
    row = {**ROW, "payload": "'{}'", "queue": "'jobs'", **values}
    identity = sql.SQL("OVERRIDING SYSTEM VALUE " if "id" in row else "")
    conn.execute(
        sql.SQL("INSERT INTO {}.message ({}) {}VALUES ({})").format(
            sql.Identifier(schema),
            sql.SQL(", ").join(map(sql.Identifier, row)),
            identity,
            sql.SQL(", ").join(sql.SQL(v) for v in row.values()),  # the test's own literals
        )
    )


@pytest.mark.parametrize("table_wide", [False, True], ids=["page-grants", "table-wide-insert"])
def test_raw_inserts_of_what_the_claim_trusts_are_refused(granted: Roles, table_wide: bool) -> None:
    """As the publisher, straight in SQL: refused by the page's column grants, and by the
    database's boundary where a deployment granted INSERT on the whole table."""
    s = sql.Identifier(granted.schema)
    if table_wide:
        with granted.connect(granted.owner) as owner:
            owner.execute(
                sql.SQL("GRANT INSERT ON {}.message TO {}").format(
                    s, sql.Identifier(granted.publisher)
                )
            )
    with granted.connect(granted.publisher) as conn:
        for values, reason in FORGED:
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as raised:
                insert(conn, granted.schema, values)
            message = raised.value.diag.message_primary or ""
            if table_wide or set(values) <= {
                "queue",
                "visible_at",
                "okey",
                "follows",
                "follow_until",
            }:
                assert reason in message, (values, message)
            else:  # a column the page does not grant: Postgres' own refusal
                assert message == "permission denied for table message", (values, message)
        # What a publish writes goes: due now, delayed (unkeyed: any finite time), keyed
        # within its bound, a follower within its wait.
        for values in (
            {},
            {"visible_at": "now() + interval '300 years'"},
            {"okey": "'k'", "visible_at": "now() + interval '23 hours'"},
            {"follows": "'t'", "follow_until": "now() + interval '365 days'"},
        ):
            insert(conn, granted.schema, values)
    assert len(stored(granted)) == 4


# Queue names and whether they are a worker's (kombu pidbox, celeryev) or a task queue.
QUEUE_NAMES = [
    (CONTROL, True),
    (REPLY, True),
    (EVENTS, True),
    ("celeryev.", True),
    ("x.pidbox", True),
    ("pidbox", False),  # a name that merely ends in pidbox
    ("jobs.pidbox.x", False),
    ("celeryev", False),
    ("my.celeryev.x", False),
    ("jobs", False),
]


def test_messages_and_dead_letters_refuse_the_same_queues(granted: Roles) -> None:
    """The publisher's boundary says once which queues are the workers': as the
    publisher, straight in SQL, a message and a dead letter are refused for exactly the
    same queue names, each refusal naming its own table's trigger."""
    s = sql.Identifier(granted.schema)
    verdicts: dict[str, dict[str, bool]] = {"message": {}, "dead_letter": {}}
    with granted.connect(granted.publisher) as conn:
        for queue, _ in QUEUE_NAMES:
            for table, write in (
                ("message", lambda q: insert(conn, granted.schema, {"queue": f"'{q}'"})),
                (
                    "dead_letter",
                    lambda q: conn.execute(
                        sql.SQL(
                            "INSERT INTO {}.dead_letter (message_id, queue, priority, read_ct,"
                            " enqueued_at, reason, payload) VALUES (1, %s, 0, 0, now(), 'unrouted',"
                            " '{{}}')"
                        ).format(s),
                        [q],
                    ),
                ),
            ):
                try:
                    write(queue)
                except psycopg.errors.InsufficientPrivilege as exc:
                    assert exc.diag.constraint_name == f"{table}_admit", (table, queue)
                    assert f"not to '{queue}'" in (exc.diag.message_primary or "")
                    verdicts[table][queue] = True
                else:
                    verdicts[table][queue] = False
    assert verdicts["message"] == verdicts["dead_letter"] == dict(QUEUE_NAMES)
    admitted = [q for q, workers in QUEUE_NAMES if not workers]
    assert sorted(stored(granted)) == sorted(
        [("dead_letter", q) for q in admitted] + [("message", q) for q in admitted]
    )


def test_a_role_that_moves_messages_is_not_bounded(granted: Roles) -> None:
    """A worker (or the owner) could write any of it with the UPDATE a claim needs: its
    inserts are not judged (pgq's own publishes keep the key's bound in Python)."""
    for role in (granted.worker, granted.owner):
        with granted.connect(role) as conn:
            for values, _ in FORGED:
                insert(conn, granted.schema, values)
    assert len(stored(granted)) == 2 * len(FORGED)


def test_no_publish_holds_a_key_for_good(granted: Roles) -> None:
    """The issue's year-9999 ETA on keyed messages: refused before anything is stored,
    by every publisher; a keyed ETA within the bound goes, and the key's next message
    waits only that long."""
    app = publisher_app(granted, ["jobs"])
    declared_by_a_worker(granted)
    far = datetime(9999, 1, 1, tzinfo=timezone.utc)
    try:
        for key in ("a", "b", "c"):
            with pytest.raises(
                OrderingError, match=f"pgq-ordering-key='{key}': .* at most 86400 s"
            ):
                app.send_task("t.any", queue="jobs", eta=far, ordering_key=key)
        with pytest.raises(OrderingError, match="eta/countdown 3600 s \\+ pgq-follows-timeout"):
            app.send_task(
                "t.any",
                queue="jobs",
                countdown=3600,
                ordering_key="a",
                follows="t-0",
                follows_timeout=MAX_KEY_HOLD,
            )
        assert stored(granted) == []
        # Unkeyed, the same ETA is only a delayed message: it holds nothing.
        app.send_task("t.any", queue="jobs", eta=far)
        app.send_task("t.any", queue="jobs", countdown=MAX_KEY_HOLD - 60, ordering_key="a")
        app.send_task(
            "t.any",
            queue="jobs",
            ordering_key="b",
            follows="t-0",
            follows_timeout=MAX_KEY_HOLD - 60,
        )
        app.send_task("t.any", queue="jobs", follows="t-0", follows_timeout=MAX_FOLLOWS_TIMEOUT)
    finally:
        app.close()
    assert stored(granted) == [("message", "jobs")] * 4


def test_the_bounds_are_the_same_in_python_and_sql() -> None:
    """The trigger's bounds (in schema.sql and its migration) are ordering's constants."""
    sql_dir = Path(pg_transport.sql.__file__).parent
    assert timedelta(days=1).total_seconds() == MAX_KEY_HOLD
    assert timedelta(days=365).total_seconds() == MAX_FOLLOWS_TIMEOUT
    for path in (
        sql_dir / "schema.sql",
        sql_dir / "migrations" / "0013_publish_boundary.sql",
        sql_dir / "migrations" / "0015_admit_once.sql",
    ):
        text = path.read_text()
        start = text.index("FUNCTION {schema}.message_admit()")
        body = text[start : text.index("$$;", start)]
        assert body.count("interval '1 day'") == 2, path
        assert body.count("interval '365 days'") == 1, path
        assert "interval" not in body.replace("interval '1 day'", "").replace(
            "interval '365 days'", ""
        ), path


def test_the_publishers_rights_are_judged_not_named(granted: Roles) -> None:
    """Which role is bounded is decided by what it may do (move messages), not by its
    name: a role that is a member of the worker role is trusted, one that is a member of
    the publisher role only is bounded."""
    member = f"pgq_t_member_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(granted.pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(member)))
        try:
            admin.execute(
                sql.SQL("GRANT {} TO {}").format(
                    sql.Identifier(granted.publisher), sql.Identifier(member)
                )
            )
            with psycopg.connect(
                granted.libpq(granted.publisher).replace(granted.publisher + ":", member + ":"),
                autocommit=True,
            ) as conn:
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not to"):
                    insert(conn, granted.schema, {"queue": f"'{CONTROL}'"})
                admin.execute(
                    sql.SQL("GRANT {} TO {}").format(
                        sql.Identifier(granted.worker), sql.Identifier(member)
                    )
                )
                insert(conn, granted.schema, {"queue": f"'{CONTROL}'"})
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(member)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(member)))
    assert stored(granted) == [("message", CONTROL)]
