"""Bad input at connect time: one clear error that names the problem (real Postgres).

Each case connects the way an app does, ``kombu.Connection(url, ...).connect()``,
and checks the type and the message: what is wrong, and about which host, database,
role, schema or variable.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from kombu import Connection
from kombu.exceptions import OperationalError as KombuOperationalError
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pg_transport.errors import (
    BrokerRefused,
    BrokerUnavailable,
    BrokerUnreachable,
    ConfigurationError,
    SchemaError,
)
from tests.acceptance.cluster import ClusterUnavailable, throwaway_cluster
from tests.pg import pgq_url


@pytest.fixture(autouse=True)
def _no_pgq_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's PGQ_* variables must not steer these tests."""
    for name in list(os.environ):
        if name.startswith("PGQ_") and name != "PGQ_TEST_URL":
            monkeypatch.delenv(name)


def connect(url: str, schema: str, **options: Any) -> None:
    """``Connection.connect()`` without kombu's fixed 2 s pause before its one retry."""
    with Connection(url, transport_options={"schema": schema, **options}) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, reraise_as_library_errors=False)


def schema_exists(pg_url: str, schema: str) -> bool:
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", [schema]).fetchone()
    return bool(row and row[0])


# -- the server cannot be reached, or refuses us ---------------------------------------


def test_unreachable_port_names_host_port_and_refusal(schema: str) -> None:
    with pytest.raises(BrokerUnavailable) as info:
        connect("pgq://postgres@127.0.0.1:1/test", schema)
    message = str(info.value)
    assert "127.0.0.1" in message
    assert "port 1 " in message
    assert "refused" in message
    assert "pgq://postgres@127.0.0.1:1/test" in message


def test_connect_raises_the_pgq_error_itself(schema: str) -> None:
    conn = Connection("pgq://postgres@127.0.0.1:1/test", transport_options={"schema": schema})
    try:
        with pytest.raises(BrokerUnavailable, match="refused"):
            conn.connect()
    finally:
        conn.release()


def test_unreachable_port_through_ensure_connection_keeps_the_message(schema: str) -> None:
    conn = Connection("pgq://postgres@127.0.0.1:1/test", transport_options={"schema": schema})
    try:
        with pytest.raises((BrokerUnavailable, KombuOperationalError)) as info:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
    finally:
        conn.release()
    assert "port 1 " in str(info.value)
    assert "refused" in str(info.value)


def test_missing_database_is_named(pg_url: str, schema: str) -> None:
    dbname = "pgq_no_such_db_" + uuid.uuid4().hex[:8]
    with pytest.raises(BrokerUnavailable) as info:
        connect(pgq_url(pg_url, dbname=dbname), schema)
    assert f'database "{dbname}" does not exist' in str(info.value)


def test_missing_role_is_named(pg_url: str, schema: str) -> None:
    role = "pgq_no_such_role_" + uuid.uuid4().hex[:8]
    with pytest.raises(BrokerUnavailable) as info:
        connect(pgq_url(pg_url, user=role, password=None), schema)
    assert f'role "{role}" does not exist' in str(info.value) or role in str(info.value)


def attempts_until_failure(url: str, schema: str) -> tuple[int, BaseException]:
    """How many times kombu tried before giving up (it allows three retries here)."""
    seen: list[BaseException] = []
    with Connection(url, transport_options={"schema": schema}) as conn:
        try:
            conn.ensure_connection(
                errback=lambda exc, interval: seen.append(exc),
                max_retries=3,
                interval_start=0,
                interval_step=0,
                reraise_as_library_errors=False,
            )
        except BaseException as exc:  # the final error is what the test inspects
            return len(seen) + 1, exc
    raise AssertionError("connected to a server that should not accept us")


def test_a_refusal_is_not_retried(pg_url: str, schema: str) -> None:
    dbname = "pgq_no_such_db_" + uuid.uuid4().hex[:8]
    tries, error = attempts_until_failure(pgq_url(pg_url, dbname=dbname), schema)
    assert isinstance(error, BrokerRefused)
    assert tries == 1  # the same URL would be refused the same way


def test_an_unreachable_server_is_retried(schema: str) -> None:
    tries, error = attempts_until_failure("pgq://postgres@127.0.0.1:1/test", schema)
    assert isinstance(error, BrokerUnreachable)
    assert tries == 4  # the first attempt and three retries


# -- wrong password: a throwaway cluster that checks passwords ---------------------


@dataclass(frozen=True)
class ScramCluster:
    port: int
    user: str
    password: str

    def url(self, password: str | None) -> str:
        auth = self.user if password is None else f"{self.user}:{quote(password, safe='')}"
        return f"pgq://{auth}@127.0.0.1:{self.port}/postgres"


@pytest.fixture(scope="module")
def scram_cluster() -> Iterator[ScramCluster]:
    password = "right-" + secrets.token_hex(8)
    with ExitStack() as stack:
        try:
            cluster = stack.enter_context(throwaway_cluster(password=password))
        except ClusterUnavailable as exc:
            pytest.skip(f"no password-checking cluster here: {exc}")
        yield ScramCluster(port=cluster.port, user="postgres", password=password)


