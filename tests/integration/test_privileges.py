"""docs/least-privilege.md, run with real roles: each role can do what the page says, no more.

The page's SQL blocks run as written — as the superuser and as the owner role, in the
page's order — with its role, schema and database names replaced by throwaway ones, in a
database of the tests' own (block 2 revokes CONNECT from PUBLIC, which must not happen to
the shared test database). Then:

- what each role may do is done for real: the worker's kombu round trip, dead letters and
  a Celery worker; the publisher's publishes (direct, routed, with priority and ETA, in a
  batch, unroutable); the monitor's `pgq status`, `pgq metrics` and autoscaling queries;
- what it may not is attempted for real and refused: every column of every table is read,
  inserted and updated, every table deleted from and truncated, by every role, and the
  outcome must be exactly the page's (``RIGHTS`` below states it independently of the page);
  then the commands and kombu calls a role may not make fail with permission denied;
- running the blocks again changes no privilege, and turns the grants of the page's
  earlier version (a monitor reading whole tables) into this version's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import pg_transport
from pg_transport.consume.vacuum import Vacuumer
from pg_transport.db.pool import Connector
from pg_transport.errors import NotPermitted
from pg_transport.store import Lease, Store
from tests.acceptance.harness import Worker, wait_for
from tests.integration.test_cli import clean_env, invoke
from tests.integration.test_docs import DOCS, autoscaling_queries, for_queue, sql_blocks
from tests.pg import metered_database
from tests.unit.test_compose import EXAMPLES

PAGE = DOCS / "least-privilege.md"
BLOCKS = ["1", "2", "4", "5", "6"]
SUPERUSER_BLOCKS = ("1", "2")
KINDS = ("owner", "worker", "publisher", "monitor")
PASSWORDS = {kind: f"{kind}-secret" for kind in KINDS}

# What the page grants, stated here on its own: per role, per operation, the columns of
# each table it may use ("*": every column). Anything not listed must be refused.
ALL = {"*"}
RIGHTS: dict[str, dict[str, dict[str, set[str]]]] = {
    "worker": {op: {"*": ALL} for op in ("SELECT", "INSERT", "UPDATE", "DELETE")},
    "publisher": {
        "SELECT": {
            "schema_version": {"version"},
            "message": {"publish_key"},
            "exchange": {"name", "type"},
            "binding": {"exchange", "queue", "routing_key", "pattern"},
            "queue": {"name", "message_ttl_ms", "fair"},
            "dead_letter": {"id"},
        },
        "INSERT": {
            "message": {
                "queue",
                "priority",
                "visible_at",
                "publish_key",
                "payload",
                "expires_at",
                "okey",
                "task_id",
                "follows",
                "follow_until",
                "followable",
                "ukey",
                "urun",
                "fkey",
            },
            "dead_letter": {
                "message_id",
                "queue",
                "priority",
                "read_ct",
                "enqueued_at",
                "reason",
                "payload",
            },
        },
    },
    "monitor": {
        "SELECT": {
            "schema_version": ALL,
            "queue": ALL,
            "message": {
                "id",
                "queue",
                "priority",
                "visible_at",
                "read_ct",
                "enqueued_at",
                # Ordering: keys blocked are counted by key, followers parked told apart.
                "okey",
                "due_at",
                "follow_until",
                # Flow limits: slots in use and waiting counted per limiter, not per key,
                # and per queue for a queue's own concurrency.
                "climit",
                "qslot",
            },
            "flow_limit": ALL,
            "dead_letter": {"id", "queue", "priority", "read_ct", "enqueued_at", "dead_at"},
            "barrier": {
                "id",
                "status",
                "total",
                "remaining",
                "created_at",
                "progressed_at",
                "expires_at",
                "stuck_timeout",
                "fired_at",
                "finished_at",
            },
            # `pgq web`'s samples: counts per queue, read by a console run as the monitor.
            "console_tick": ALL,
            "console_sample": ALL,
        },
    },
    "nobody": {},
}
# What carries task arguments or results: no role but the worker (and owner) reads it.
CONTENT = {
    ("message", "payload"),
    ("dead_letter", "payload"),
    ("dead_letter", "identity"),
    ("barrier", "callback"),
    ("barrier", "errback"),
    ("barrier", "metadata"),
    ("barrier_part", "result"),
    ("result", "meta"),
    ("result_group", "meta"),
    ("beat_entry", "args"),
    ("beat_entry", "kwargs"),
    ("beat_entry", "options"),
}


@dataclass(frozen=True)
class Roles:
    """Throwaway names for the page's roles and schema, in the database of ``pg_url``
    (a superuser's URL)."""

    pg_url: str
    tag: str

    @property
    def schema(self) -> str:
        return f"pgq_t_priv_{self.tag}"

    def role(self, kind: str) -> str:
        return f"pgq_t_{kind}_{self.tag}"

    @property
    def owner(self) -> str:
        return self.role("owner")

    @property
    def worker(self) -> str:
        return self.role("worker")

    @property
    def publisher(self) -> str:
        return self.role("publisher")

    @property
    def monitor(self) -> str:
        return self.role("monitor")

    @property
    def nobody(self) -> str:
        """A role that may log in and has no grant (only what PUBLIC has)."""
        return self.role("nobody")

    @property
    def database(self) -> str:
        return str(conninfo_to_dict(self.pg_url)["dbname"])

    def libpq(self, role: str) -> str:
        """A libpq URL for the test server as ``role`` (trust, or the page's password)."""
        params = conninfo_to_dict(self.pg_url)
        host = params.get("host") or "127.0.0.1"
        password = PASSWORDS.get(role.removeprefix("pgq_t_").rsplit("_", 1)[0], "")
        return (
            f"postgresql://{role}:{quote(password)}@{host}:{params.get('port') or 5432}"
            f"/{self.database}"
        )

    def url(self, role: str) -> str:
        return "pgq" + self.libpq(role).removeprefix("postgresql")

    def connect(self, role: str) -> psycopg.Connection[Any]:
        return psycopg.connect(self.libpq(role), autocommit=True)

    def substitute(self, text: str) -> str:
        names = {f"pgq_{kind}": self.role(kind) for kind in KINDS}
        names.update(pgq=self.schema, app=self.database)
        return re.sub(
            r"\b(pgq_owner|pgq_worker|pgq_publisher|pgq_monitor|pgq|app)\b",
            lambda m: names[m.group(1)],
            text,
        )

    def run_block(self, number: str) -> None:
        """One of the page's SQL blocks, as the role its first line names."""
        who, block = page_sql()[number]
        url = self.pg_url if who == "a superuser" else self.libpq(self.owner)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(self.substitute(block))

    def migrate(self) -> None:
        """Step 3 of the page: `pgq migrate` as the owner."""
        result = invoke("migrate", "--url", self.url(self.owner), "--schema", self.schema)
        assert result.exit_code == 0, result.output
        assert "applied" in result.stdout


def page_sql() -> dict[str, tuple[str, str]]:
    """The page's SQL blocks by their number (the first comment line: ``-- N. …, as WHO``),
    with the role they run as."""
    found = {}
    for block in sql_blocks(PAGE):
        match = re.match(r"-- (\d)\. .*, as (a superuser|pgq_owner)\n", block)
        assert match, f"SQL block without '-- N. …, as WHO': {block.splitlines()[0]}"
        assert (match.group(2) == "a superuser") == (match.group(1) in SUPERUSER_BLOCKS)
        found[match.group(1)] = (match.group(2), block)
    assert sorted(found) == BLOCKS
    return found


def url_of(pg_url: str, **changes: str) -> str:
    """``pg_url`` as a postgresql:// URL, with ``changes`` (libpq keywords) made."""
    params = {**conninfo_to_dict(pg_url), **changes}
    user = quote(params.get("user") or "")
    if params.get("password"):
        user += ":" + quote(params["password"])
    return (
        f"postgresql://{user}@{params.get('host') or '127.0.0.1'}"
        f":{params.get('port') or 5432}/{quote(params.get('dbname') or '')}"
    )


@contextmanager
def throwaway_database(pg_url: str) -> Iterator[str]:
    """A database of the test's own (a superuser's URL to it), dropped afterwards."""
    name = f"pgq_t_db_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    metered_database(name)
    try:
        yield url_of(pg_url, dbname=name)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def page_roles(pg_url: str, *, blocks: tuple[str, ...] = SUPERUSER_BLOCKS) -> Iterator[Roles]:
    """The page's roles and schema (its superuser ``blocks``) and a role without any
    grant, all dropped afterwards with what they own and were granted."""
    made = Roles(pg_url, uuid.uuid4().hex[:8])
    with psycopg.connect(pg_url, autocommit=True) as admin:
        try:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(made.nobody)))
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test role cannot create roles")
        try:
            for number in blocks:
                made.run_block(number)
            yield made
        finally:
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(made.schema))
            )
            for kind in (*reversed(KINDS), "nobody"):
                role = sql.Identifier(made.role(kind))
                admin.execute(sql.SQL("DROP OWNED BY {}").format(role))
                admin.execute(sql.SQL("DROP ROLE {}").format(role))


