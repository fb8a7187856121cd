"""docs/least-privilege.md, run with real roles: the owner migrates, workers move rows only.

The page's SQL blocks run as written — as the superuser and as the owner role, in the
page's order — with its role and schema names replaced by throwaway ones. Then a real
kombu round trip, the dead-letter commands and a real Celery worker run as the worker
role; the monitor role runs `pgq status` and `pgq metrics`; and neither can change the
schema.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from celery import Celery
from kombu import Connection
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pg_transport.connection import Connector
from pg_transport.vacuum import Vacuumer
from tests.acceptance.harness import Env, Worker, wait_for
from tests.integration.test_cli import clean_env, invoke, pgq_command
from tests.integration.test_docs import DOCS, sql_blocks
from tests.unit.test_compose import EXAMPLES

PAGE = DOCS / "least-privilege.md"


@dataclass(frozen=True)
class Roles:
    schema: str
    owner: str
    worker: str
    monitor: str
    pg_url: str

    def url(self, role: str) -> str:
        """A pgq:// URL for the test server as ``role`` (trust or the page's password)."""
        params = conninfo_to_dict(self.pg_url)
        host = params.get("host") or "127.0.0.1"
        port = params.get("port") or "5432"
        password = {self.owner: "owner-secret", self.worker: "worker-secret",
                    self.monitor: "monitor-secret"}[role]
        return f"pgq://{role}:{quote(password)}@{host}:{port}/{params.get('dbname', '')}"

    def connect(self, role: str) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(role).replace("pgq://", "postgresql://", 1),
                               autocommit=True)

    def substitute(self, text: str) -> str:
        names = {"pgq_owner": self.owner, "pgq_worker": self.worker,
                 "pgq_monitor": self.monitor, "pgq": self.schema}
        return re.sub(r"\b(pgq_owner|pgq_worker|pgq_monitor|pgq)\b",
                      lambda m: names[m.group(1)], text)


def page_sql() -> dict[str, str]:
    """The page's SQL blocks by their number (the first comment line: ``-- 1. …``)."""
    found = {}
    for block in sql_blocks(PAGE):
        match = re.match(r"-- (\d)\. .*, as (a superuser|pgq_owner)\n", block)
        assert match, f"SQL block without '-- N. …, as WHO': {block.splitlines()[0]}"
        found[match.group(1)] = block
    assert sorted(found) == ["1", "3", "4"]
    return found


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    made = Roles(f"pgq_t_priv_{tag}", f"pgq_t_owner_{tag}", f"pgq_t_worker_{tag}",
                 f"pgq_t_monitor_{tag}", pg_url)
    blocks = page_sql()
    with psycopg.connect(pg_url, autocommit=True) as admin:
        try:
            admin.execute(made.substitute(blocks["1"]))
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test role cannot create roles")
        try:
            yield made
        finally:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(made.schema)))
            for role in (made.worker, made.monitor, made.owner):
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def granted(roles: Roles) -> Roles:
    """Steps 2-4 of the page: migrate as the owner, then its GRANTs, as the owner."""
    migrated = subprocess.run(
        [*pgq_command(), "migrate", "--url", roles.url(roles.owner), "--schema", roles.schema],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )
    assert migrated.returncode == 0, migrated.stderr
    assert "applied" in migrated.stdout
    blocks = page_sql()
    with roles.connect(roles.owner) as owner:
        owner.execute(roles.substitute(blocks["3"]))
        owner.execute(roles.substitute(blocks["4"]))
    return roles


def cli(roles: Roles, role: str, *args: str) -> Any:
    return invoke(*args, "--url", roles.url(role), "--schema", roles.schema)


def test_worker_role_round_trips_and_handles_dead_letters(granted: Roles) -> None:
    options = {"schema": granted.schema, "auto_migrate": False}
    with Connection(granted.url(granted.worker), transport_options=options) as conn:
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


def test_worker_role_cannot_change_the_schema(granted: Roles) -> None:
    s = sql.Identifier(granted.schema)
    attempts = [
        sql.SQL("DROP TABLE {}.message").format(s),
        sql.SQL("ALTER TABLE {}.message ADD COLUMN evil integer").format(s),
        sql.SQL("TRUNCATE {}.message").format(s),
        sql.SQL("CREATE TABLE {}.evil (id integer)").format(s),
        sql.SQL("DROP SCHEMA {} CASCADE").format(s),
        sql.SQL("CREATE INDEX evil_idx ON {}.message (payload)").format(s),
    ]
    with granted.connect(granted.worker) as conn:
        for statement in attempts:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    with granted.connect(granted.owner) as owner:
        row = owner.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s",
            [granted.schema],
        ).fetchone()
    assert row is not None and row[0] >= 4  # all still there


