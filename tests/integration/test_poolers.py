"""Behind PgBouncer: transaction pooling is recognised, and works with use_notify=false.

With notifications on, pgq needs sessions of its own (LISTEN, prepared statements, the
pinned search_path). Through a transaction pooler it refuses at connect with one error
naming ``use_notify=false``: PgBouncer refuses the startup option that pins search_path,
or (``ignore_startup_parameters = options``) accepts it and drops it. Should a pooler
pass that on, the first prepared statement found missing (or present twice) gives the
same error.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from kombu import Connection

from pg_transport.db.pool import Connector
from pg_transport.db.wire import Statement
from pg_transport.errors import PoolerDetected
from pg_transport.sql import load_queries
from pg_transport.store import claim_params
from tests.bouncer import Bouncer, BouncerUnavailable, pgbouncer
from tests.integration.conftest import Peek


def bouncer_or_skip(pg_url: str, **settings: object) -> Iterator[Bouncer]:
    try:
        with pgbouncer(pg_url, **settings) as bouncer:  # type: ignore[arg-type]
            yield bouncer
    except BouncerUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def bouncer(pg_url: str) -> Iterator[Bouncer]:
    yield from bouncer_or_skip(pg_url, pool_size=2)


@pytest.fixture
def lenient_bouncer(pg_url: str) -> Iterator[Bouncer]:
    """Accepts the ``options`` startup parameter, and drops it."""
    yield from bouncer_or_skip(pg_url, ignore_startup_parameters="extra_float_digits,options")


@pytest.fixture
def rows(pg_url: str, schema: str, broker_url: str) -> Iterator[Peek]:
    with Connection(broker_url, transport_options={"schema": schema}) as c:
        c.connect()  # the schema, created on Postgres directly (as pgq migrate would)
    p = Peek(pg_url, schema)
    yield p
    p.conn.close()


def assert_names_the_setting(exc: BaseException) -> None:
    text = str(exc)
    assert "use_notify=false" in text and "transaction" in text, text


@pytest.mark.parametrize("which", ["bouncer", "lenient_bouncer"])
def test_notifications_on_through_a_transaction_pooler_are_refused_naming_use_notify(
    which: str, schema: str, rows: Peek, request: pytest.FixtureRequest
) -> None:
    bouncer: Bouncer = request.getfixturevalue(which)
    with Connection(
        bouncer.url("pgq"), transport_options={"schema": schema}, connect_timeout=5
    ) as conn:
        with pytest.raises(PoolerDetected) as connecting:
            conn.connect()
        assert_names_the_setting(connecting.value)
        with pytest.raises(PoolerDetected) as publishing:
            conn.SimpleQueue("q").put({"n": 1})
        assert_names_the_setting(publishing.value)
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_a_prepared_statement_missing_on_a_pooled_session_names_use_notify(
    bouncer: Bouncer, pg_url: str
) -> None:
    # A pooler that let pgq's session settings through: the first symptom is a prepared
    # statement that is not on the server session the next statement lands on.
    connector = Connector(bouncer.url(), prepare_threshold=0, pin_search_path=False, max_idle=1)
    holder = psycopg.connect(bouncer.url(), autocommit=True)
    try:
        with connector.connection() as conn:
            conn.execute("SELECT 1 + %s", [1])  # prepared, on the server session it ran on
        # Another client takes that server session (PgBouncer hands out the most
        # recently used one) and keeps it in a transaction.
        holder.execute("BEGIN")
        holder.execute("SELECT 1")
        with pytest.raises(PoolerDetected) as found, connector.connection() as conn:
            conn.execute("SELECT 1 + %s", [1])
        assert_names_the_setting(found.value)
        assert "does not exist" in str(found.value)
    finally:
        holder.close()
        connector.close()


def test_with_use_notify_off_each_message_goes_through_the_pooler_exactly_once(
    bouncer: Bouncer, schema: str, rows: Peek
) -> None:
    """Two server sessions for a producer and a consumer working at once: nothing
    prepared or set on one session is looked for on another."""
    options = {"schema": schema, "use_notify": False, "polling_interval": 0.05}
    total = 200
    got: list[int] = []
    with Connection(bouncer.url("pgq"), transport_options=options) as consumer_conn:
        queue = consumer_conn.SimpleQueue("pooled")

        def produce() -> None:
            with Connection(bouncer.url("pgq"), transport_options=options) as producer_conn:
                out = producer_conn.SimpleQueue("pooled")
                for n in range(total):
                    out.put({"n": n})
                out.close()

        producer = threading.Thread(target=produce)
        producer.start()
        while len(got) < total:
            message = queue.get(timeout=20)
            got.append(message.payload["n"])
            message.ack()
        producer.join(20)
        queue.close()
    assert sorted(got) == list(range(total))
    assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]


def test_a_barrier_dispatched_through_the_pooler_with_use_notify_off(
    bouncer: Bouncer, schema: str, rows: Peek
) -> None:
    # The barrier's own connections follow use_notify as the transport's do: nothing
    # pinned at connect, nothing prepared, on sessions the pooler shares.
    from celery import Celery

    from barrier import Barrier

    app = Celery("pooled", broker=bouncer.url("pgq"), set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema, "use_notify": False}
    parts = [app.signature("t.part", args=[n]) for n in range(8)]
    for n in range(6):  # past psycopg's prepare threshold, on two server sessions
        Barrier(app).dispatch(f"b{n}", parts, app.signature("t.collect"))
    assert rows("SELECT count(*) FROM {schema}.barrier WHERE status = 'armed'") == [(6,)]
    assert rows("SELECT count(*) FROM {schema}.message") == [(48,)]


def test_results_stored_and_read_through_the_pooler_with_use_notify_off(
    bouncer: Bouncer, schema: str, rows: Peek
) -> None:
    # The result backend's connections follow its use_notify as the transport's do:
    # nothing pinned, nothing prepared, so a pooler's shared sessions serve them, and
    # waiting is the batched poll.
    from celery import Celery

    app = Celery(
        "pooled-results",
        broker=bouncer.url("pgq"),
        backend=bouncer.url("pgq"),
        set_as_current=False,
    )
    app.conf.broker_transport_options = {"schema": schema, "use_notify": False}
    app.conf.result_backend_transport_options = {
        "schema": schema,
        "use_notify": False,
        "polling_interval": 0.05,
    }
    backend = app.backend
    for n in range(12):  # past psycopg's prepare threshold, on two server sessions
        backend.mark_as_done(f"task-{n}", {"n": n})
    assert [app.AsyncResult(f"task-{n}").get(timeout=10) for n in range(12)] == [
        {"n": n} for n in range(12)
    ]
    assert rows("SELECT count(*) FROM {schema}.result") == [(12,)]


@pytest.mark.parametrize("relax", [None, "off", "auto"])
def test_a_claim_through_the_pooler_relaxes_its_own_commit_and_sets_nothing_after(
    relax: str | None, pg_url: str, schema: str, rows: Peek
) -> None:
    """No session setting lasts behind a transaction pooler: the claim itself relaxes the
    commit of its transaction, as durable_acks relaxes the consumer's own session on
    Postgres directly ('auto': unless the server has synchronous standbys), and the
    server session the pooler hands to the next client keeps its own setting."""
    standbys = rows("SELECT pg_catalog.current_setting('synchronous_standby_names')")[0][0]
    expected = {None: None, "off": "off", "auto": None if standbys else "off"}[relax]
    statement = Statement("claim", load_queries(schema)["claim"])
    params = claim_params(["relaxed"], [30.0], 4, None, [], relax=relax)
    for bouncer in bouncer_or_skip(pg_url, pool_size=1):  # one server session: the same
        with psycopg.connect(bouncer.url(), autocommit=True) as conn:
            before = conn.execute("SHOW synchronous_commit").fetchone()
            conn.execute("BEGIN")
            statement.execute(conn, params, prepare=False)
            inside = conn.execute("SHOW synchronous_commit").fetchone()
            conn.execute("COMMIT")
            after = conn.execute("SHOW synchronous_commit").fetchone()
    assert before is not None and inside is not None
    assert inside[0] == (expected or before[0])
    assert after == before


@pytest.mark.parametrize(
    ("options", "relax"),
    [
        ({"use_notify": False}, "auto"),
        ({"use_notify": False, "durable_acks": "off"}, "off"),
        ({"use_notify": False, "durable_acks": "on"}, None),
        ({}, None),  # on Postgres directly the session itself is relaxed
    ],
)
def test_the_consumer_claims_relaxed_behind_a_pooler_as_durable_acks_says(
    options: dict[str, object], relax: str | None, schema: str, broker_url: str
) -> None:
    with Connection(broker_url, transport_options={"schema": schema, **options}) as conn:
        assert conn.transport.engine.session.relax == relax