def grant(roles: Roles) -> Roles:
    """Steps 3-6 of the page: migrate as the owner, then its GRANT blocks, as the owner."""
    roles.migrate()
    for number in ("4", "5", "6"):
        roles.run_block(number)
    return roles


@pytest.fixture(scope="module")
def database(pg_url: str) -> Iterator[str]:
    with throwaway_database(pg_url) as url:
        yield url


@pytest.fixture
def roles(database: str) -> Iterator[Roles]:
    with page_roles(database) as made:
        yield made


@pytest.fixture
def granted(roles: Roles) -> Roles:
    return grant(roles)


def cli(roles: Roles, role: str, *args: str) -> Any:
    return invoke(*args, "--url", roles.url(role), "--schema", roles.schema)


def options(roles: Roles) -> dict[str, Any]:
    return {"schema": roles.schema, "auto_migrate": False}


def refused(conn: psycopg.Connection[Any], statement: sql.Composable, *params: Any) -> bool:
    """Run ``statement``; False when it runs, True when Postgres refuses the privilege.
    Any other error fails the test: only a refusal counts as one."""
    try:
        conn.execute(statement, params or None)
    except psycopg.errors.InsufficientPrivilege:
        return True
    return False


# -- the page's rights, every column, for real ----------------------------------------


def columns(roles: Roles) -> dict[str, list[tuple[str, bool]]]:
    """Every table of the schema, its columns and whether each is an identity column."""
    with psycopg.connect(roles.pg_url) as admin:
        rows = admin.execute(
            "SELECT table_name, column_name, is_identity = 'YES' FROM information_schema.columns"
            " WHERE table_schema = %s ORDER BY table_name, ordinal_position",
            [roles.schema],
        ).fetchall()
    found: dict[str, list[tuple[str, bool]]] = {}
    for table, column, identity in rows:
        found.setdefault(table, []).append((column, identity))
    return found


def allowed(rights: dict[str, dict[str, set[str]]], op: str, table: str, column: str) -> bool:
    granted_columns = rights.get(op, {})
    listed = granted_columns.get(table, granted_columns.get("*", set()))
    return column in listed or listed == ALL


def what_runs(roles: Roles, role: str) -> dict[tuple[str, str, str], bool]:
    """(operation, table, column) -> whether ``role`` may: every column read, inserted and
    updated, every table deleted from (column ``""``), each attempted on no row at all —
    Postgres checks privileges before it looks for rows, and nothing changes."""
    outcome = {}
    s = sql.Identifier(roles.schema)
    with roles.connect(role) as conn:
        for table, cols in columns(roles).items():
            t = sql.SQL("{}.{}").format(s, sql.Identifier(table))
            for column, identity in cols:
                c = sql.Identifier(column)
                overriding = sql.SQL("OVERRIDING SYSTEM VALUE " if identity else "")
                statements = {
                    "SELECT": sql.SQL("SELECT {} FROM {} WHERE false").format(c, t),
                    "INSERT": sql.SQL("INSERT INTO {} ({}) {}SELECT NULL WHERE false").format(
                        t, c, overriding
                    ),
                    "UPDATE": sql.SQL("UPDATE {} SET {} = DEFAULT WHERE false").format(t, c),
                }
                for op, statement in statements.items():
                    outcome[(op, table, column)] = not refused(conn, statement)
            outcome[("DELETE", table, "")] = not refused(
                conn, sql.SQL("DELETE FROM {} WHERE false").format(t)
            )
    return outcome