@pytest.fixture
def no_libpq_password(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No password from PGPASSWORD or a ~/.pgpass may rescue a wrong one."""
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-pgpass"))


@pytest.mark.usefixtures("no_libpq_password")
def test_wrong_password_says_authentication_failed_without_the_password(
    scram_cluster: ScramCluster, schema: str
) -> None:
    wrong = "Wr0ng-p@ss:" + secrets.token_hex(4)
    with pytest.raises(BrokerUnavailable) as info:
        connect(scram_cluster.url(wrong), schema)
    message = str(info.value)
    assert 'password authentication failed for user "postgres"' in message
    assert f"127.0.0.1:{scram_cluster.port}" in message
    assert wrong not in message
    assert quote(wrong, safe="") not in message
    assert wrong.split(":")[1] not in message


@pytest.mark.usefixtures("no_libpq_password")
def test_missing_password_says_none_was_supplied(scram_cluster: ScramCluster, schema: str) -> None:
    with pytest.raises(BrokerUnavailable) as info:
        connect(scram_cluster.url(None), schema)
    assert "no password supplied" in str(info.value)


@pytest.mark.usefixtures("no_libpq_password")
def test_right_password_connects_to_the_throwaway_cluster(
    scram_cluster: ScramCluster, schema: str
) -> None:
    """The control: the cluster is up and checks passwords, it does not refuse everything."""
    connect(scram_cluster.url(scram_cluster.password), schema)
    with psycopg.connect(
        host="127.0.0.1",
        port=scram_cluster.port,
        user="postgres",
        password=scram_cluster.password,
        dbname="postgres",
    ) as conn:
        row = conn.execute("SELECT to_regclass(%s)", [f"{schema}.message"]).fetchone()
    assert row is not None and row[0] is not None


# -- bad configuration in the environment --------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("PGQ_VISIBILITY_TIMEOUT", "abc", "not a number"),
        ("PGQ_VISIBILITY_TIMEOUT", "-1", "must be > 0"),
        ("PGQ_VISIBILITY_TIMEOUT_CELERY", "-1", "must be > 0"),
        ("PGQ_VISIBILITY_TIMEOUT_CELERY", "abc", "not a number"),
        ("PGQ_MAX_ATTEMPTS", "0", "must be >= 1"),
        ("PGQ_USE_NOTIFY", "perhaps", "not a boolean"),
    ],
)
def test_bad_environment_is_refused_at_transport_creation(
    monkeypatch: pytest.MonkeyPatch,
    broker_url: str,
    pg_url: str,
    schema: str,
    name: str,
    value: str,
    problem: str,
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as info:
        connect(broker_url, schema)
    message = str(info.value)
    assert name in message
    assert value in message
    assert problem in message
    assert not schema_exists(pg_url, schema), "refused before touching the database"


def test_bad_transport_option_is_refused_at_transport_creation(
    broker_url: str, pg_url: str, schema: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        connect(broker_url, schema, visibility_timeout=-5)
    assert "visibility_timeout=-5" in str(info.value)
    assert not schema_exists(pg_url, schema)


def test_malformed_url_is_refused_at_transport_creation(schema: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        connect("pgq://u:hunter2@127.0.0.1:notaport/test", schema)
    assert "the port is not a number between 1 and 65535" in str(info.value)
    assert "hunter2" not in str(info.value)


# -- a schema we may not write to -------------------------------------------------


@dataclass(frozen=True)
class Role:
    name: str
    url: str


@pytest.fixture
def admin(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def role(pg_url: str, admin: psycopg.Connection[Any], schema: str) -> Iterator[Role]:
    """A login role with no rights on anything pgq owns; dropped afterwards."""
    name = "pgq_role_" + uuid.uuid4().hex[:10]
    password = secrets.token_hex(8)
    admin.execute(
        sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(name), sql.Literal(password)
        )
    )
    try:
        yield Role(name, pgq_url(pg_url, user=name, password=password))
    finally:
        # The schema goes first (its fixture drops it too, harmlessly), then whatever
        # the role owns or was granted, then the role.
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def create_schema(admin: psycopg.Connection[Any], schema: str) -> str:
    """Create ``schema`` as the test's superuser; that role's name (the schema's owner)."""
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    row = admin.execute("SELECT current_user").fetchone()
    assert row is not None
    return str(row[0])


def migrate_as_owner(broker_url: str, schema: str) -> None:
    connect(broker_url, schema)


def test_foreign_schema_with_auto_migrate_names_role_schema_and_remedy(
    admin: psycopg.Connection[Any], role: Role, schema: str
) -> None:
    owner = create_schema(admin, schema)
    with pytest.raises(SchemaError) as info:
        connect(role.url, schema)
    message = str(info.value)
    assert repr(role.name) in message
    assert repr(schema) in message
    # The schema exists: the remedy names its owner, not CREATE on the database.
    assert f"belongs to {owner!r}: run `pgq migrate` as {owner!r}" in message
    assert f"GRANT USAGE, CREATE ON SCHEMA {schema} TO {role.name}" in message


def test_foreign_schema_when_role_may_create_schemas(
    admin: psycopg.Connection[Any], role: Role, schema: str, pg_url: str
) -> None:
    """CREATE on the database gets past CREATE SCHEMA; the tables still fail."""
    dbname = conninfo_to_dict(pg_url).get("dbname") or role.name
    admin.execute(
        sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            sql.Identifier(str(dbname)), sql.Identifier(role.name)
        )
    )
    owner = create_schema(admin, schema)
    with pytest.raises(SchemaError) as info:
        connect(role.url, schema)
    message = str(info.value)
    assert repr(role.name) in message
    assert repr(schema) in message
    assert f"permission denied for schema {schema}" in message
    assert f"belongs to {owner!r}" in message


def test_migrated_schema_without_usage_names_role_schema_and_grant(
    admin: psycopg.Connection[Any], role: Role, schema: str, broker_url: str
) -> None:
    migrate_as_owner(broker_url, schema)
    with pytest.raises(SchemaError) as info:
        connect(role.url, schema)
    message = str(info.value)
    assert repr(role.name) in message
    assert repr(schema) in message
    assert f"permission denied for schema {schema}" in message
    assert "Grant USAGE" in message


def test_migrated_schema_without_usage_and_auto_migrate_off(
    admin: psycopg.Connection[Any], role: Role, schema: str, broker_url: str
) -> None:
    migrate_as_owner(broker_url, schema)
    with pytest.raises(SchemaError) as info:
        connect(role.url, schema, auto_migrate=False)
    assert repr(role.name) in str(info.value)
    assert f"permission denied for schema {schema}" in str(info.value)


def test_usage_without_table_rights_names_the_table(
    admin: psycopg.Connection[Any], role: Role, schema: str, broker_url: str
) -> None:
    migrate_as_owner(broker_url, schema)
    admin.execute(
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.Identifier(schema), sql.Identifier(role.name)
        )
    )
    with pytest.raises(SchemaError) as info:
        connect(role.url, schema)
    assert repr(role.name) in str(info.value)
    assert "permission denied for table schema_version" in str(info.value)