def test_worker_role_cannot_migrate_and_says_who_can(granted: Roles, pg_url: str) -> None:
    s = sql.Identifier(granted.schema)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        # As if this pgq were one migration ahead of the database.
        (last,) = admin.execute(
            sql.SQL("DELETE FROM {}.schema_version WHERE version = "
                    "(SELECT max(version) FROM {}.schema_version) RETURNING version").format(s, s)
        ).fetchone() or (None,)
        try:
            result = cli(granted, granted.worker, "migrate")
            assert result.exit_code == 1
            assert (f"role {granted.worker!r} cannot create or upgrade the pgq schema"
                    in result.stderr)
            assert f"run `pgq migrate` as {granted.owner!r}" in result.stderr
        finally:
            admin.execute(sql.SQL("INSERT INTO {}.schema_version (version) VALUES (%s)")
                          .format(s), [last])


def test_only_the_owner_vacuums_as_the_page_says(granted: Roles) -> None:
    vacuum = re.search(r'-c "(VACUUM [^"]+)"', PAGE.read_text())
    assert vacuum, "the page's scheduled VACUUM"
    for role, allowed in ((granted.worker, False), (granted.owner, True)):
        connector = Connector(granted.url(role).replace("pgq://", "postgresql://", 1))
        try:
            assert Vacuumer(connector, granted.schema, threshold=0).check() is allowed, role
        finally:
            connector.close()
    with granted.connect(granted.owner) as owner:
        owner.execute(granted.substitute(vacuum.group(1)))  # the cron line runs as written


def test_tables_of_a_later_migration_are_usable_without_granting_again(granted: Roles) -> None:
    s = sql.Identifier(granted.schema)
    with granted.connect(granted.owner) as owner:
        owner.execute(sql.SQL("CREATE TABLE {}.later (id integer)").format(s))
    with granted.connect(granted.worker) as worker:
        worker.execute(sql.SQL("INSERT INTO {}.later VALUES (1)").format(s))
    with granted.connect(granted.monitor) as monitor:
        assert monitor.execute(sql.SQL("SELECT id FROM {}.later").format(s)).fetchall() == [(1,)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            monitor.execute(sql.SQL("INSERT INTO {}.later VALUES (2)").format(s))


def test_monitor_role_reads_figures_and_writes_nothing(granted: Roles) -> None:
    for args in (("status", "--json"), ("metrics",), ("dead", "list")):
        result = cli(granted, granted.monitor, *args)
        assert result.exit_code == 0, f"{args}: {result.output}"
    result = cli(granted, granted.monitor, "purge", "jobs")
    assert result.exit_code == 1
    assert "permission denied for table message" in result.stderr


def test_a_celery_worker_runs_as_the_worker_role(granted: Roles, tmp_path: Path) -> None:
    env = Env(granted.pg_url, granted.schema)
    environ = clean_env(
        PGQ_URL=granted.url(granted.worker), PGQ_SCHEMA=granted.schema,
        PGQ_AUTO_MIGRATE="false", PGQ_HEALTH_FILE=str(tmp_path / "hb"), PYTHONUNBUFFERED="1",
    )
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fleet", "worker", "-Q", "default",
             "-P", "threads", "-c", "2", "-l", "info", "--without-gossip", "--without-mingle",
             "--without-heartbeat"],
            cwd=EXAMPLES, env=environ, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = Worker(proc, log, "least-privilege")
    try:
        wait_for(lambda: " ready." in worker.output() or proc.poll() is not None, 60,
                 "the worker to be ready")
        assert proc.poll() is None, worker.output()
        client = Celery("client", broker=granted.url(granted.worker))
        client.conf.broker_transport_options = {"schema": granted.schema, "auto_migrate": False}
        task_id = client.send_task("fleet.add", args=[2, 3], queue="default").id
        wait_for(lambda: f"fleet.add[{task_id}] succeeded" in worker.output(), 30,
                 "the task to run as the worker role")
    finally:
        worker.stop()
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0