@pytest.mark.parametrize("kind", ["worker", "publisher", "monitor", "nobody"])
def test_each_role_uses_exactly_the_columns_the_page_grants(granted: Roles, kind: str) -> None:
    rights = RIGHTS[kind]
    if kind == "nobody":  # only what PUBLIC had before block 2: CONNECT
        with psycopg.connect(granted.pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                    sql.Identifier(granted.database), sql.Identifier(granted.nobody)
                )
            )
    outcome = what_runs(granted, granted.role(kind))
    expected = {key: allowed(rights, key[0], key[1], key[2] or "*") for key in outcome}
    wrong = {key: ran for key, ran in outcome.items() if ran != expected[key]}
    assert wrong == {}, f"{kind}: allowed (True) or refused (False) against the page"
    # Content is the worker's only: no payload, argument or result for anyone else.
    if kind != "worker":
        assert not any(outcome[("SELECT", table, column)] for table, column in CONTENT)
    # No role of the page may empty a table at once, nor change the schema.
    with granted.connect(granted.role(kind)) as conn:
        for table in columns(granted):
            assert refused(
                conn,
                sql.SQL("TRUNCATE {}.{}").format(
                    sql.Identifier(granted.schema), sql.Identifier(table)
                ),
            ), table


def statements(block: str) -> list[str]:
    """The statements of an SQL block, comments dropped and whitespace normalised."""
    code = "\n".join(line.split("--", 1)[0] for line in block.splitlines())
    return [" ".join(s.split()) for s in code.split(";") if s.strip()]


def test_the_security_page_shows_only_statements_run_here() -> None:
    """docs/security.md quotes grants; each is one of this page's, which run above."""
    run_here = {s for _, block in page_sql().values() for s in statements(block)}
    quoted = [s for block in sql_blocks(DOCS / "security.md") for s in statements(block)]
    assert quoted
    for statement in quoted:
        assert statement in run_here, statement


def test_the_rights_hold_no_content_for_the_publisher_and_monitor() -> None:
    """The table above is the spec: no one but the worker reads what messages carry."""
    for kind in ("publisher", "monitor", "nobody"):
        for table, column in CONTENT:
            assert not allowed(RIGHTS[kind], "SELECT", table, column), (kind, table, column)
        assert not any(RIGHTS[kind].get(op) for op in ("UPDATE", "DELETE")), kind


# -- the worker -------------------------------------------------------------------------


def test_worker_role_round_trips_and_handles_dead_letters(granted: Roles) -> None:
    with Connection(granted.url(granted.worker), transport_options=options(granted)) as conn:
        queue = conn.SimpleQueue("jobs")
        queue.put({"n": 1})
        message = queue.get(timeout=10)
        assert message.payload == {"n": 1}
        message.ack()
        queue.put({"n": 2})
        poisoned = queue.get(timeout=10)
        poisoned.reject(requeue=False)  # to the dead-letter table, as this role
        assert queue.qsize() == 0
        listed = cli(granted, granted.worker, "dead", "list", "--json")
        assert listed.exit_code == 0, listed.output
        assert '"total": 1' in listed.stdout
        requeued = cli(granted, granted.worker, "dead", "requeue", "--all")
        assert requeued.exit_code == 0, requeued.output
        again = queue.get(timeout=10)
        assert again.payload == {"n": 2}
        again.ack()
        queue.put({"n": 3})
        purged = cli(granted, granted.worker, "purge", "jobs")
        assert purged.exit_code == 0 and purged.stdout.startswith("1 waiting message purged")
        queue.close()
    status = cli(granted, granted.worker, "status", "--json")
    assert status.exit_code == 0, status.output
    delayed = cli(granted, granted.worker, "delayed", "--json")
    assert delayed.exit_code == 0, delayed.output


def test_worker_role_runs_beat_and_pgq_schedule_and_no_other_role_does(granted: Roles) -> None:
    from pg_transport.beat import CannotStart, Scheduler

    added = cli(
        granted, granted.worker, "schedule", "add", "tick", "--task", "t.tick", "--every", "1"
    )
    assert added.exit_code == 0, added.output
    app = Celery("beat_priv", broker=granted.url(granted.worker))
    app.conf.update(
        broker_transport_options=options(granted), beat_schedule={}, result_expires=None
    )
    beat = Scheduler(app)
    try:
        assert beat.hold_lease()
        with psycopg.connect(granted.pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("UPDATE {}.beat_entry SET anchor = now() - interval '1.5 s'").format(
                    sql.Identifier(granted.schema)
                )
            )
        beat.send_due()
    finally:
        beat.close()
    listed = cli(granted, granted.worker, "schedule", "list", "--json")
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["entries"][0]["sent_count"] == 1
    publisher_app = Celery("beat_pub", broker=granted.url(granted.publisher))
    publisher_app.conf.update(
        broker_transport_options=options(granted), beat_schedule={}, result_expires=None
    )
    with pytest.raises(CannotStart, match=r"may not keep the schedule.*run beats as the worker"):
        Scheduler(publisher_app)
    for kind in ("publisher", "monitor"):
        refused_list = cli(granted, granted.role(kind), "schedule", "list")
        assert refused_list.exit_code == 1, (kind, refused_list.output)
        assert "permission denied" in refused_list.output, (kind, refused_list.output)


def test_no_role_but_the_owner_changes_the_schema(granted: Roles) -> None:
    s = sql.Identifier(granted.schema)
    attempts = [
        sql.SQL("DROP TABLE {}.message").format(s),
        sql.SQL("ALTER TABLE {}.message ADD COLUMN evil integer").format(s),
        sql.SQL("CREATE TABLE {}.evil (id integer)").format(s),
        sql.SQL("DROP SCHEMA {} CASCADE").format(s),
        sql.SQL("CREATE INDEX evil_idx ON {}.message (queue)").format(s),
    ]
    for kind in ("worker", "publisher", "monitor"):
        with granted.connect(granted.role(kind)) as conn:
            for statement in attempts:
                assert refused(conn, statement), (kind, statement.as_string(conn))
    assert len(columns(granted)) >= 10  # all still there


def test_worker_role_cannot_migrate_and_says_who_can(granted: Roles) -> None:
    s = sql.Identifier(granted.schema)
    with psycopg.connect(granted.pg_url, autocommit=True) as admin:
        # As if this pgq were one migration ahead of the database.
        (last,) = admin.execute(
            sql.SQL(
                "DELETE FROM {}.schema_version WHERE version = "
                "(SELECT max(version) FROM {}.schema_version) RETURNING version"
            ).format(s, s)
        ).fetchone() or (None,)
        try:
            result = cli(granted, granted.worker, "migrate")
            assert result.exit_code == 1
            assert (
                f"role {granted.worker!r} cannot create or upgrade the pgq schema" in result.stderr
            )
            assert f"run `pgq migrate` as {granted.owner!r}" in result.stderr
        finally:
            admin.execute(
                sql.SQL("INSERT INTO {}.schema_version (version) VALUES (%s)").format(s), [last]
            )