def test_missing_schema_with_auto_migrate_off_says_run_migrate(
    broker_url: str, schema: str, pg_url: str
) -> None:
    with pytest.raises(SchemaError) as info:
        connect(broker_url, schema, auto_migrate=False)
    message = str(info.value)
    assert repr(schema) in message
    assert "does not exist" in message
    assert "pgq migrate" in message
    assert not schema_exists(pg_url, schema)


def test_granted_role_connects(
    admin: psycopg.Connection[Any], role: Role, schema: str, broker_url: str
) -> None:
    """The control for the cases above: with the grants the hint names, it works."""
    migrate_as_owner(broker_url, schema)
    ident = {"s": sql.Identifier(schema), "r": sql.Identifier(role.name)}
    admin.execute(sql.SQL("GRANT USAGE ON SCHEMA {s} TO {r}").format(**ident))
    admin.execute(
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {r}").format(
            **ident
        )
    )
    with Connection(role.url, transport_options={"schema": schema}) as conn:
        queue = conn.SimpleQueue("granted")
        queue.put({"ok": True})
        message = queue.get_nowait()
        assert message.payload == {"ok": True}
        message.ack()
        assert queue.qsize() == 0
        queue.close()


# -- a message pgq cannot store: refused by name, nothing stored --------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"expiration": 1e300}, "expiration"),
        ({"expiration": 10**400}, "expiration"),
        ({"priority": float("nan")}, "priority"),
        ({"priority": float("inf")}, "priority"),
        ({"headers": {"deadline": float("nan")}}, "headers.deadline"),
        ({"headers": {"limits": [1.0, float("-inf")]}}, r"headers.limits\[1\]"),
    ],
    ids=[
        "huge-expiration",
        "int-expiration",
        "nan-priority",
        "inf-priority",
        "nan-header",
        "inf-in-a-list",
    ],
)
@pytest.mark.parametrize("exchange", ["", "routed"])
def test_a_value_postgres_cannot_hold_is_refused_naming_the_field(
    pg_url: str, schema: str, options: dict[str, Any], field: str, exchange: str
) -> None:
    from kombu import Exchange, Producer, Queue

    from pg_transport.errors import InvalidMessage

    with Connection(pgq_url(pg_url), transport_options={"schema": schema}) as conn:
        channel = conn.channel()
        target = Exchange(exchange, type="direct") if exchange else Exchange("")
        queue = Queue("jobs", target, routing_key="jobs").bind(channel)
        queue.declare()
        producer = Producer(channel, exchange=target)
        with pytest.raises(InvalidMessage, match=f"message (property|field) {field} is "):
            producer.publish({"n": 1}, routing_key="jobs", **options)
        # Nothing stored, and the channel publishes on.
        assert queue.queue_declare(passive=True).message_count == 0
        producer.publish({"n": 2}, routing_key="jobs")
        assert queue.queue_declare(passive=True).message_count == 1