def test_only_the_owner_vacuums_as_the_page_says(granted: Roles) -> None:
    vacuum = re.search(r'-c "(VACUUM [^"]+)"', PAGE.read_text())
    assert vacuum, "the page's scheduled VACUUM"
    for role, allowed_to in ((granted.worker, False), (granted.owner, True)):
        connector = Connector(granted.libpq(role))
        try:
            assert Vacuumer(connector, granted.schema, threshold=0).check() is allowed_to, role
        finally:
            connector.close()
    with granted.connect(granted.owner) as owner:
        owner.execute(granted.substitute(vacuum.group(1)))  # the cron line runs as written


# -- the publisher ----------------------------------------------------------------------


def declared_by_the_worker(roles: Roles) -> None:
    """What workers declare when they start: queue 'jobs' (default exchange), queue
    'audit' bound to topic exchange 'events' by 'user.*', and direct exchange 'tasks'
    with no binding."""
    audit = Queue("audit", Exchange("events", type="topic"), routing_key="user.*")
    tasks = Exchange("tasks", type="direct")
    with Connection(roles.url(roles.worker), transport_options=options(roles)) as conn:
        channel = conn.channel()
        Queue("jobs").bind(channel).declare()
        audit.bind(channel).declare()
        tasks.bind(channel).declare()


def publisher_app(roles: Roles, queues: list[str]) -> Celery:
    """A Celery app configured as section 8 of the page says."""
    app = Celery("web", broker=roles.url(roles.publisher))
    app.conf.broker_transport_options = options(roles)
    app.conf.task_queues = [Queue(name, no_declare=True) for name in queues]
    app.conf.task_default_queue = queues[0]
    app.conf.task_create_missing_queues = False
    return app


def test_publisher_publishes_every_way_and_the_worker_gets_it(granted: Roles) -> None:
    declared_by_the_worker(granted)
    events = Exchange("events", type="topic", no_declare=True)
    tasks = Exchange("tasks", type="direct", no_declare=True)
    publisher = Connection(granted.url(granted.publisher), transport_options=options(granted))
    with publisher:
        producer = Producer(publisher.channel())
        producer.publish({"n": "direct"}, routing_key="jobs", priority=7)
        routed = Producer(publisher.channel(), exchange=events)
        routed.publish({"n": "routed"}, routing_key="user.created")
        with pg_transport.batch():
            producer.publish({"n": "batched"}, routing_key="jobs")
            routed.publish({"n": "batched-routed"}, routing_key="user.deleted")
        # Routed through a direct exchange to a key nothing is bound to: a dead letter.
        Producer(publisher.channel(), exchange=tasks).publish({"n": "lost"}, routing_key="x")
        # A resent publish (the same key, as after an ambiguous commit) inserts nothing.
        channel = publisher.default_channel
        resent = channel.prepare_message(
            json.dumps({"n": "keyed"}),
            0,
            "application/json",
            "utf-8",
            {},
            {"delivery_tag": "tag-1"},
        )
        resent["properties"]["delivery_info"].update(exchange="", routing_key="jobs")
        for _ in range(2):
            channel.connection.publisher.publish("jobs", resent, publish_key=f"k-{granted.tag}")
    app = publisher_app(granted, ["jobs"])
    eta_id = app.send_task("t.later", queue="jobs", countdown=3600, priority=3).id
    app.close()

    with psycopg.connect(granted.pg_url) as admin:
        s = sql.Identifier(granted.schema)
        stored = admin.execute(
            sql.SQL(
                "SELECT queue, priority, visible_at > now() + interval '50 minutes'"
                " FROM {}.message ORDER BY id"
            ).format(s)
        ).fetchall()
        dead = admin.execute(
            sql.SQL("SELECT queue, reason FROM {}.dead_letter").format(s)
        ).fetchall()
    assert stored == [
        ("jobs", 7, False),
        ("audit", 0, False),
        ("jobs", 0, False),
        ("audit", 0, False),
        ("jobs", 0, False),
        ("jobs", 3, True),
    ]
    assert len(dead) == 1 and dead[0][0] == "x" and dead[0][1].startswith("unroutable")

    # The worker role gets every message that is due, in priority order.
    with Connection(granted.url(granted.worker), transport_options=options(granted)) as conn:
        got = []
        for name in ("jobs", "audit"):
            queue = conn.SimpleQueue(name)
            while True:
                try:
                    message = queue.get(timeout=0.5)
                except queue.Empty:
                    break
                got.append(message.payload["n"])
                message.ack()
            queue.close()
    assert got == ["direct", "batched", "keyed", "routed", "batched-routed"]
    with psycopg.connect(granted.pg_url) as admin:
        [(task_id,)] = admin.execute(
            sql.SQL("SELECT payload->'headers'->>'id' FROM {}.message").format(
                sql.Identifier(granted.schema)
            )
        ).fetchall()
    assert task_id == eta_id  # the ETA message waits for its time


def test_publisher_publishes_unique_tasks_and_learns_only_the_holders_id(
    granted: Roles,
) -> None:
    """A publisher-only role publishes unique tasks, direct and routed (Celery's default
    exchange), and a duplicate is answered with the holder's task id, through
    unique_holder(), the one function it may run beside none: it still reads no row."""
    declared_by_the_worker(granted)
    app = publisher_app(granted, ["jobs"])

    @app.task(name="t.unique", base=pg_transport.UniqueTask, unique_key="n")
    def unique_task(n: int) -> None: ...

    first = unique_task.delay(1)
    assert unique_task.delay(1).id == first.id
    with pytest.raises(pg_transport.DuplicateTask) as dup:
        unique_task.apply_async((1,), unique_conflict="raise")
    assert dup.value.existing_id == first.id
    second = unique_task.delay(2)
    app.close()
    # Direct to the queue (the default exchange), in a batch too.
    with Connection(granted.url(granted.publisher), transport_options=options(granted)) as pub:
        producer = Producer(pub.channel())
        for _ in range(2):
            producer.publish({"n": "u"}, routing_key="jobs", headers={"pgq-unique-key": "u"})
        with pg_transport.batch():
            producer.publish({"n": "v"}, routing_key="jobs", headers={"pgq-unique-key": "v"})
            producer.publish({"n": "v"}, routing_key="jobs", headers={"pgq-unique-key": "v"})
    with granted.connect(granted.publisher) as conn:
        s = sql.Identifier(granted.schema)
        assert refused(conn, sql.SQL("SELECT ukey FROM {}.message").format(s))
        assert refused(conn, sql.SQL("SELECT task_id FROM {}.message").format(s))
    with psycopg.connect(granted.pg_url) as admin:
        stored = admin.execute(
            sql.SQL("SELECT ukey, task_id FROM {}.message ORDER BY id").format(
                sql.Identifier(granted.schema)
            )
        ).fetchall()
    assert [k for k, _ in stored] == ["t.unique:1", "t.unique:2", "u", "v"]
    assert [t for _, t in stored][:2] == [first.id, second.id]


def test_publisher_may_not_read_take_or_reroute(granted: Roles) -> None:
    declared_by_the_worker(granted)
    secret = "sk-" + uuid.uuid4().hex
    with Connection(granted.url(granted.worker), transport_options=options(granted)) as conn:
        Producer(conn.channel()).publish({"secret": secret}, routing_key="jobs")
        Producer(conn.channel()).publish({"secret": secret}, routing_key="jobs")
        [held] = conn.transport.store.claim(["jobs"], [300.0], 1)
        conn.SimpleQueue("jobs").get(timeout=10).reject(requeue=False)  # one dead letter
    with psycopg.connect(granted.pg_url) as admin:
        before = admin.execute(
            sql.SQL(
                "SELECT (SELECT array_agg((id, lease, visible_at)::text ORDER BY id)"
                " FROM {s}.message), (SELECT count(*) FROM {s}.dead_letter),"
                " (SELECT count(*) FROM {s}.binding),"
                " (SELECT array_agg((name, expires_ms)::text) FROM {s}.queue)"
            ).format(s=sql.Identifier(granted.schema))
        ).fetchone()

    connector = Connector(granted.libpq(granted.publisher))
    store = Store(connector, granted.schema)
    forged = Lease(held.id, held.lease, "jobs")
    try:
        # Store calls a worker makes: each refused by Postgres.
        for attempt in (
            lambda: store.claim(["jobs"], [30.0], 1),
            lambda: store.pop(["jobs"], 1),
            lambda: store.ack([forged]),
            lambda: store.release([forged]),
            lambda: store.renew([(forged, 3600.0)]),
            lambda: store.dead_letter(forged, "forged"),
            lambda: store.purge("jobs"),
            lambda: store.size("jobs"),
            lambda: store.get_dead_letter(1),
            lambda: store.unbind("events", "audit", "user.*"),
            lambda: store.delete_queue("audit"),
            lambda: store.delete_exchange("events"),
            lambda: store.maintain(["jobs"]),
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                attempt()
        # Declaring, too: refused, with what to do instead.
        for declaring in (
            lambda: store.declare_queue("jobs", expires_ms=1, message_ttl_ms=None),
            lambda: store.declare_exchange("events", "fanout"),
            lambda: store.bind("events", "stolen", "#", ".*"),
        ):
            with pytest.raises(NotPermitted) as raised:
                declaring()
            assert isinstance(raised.value.__cause__, psycopg.errors.InsufficientPrivilege)
    finally:
        connector.close()
    # The commands an operator runs as the worker.
    for args in (
        ["dead", "list"],
        ["dead", "requeue", "--all"],
        ["dead", "purge", "--yes"],
        ["purge", "jobs"],
        ["status"],
        ["barrier", "show", "b"],
    ):
        result = cli(granted, granted.publisher, *args)
        assert result.exit_code == 1, (args, result.output)
        assert "permission denied for table" in result.stderr, (args, result.stderr)
        assert secret not in result.output
    # A fan-in barrier is armed with its parts: not the publisher's to write.
    with granted.connect(granted.publisher) as conn:
        assert refused(
            conn,
            sql.SQL(
                "INSERT INTO {}.barrier (id, total, remaining, callback, expires_at, stuck_timeout)"
                " VALUES ('b', 1, 1, '{{}}', now(), '1 hour')"
            ).format(sql.Identifier(granted.schema)),
        )
    with psycopg.connect(granted.pg_url) as admin:
        after = admin.execute(
            sql.SQL(
                "SELECT (SELECT array_agg((id, lease, visible_at)::text ORDER BY id)"
                " FROM {s}.message), (SELECT count(*) FROM {s}.dead_letter),"
                " (SELECT count(*) FROM {s}.binding),"
                " (SELECT array_agg((name, expires_ms)::text) FROM {s}.queue)"
            ).format(s=sql.Identifier(granted.schema))
        ).fetchone()
    assert after == before


def test_a_publisher_that_declares_is_told_so_and_stores_nothing(granted: Roles) -> None:
    """kombu's and Celery's defaults declare before publishing: the page says to turn
    that off, and what the error is when it was not."""
    declared_by_the_worker(granted)
    role, schema = granted.publisher, granted.schema
    app = Celery("web", broker=granted.url(role))
    app.conf.broker_transport_options = options(granted)
    remedy = (
        r"declare it as a role that may \(the workers do when they start\), or publish"
        r" without declaring \(no_declare=True on the queue or exchange; see"
        r" docs/least-privilege.md\)"
    )
    with pytest.raises(
        NotPermitted,
        match=(
            f"^role '{role}' may not declare exchange 'jobs' in pgq schema '{schema}' "
            rf"\(permission denied for table exchange\): {remedy}$"
        ),
    ) as raised:
        app.send_task("t.any", queue="jobs")
    assert isinstance(raised.value.__cause__, psycopg.errors.InsufficientPrivilege)
    app.close()
    with Connection(granted.url(role), transport_options=options(granted)) as conn:
        with pytest.raises(
            NotPermitted,
            match=(
                f"^role '{role}' may not declare queue 'jobs' .*permission denied for table queue"
            ),
        ):
            Producer(conn.channel()).publish(
                {"n": 1}, routing_key="jobs", declare=[Queue("jobs", Exchange(""))]
            )
        with pytest.raises(NotPermitted, match="may not declare exchange 'events'"):
            Producer(conn.channel(), exchange=Exchange("events", type="topic")).publish(
                {"n": 2}, routing_key="user.created"
            )
        with pytest.raises(
            NotPermitted,
            match=(r"may not declare a binding of queue 'audit' to 'events' .*table binding"),
        ):
            conn.default_channel.queue_bind("audit", "events", "user.#")
    # A queue not listed (task_create_missing_queues off) is refused before any SQL.
    listed = publisher_app(granted, ["jobs"])
    with pytest.raises(KeyError, match="elsewhere"):
        listed.send_task("t.any", queue="elsewhere")
    listed.close()
    with psycopg.connect(granted.pg_url) as admin:
        assert admin.execute(
            sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(granted.schema))
        ).fetchone() == (0,)


# -- the monitor --------------------------------------------------------------------------


def a_busy_schema(roles: Roles, secret: str) -> None:
    """Messages ready, delayed, in flight and dead; in queue ordered, an ordering key
    blocked (one message in flight, two parked behind it) and a follower parked; barriers
    armed and fired; each carrying ``secret``."""
    with Connection(roles.url(roles.worker), transport_options=options(roles)) as conn:
        store, publisher = conn.transport.store, conn.transport.publisher
        for n in range(3):
            publisher.publish("jobs", {"secret": secret, "n": n})
        publisher.publish("jobs", {"secret": secret}, delay=3600)
        publisher.publish("reports", {"secret": secret}, priority=5)
        for n in range(3):
            headers = {"id": f"k{n}", "pgq-ordering-key": "cust-42"}
            publisher.publish("ordered", {"secret": secret, "headers": headers})
        headers = {"id": "f", "pgq-follows": "k0"}
        publisher.publish("ordered", {"secret": secret, "headers": headers})
        store.claim(["jobs"], [300.0], 1)
        assert len(store.claim(["ordered"], [300.0], 4)) == 1
        [doomed] = store.claim(["reports"], [300.0], 1)
        store.dead_letter(doomed.token, f"failed: {secret}")
    with psycopg.connect(roles.pg_url, autocommit=True) as admin:
        # A flow limit with a slot in use and one waiting: counted per limit, never by key.
        admin.execute(
            sql.SQL(
                "INSERT INTO {}.flow_limit (name, rate_count, rate_period, burst, concurrency,"
                " origin) VALUES ('erp', 600, 60, 3, 1, 'command')"
            ).format(sql.Identifier(roles.schema))
        )
    with Connection(roles.url(roles.worker), transport_options=options(roles)) as conn:
        store, publisher = conn.transport.store, conn.transport.publisher
        for n in range(2):
            headers = {"pgq-concurrency-limiter": "erp", "pgq-concurrency-key": secret}
            publisher.publish("limited", {"secret": secret, "n": n, "headers": headers})
        assert len(store.claim(["limited"], [300.0], 2)) == 1
        # Unique keys: one held while running, one queued (counted, never shown).
        for n, mode in enumerate(("queued_or_running", "queued")):
            headers = {"pgq-unique-key": f"{secret}-{n}", "pgq-unique-while": mode}
            publisher.publish("unique", {"secret": secret, "n": n, "headers": headers})
            if n == 0:
                assert len(store.claim(["unique"], [300.0], 1)) == 1
    with psycopg.connect(roles.pg_url, autocommit=True) as admin:
        for status in ("armed", "fired"):
            admin.execute(
                sql.SQL(
                    "INSERT INTO {}.barrier (id, status, total, remaining, callback, metadata,"
                    " expires_at, stuck_timeout) VALUES (%s, %s, 2, 0, %s, %s, now(), '1 hour')"
                ).format(sql.Identifier(roles.schema)),
                [
                    f"b-{status}",
                    status,
                    json.dumps({"kwargs": {"secret": secret}}),
                    json.dumps({"secret": secret}),
                ],
            )


def queue_figures(text: str) -> list[str]:
    """The exposition's sample lines of queues and barriers, ages left out (they tick)."""
    return sorted(
        line
        for line in text.splitlines()
        if line.startswith(("pgq_queue_", "pgq_barriers", "pgq_limit_")) and "_age_" not in line
    )


def without_ages(figures: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
    queues = [dict(q) for q in figures["queues"]]
    # Ages and the time to the next due message move between two calls.
    ages = [q.pop("oldest_ready_age_s") or 0.0 for q in queues]
    ages += [q.pop("next_due_in_s") or 0.0 for q in queues]
    ages += [q.pop("oldest_blocked_age_s") or 0.0 for q in queues]
    return {**figures, "queues": queues}, ages


def test_monitor_sees_every_figure_and_no_content(granted: Roles) -> None:
    secret = "sk-" + uuid.uuid4().hex
    a_busy_schema(granted, secret)
    superuser = "pgq" + granted.pg_url.removeprefix("postgresql")

    def status(url: str) -> dict[str, Any]:
        result = invoke("status", "--json", "--url", url, "--schema", granted.schema)
        assert result.exit_code == 0, result.output
        figures: dict[str, Any] = json.loads(result.stdout)
        figures.pop("clients")
        return figures

    as_monitor = status(granted.url(granted.monitor))
    (seen, ages), (reference_figures, reference_ages) = map(
        without_ages, (as_monitor, status(superuser))
    )
    assert seen == reference_figures
    assert ages == pytest.approx(reference_ages, abs=1.0)
    jobs = next(q for q in as_monitor["queues"] if q["queue"] == "jobs")
    assert (jobs["ready"], jobs["in_flight"], jobs["delayed"]) == (2, 1, 1)
    ordered = next(q for q in as_monitor["queues"] if q["queue"] == "ordered")
    assert (ordered["blocked_keys"], ordered["blocked"], ordered["following"]) == (1, 2, 1)
    assert (ordered["in_flight"], ordered["delayed"]) == (1, 0)
    assert sum(q["dead"] for q in as_monitor["queues"]) == 1
    assert len(as_monitor["barriers"]) == 2
    [erp] = as_monitor["limits"]
    assert (erp["name"], erp["in_flight"], erp["waiting"]) == ("erp", 1, 1)
    unique = next(q for q in as_monitor["queues"] if q["queue"] == "unique")
    assert (unique["unique_queued"], unique["unique_running"]) == (1, 1)
    text = cli(granted, granted.monitor, "status")
    assert text.exit_code == 0, text.output
    assert ["unique", "1", "1"] in [line.split() for line in text.stdout.splitlines()]

    # `pgq limit list` and `show` as the monitor: the workers' figures, without the keys.
    def limit_json(role: str, *args: str) -> Any:
        result = cli(granted, role, "limit", *args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    for args in (["list"], ["show", "erp"]):
        mine, theirs = limit_json(granted.monitor, *args), limit_json(granted.worker, *args)
        assert mine.pop("keys", None) is None
        assert len(theirs.pop("keys", [])) == (1 if args[0] == "show" else 0)
        assert mine == theirs, args
    [listed] = limit_json(granted.monitor, "list")["limits"]
    assert (listed["name"], listed["keys"], listed["in_flight"]) == ("erp", 1, 1)
    shown = cli(granted, granted.monitor, "limit", "show", "erp")
    assert shown.exit_code == 0, shown.output
    assert "keys not shown" in shown.stdout and secret not in shown.stdout

    metrics = cli(granted, granted.monitor, "metrics")
    assert metrics.exit_code == 0, metrics.output
    reference = invoke("metrics", "--url", superuser, "--schema", granted.schema)
    assert queue_figures(metrics.stdout) == queue_figures(reference.stdout) != []
    assert 'pgq_limit_waiting_messages{limit="erp"} 1' in queue_figures(metrics.stdout)
    # The console's limits page, run as the monitor: the same counts, no key.
    pytest.importorskip("tornado")
    from pg_transport.db.pool import Connector
    from pg_transport.web.base import Console
    from tests.integration.test_web_auth import Browser, serving
    from tests.integration.test_web_limits import limit_rows, unique_rows

    connector = Connector(granted.libpq(granted.monitor))
    console = Console(connector, granted.schema)
    try:
        with serving(console) as port:
            status_code, _, page = Browser(port).request("GET", "/limits")
    finally:
        console.executor.shutdown(wait=False)
        connector.close()
    assert status_code == 200, page
    assert limit_rows(page) == {"erp": ["600/m", "3", "1", "1", "1"]}
    assert unique_rows(page) == {"unique": ["1", "1"]}
    assert secret not in page

    # monitoring.md's autoscaling queries, as the role its KEDA example connects as.
    with granted.connect(granted.monitor) as monitor, psycopg.connect(granted.pg_url) as admin:
        for kind, query in autoscaling_queries().items():
            for queue in ("jobs", "reports", "idle"):
                statement = for_queue(query, granted.schema, queue)
                [(mine,)] = monitor.execute(statement).fetchall()
                [(theirs,)] = admin.execute(statement).fetchall()
                # Ages are whole seconds, read a moment apart.
                assert abs(mine - theirs) <= (1 if kind == "age" else 0), (kind, queue)

    # What shows content is refused, and says why.
    for args in (
        ["dead", "list"],
        ["barrier", "show", "b-armed"],
        ["dead", "requeue", "--all"],
        ["dead", "purge", "--yes"],
        ["purge", "jobs"],
        ["delayed"],
    ):
        result = cli(granted, granted.monitor, *args)
        assert result.exit_code == 1, (args, result.output)
        assert "permission denied for table" in result.stderr, (args, result.stderr)
    for result in (metrics, reference):
        assert secret not in result.output
    with granted.connect(granted.monitor) as monitor:
        for table in ("message", "dead_letter", "barrier", "barrier_part"):
            assert refused(
                monitor,
                sql.SQL("SELECT * FROM {}.{}").format(
                    sql.Identifier(granted.schema), sql.Identifier(table)
                ),
            ), table


def test_each_role_runs_exactly_the_owner_s_functions_the_page_grants(granted: Roles) -> None:
    """The functions that run as the owner (SECURITY DEFINER) each role may call: the
    monitor's two return counts only; the publisher's one a task id; no role of the page
    may call one it was not granted, and a role with no grant none."""
    expected = {
        "worker": [
            "flow_limit_states", "result_forget", "result_group_delete", "result_group_read",
            "result_group_save", "result_read", "unique_counts", "unique_holder",
        ],
        "monitor": ["flow_limit_states", "unique_counts"],
        "publisher": ["unique_holder"],
        "nobody": [],
    }  # fmt: skip
    for kind, names in expected.items():
        with psycopg.connect(granted.pg_url) as admin:
            rows = admin.execute(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = %s AND p.prosecdef"
                " AND has_function_privilege(%s, p.oid, 'EXECUTE') ORDER BY 1",
                [granted.schema, granted.role(kind)],
            ).fetchall()
        assert [r[0] for r in rows] == names, kind
    s = sql.Identifier(granted.schema)
    with granted.connect(granted.publisher) as conn:
        for call in ("unique_counts()", "flow_limit_states(NULL)"):
            assert refused(conn, sql.SQL("SELECT * FROM {}." + call).format(s)), call


# -- connecting, upgrading, running the blocks again -------------------------------------


def test_block_2_lets_in_the_four_roles_only(granted: Roles) -> None:
    for kind in KINDS:
        with granted.connect(granted.role(kind)) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (granted.role(kind),)
    with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
        granted.connect(granted.nobody)
    # Names resolve in pg_catalog only for the roles pgq's SQL runs as (block 1).
    with granted.connect(granted.publisher) as conn:
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog, pg_temp",)


def privileges(roles: Roles) -> dict[str, Any]:
    """Every privilege on the schema, its tables and columns, the database, and the
    default privileges in the schema (ACL items sorted: their order means nothing)."""
    with psycopg.connect(roles.pg_url) as admin:

        def rows(query: str) -> list[Any]:
            return admin.execute(query, {"schema": roles.schema, "db": roles.database}).fetchall()

        return {
            "schema": rows(
                "SELECT ARRAY(SELECT unnest(nspacl)::text ORDER BY 1)"
                " FROM pg_namespace WHERE nspname = %(schema)s"
            ),
            "tables": rows(
                "SELECT c.relname, ARRAY(SELECT unnest(c.relacl)::text ORDER BY 1)"
                " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %(schema)s ORDER BY 1"
            ),
            "columns": rows(
                "SELECT c.relname, a.attname,"
                " ARRAY(SELECT unnest(a.attacl)::text ORDER BY 1)"
                " FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %(schema)s AND a.attacl IS NOT NULL"
                " ORDER BY 1, 2"
            ),
            "defaults": rows(
                "SELECT d.defaclrole::regrole::text, d.defaclobjtype,"
                " ARRAY(SELECT unnest(d.defaclacl)::text ORDER BY 1)"
                " FROM pg_default_acl d JOIN pg_namespace n"
                " ON n.oid = d.defaclnamespace WHERE n.nspname = %(schema)s"
                " ORDER BY 1, 2"
            ),
            "database": rows(
                "SELECT ARRAY(SELECT unnest(datacl)::text ORDER BY 1)"
                " FROM pg_database WHERE datname = %(db)s"
            ),
        }


# The monitor's grants as this page gave them before it granted columns.
EARLIER_MONITOR_BLOCK = """
GRANT USAGE ON SCHEMA pgq TO pgq_monitor;
GRANT SELECT ON ALL TABLES IN SCHEMA pgq TO pgq_monitor;
ALTER DEFAULT PRIVILEGES FOR ROLE pgq_owner IN SCHEMA pgq
    GRANT SELECT ON TABLES TO pgq_monitor;
"""


def test_running_the_blocks_again_changes_nothing_and_replaces_earlier_grants(
    granted: Roles,
) -> None:
    once = privileges(granted)
    assert any(granted.monitor in item for _, _, acl in once["columns"] for item in acl)
    for number in ("2", "4", "5", "6", "4", "5", "6"):
        granted.run_block(number)
    assert privileges(granted) == once
    # Grants of the page's earlier version: the monitor read whole tables, payloads too.
    with granted.connect(granted.owner) as owner:
        owner.execute(granted.substitute(EARLIER_MONITOR_BLOCK))
    with granted.connect(granted.monitor) as monitor:
        monitor.execute(
            sql.SQL("SELECT payload FROM {}.message").format(sql.Identifier(granted.schema))
        )
    granted.run_block("5")
    assert privileges(granted) == once
    with granted.connect(granted.monitor) as monitor:
        assert refused(
            monitor,
            sql.SQL("SELECT payload FROM {}.message").format(sql.Identifier(granted.schema)),
        )


def test_what_a_later_migration_adds_is_the_workers_only(granted: Roles) -> None:
    """A new table is the worker's through its default privileges; a new column of an
    existing table too (its grants are table-wide). The publisher and monitor have only
    the columns the page lists, before and after the blocks run again."""
    s = sql.Identifier(granted.schema)
    with granted.connect(granted.owner) as owner:
        owner.execute(sql.SQL("CREATE TABLE {}.later (id integer)").format(s))
        owner.execute(sql.SQL("ALTER TABLE {}.message ADD COLUMN later text").format(s))
    for rerun in (False, True):
        if rerun:
            for number in ("4", "5", "6"):
                granted.run_block(number)
        with granted.connect(granted.worker) as worker:
            worker.execute(sql.SQL("INSERT INTO {}.later VALUES (1)").format(s))
            worker.execute(sql.SQL("SELECT later FROM {}.message").format(s))
        for kind in ("publisher", "monitor"):
            with granted.connect(granted.role(kind)) as conn:
                assert refused(conn, sql.SQL("SELECT id FROM {}.later").format(s)), kind
                assert refused(conn, sql.SQL("SELECT later FROM {}.message").format(s)), kind


def test_the_atomic_fence_ends_a_delivery_with_the_callers_rights_only(granted: Roles) -> None:
    """``atomic_complete`` (migration 0019) runs with its caller's rights: the worker's
    DELETE on message lets it end a delivery (no such row here: refused with the fence's
    own PQ001, past the rights); the publisher and monitor are refused at the DELETE."""
    call = sql.SQL(
        "SELECT {}.atomic_complete(0, 0, 'q', pg_catalog.pg_current_xact_id()::text)"
    ).format(sql.Identifier(granted.schema))
    with granted.connect(granted.worker) as worker:
        with pytest.raises(psycopg.Error) as lapsed:
            worker.execute(call)
        assert lapsed.value.sqlstate == "PQ001"
    for kind in ("publisher", "monitor"):
        with granted.connect(granted.role(kind)) as conn:
            assert refused(conn, call), kind


# -- a real Celery worker and a real Celery publisher -------------------------------------


def test_a_celery_worker_runs_what_a_publisher_role_sends(granted: Roles, tmp_path: Path) -> None:
    environ = clean_env(
        PGQ_URL=granted.url(granted.worker),
        PGQ_SCHEMA=granted.schema,
        PGQ_AUTO_MIGRATE="false",
        PGQ_HEALTH_FILE=str(tmp_path / "hb"),
        PYTHONUNBUFFERED="1",
    )
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "fleet",
                "worker",
                "-Q",
                "default",
                "-P",
                "threads",
                "-c",
                "2",
                "-l",
                "info",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=EXAMPLES,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = Worker(proc, log, "least-privilege")
    try:
        wait_for(
            lambda: " ready." in worker.output() or proc.poll() is not None,
            60,
            "the worker to be ready",
        )
        assert proc.poll() is None, worker.output()
        client = publisher_app(granted, ["default"])
        first = client.send_task("fleet.add", args=[2, 3], priority=5).id
        with pg_transport.batch():
            batched = [client.send_task("fleet.add", args=[n, n]).id for n in range(3)]
        client.close()
        for task_id in (first, *batched):
            wait_for(
                lambda t=task_id: f"fleet.add[{t}] succeeded" in worker.output(),
                30,
                "the publisher's tasks to run as the worker role",
            )
    finally:
        worker.stop()
    with psycopg.connect(granted.pg_url) as admin:
        assert admin.execute(
            sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(granted.schema))
        ).fetchone() == (0,)


def test_a_role_granted_before_0018_gets_every_other_figure(granted: Roles) -> None:
    """A role whose grants predate migration 0018 (no EXECUTE on the counting functions)
    still runs `pgq status` and `pgq metrics`: the unique counts are null and the text
    says why; `pgq limit list` is refused naming the grant to add."""
    with granted.connect(granted.owner) as owner:
        owner.execute(
            sql.SQL(
                "REVOKE EXECUTE ON FUNCTION {s}.unique_counts(), {s}.flow_limit_states(text)"
                " FROM {r}"
            ).format(s=sql.Identifier(granted.schema), r=sql.Identifier(granted.monitor))
        )
    declared_by_the_worker(granted)
    status = cli(granted, granted.monitor, "status", "--json")
    assert status.exit_code == 0, status.output
    queues = json.loads(status.stdout)["queues"]
    assert queues and all(q["unique_queued"] is None for q in queues)
    text = cli(granted, granted.monitor, "status")
    assert "unique keys held: not counted" in text.stdout, text.output
    metrics = cli(granted, granted.monitor, "metrics")
    assert metrics.exit_code == 0, metrics.output
    assert "pgq_queue_ready_messages{" in metrics.stdout
    assert "pgq_queue_unique_queued_messages{" not in metrics.stdout
    listed = cli(granted, granted.monitor, "limit", "list")
    assert listed.exit_code == 1
    assert "EXECUTE on flow_limit_states(text)" in listed.stderr, listed.output
