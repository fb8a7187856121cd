"""Exactly-once effects (docs/exactly-once.md): an atomic task's writes, the end of its
delivery, its result and its follow-up tasks commit together, under real workers, real
SIGKILLs and real terminated sessions.

A task of tests/acceptance/atomic_app.py bumps ``counter`` and inserts an ``audit`` row
in its run's transaction; what a test must see while the run is open it writes on a
connection of its own (``points``), and it waits at a gate (``gates``) the test opens.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.harness import Env, start_worker, wait_for, workers
from tests.integration.test_privileges import grant, page_roles, publisher_app
from tests.pg import metered_database

APP = "tests.acceptance.atomic_app"
VT = 2.0
QUICK = {"PGQ_POLLING_INTERVAL": "0.2", "PGQ_VISIBILITY_TIMEOUT": str(VT)}

# Prefork workers whose children each keep a run session (and, for SQLAlchemy and Django, a
# pool or connection of the application's): 16-21 sessions seen in a parallel run.
pytestmark = [pytest.mark.timeout(300), pytest.mark.sessions(24)]


@pytest.fixture
def env(env: Env) -> Env:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        for ddl in (
            "CREATE TABLE {schema}.counter (id int PRIMARY KEY, n int NOT NULL)",
            "INSERT INTO {schema}.counter VALUES (1, 0)",
            "CREATE TABLE {schema}.audit (task_id text NOT NULL, label text NOT NULL)",
            "CREATE TABLE {schema}.points (task_id text, point text, pid int,"
            " at timestamptz DEFAULT clock_timestamp())",
            "CREATE TABLE {schema}.gates (label text PRIMARY KEY)",
        ):
            conn.execute(sql.SQL(ddl).format(schema=sql.Identifier(env.schema)))
    return env


def client(env: Env) -> Any:
    app = env.client(result_backend=env.broker_url)
    return app


def send(env: Env, **kwargs: Any) -> str:
    app = client(env)
    result = app.send_task("tests.acceptance.atomic_app.bump", kwargs=kwargs)
    app.close()
    return str(result.id)


def open_gate(env: Env, label: str) -> None:
    env.scalar("INSERT INTO {schema}.gates VALUES (%s) RETURNING 1", label)


def counts(env: Env) -> tuple[int, int]:
    return (
        int(env.scalar("SELECT n FROM {schema}.counter WHERE id = 1")),
        int(env.scalar("SELECT count(*) FROM {schema}.audit")),
    )


def points(env: Env, task_id: str, point: str) -> int:
    return int(
        env.scalar(
            "SELECT count(*) FROM {schema}.points WHERE task_id = %s AND point = %s",
            task_id,
            point,
        )
    )


def result_state(env: Env, task_id: str) -> str | None:
    found = env.scalar("SELECT status FROM {schema}.result WHERE task_id = %s", task_id)
    return str(found) if found is not None else None


def messages(env: Env) -> int:
    return int(env.scalar("SELECT count(*) FROM {schema}.message WHERE queue = 'celery'"))


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


@pytest.fixture(params=["threads", "prefork"])
def pool(request: pytest.FixtureRequest) -> str:
    return str(request.param)


#: The (pool, provider) pairs each failure semantic runs under: pgq's own connection
#: under both pools, and each application connection (a psycopg ``Connection``, a
#: SQLAlchemy ``sessionmaker``, Django's connection) under prefork, the pool whose
#: child is killed apart from the worker. The pool is not what these tests are about
#: for the application's providers: one pool each keeps the file's run time down.
RUNS = [
    ("threads", "own"),
    ("prefork", "own"),
    ("prefork", "psycopg"),
    ("prefork", "sqlalchemy"),
    ("prefork", "django"),
]


@pytest.fixture(params=RUNS, ids=[f"{pool}-{provider}" for pool, provider in RUNS])
def run(request: pytest.FixtureRequest) -> tuple[str, str]:
    pool, provider = request.param
    return str(pool), str(provider)


def start(env: Env, name: str, pool: str, provider: str = "own", **environ: str) -> Any:
    return start_worker(
        env,
        name,
        pool=pool,
        concurrency=2,
        app=APP,
        environ={**QUICK, "TEST_ATOMIC_PROVIDER": provider, **environ},
    )


@pytest.fixture
def stopped() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for worker in started:
        worker.kill()


# -- success ------------------------------------------------------------------------
@pytest.mark.parametrize("provider", ["own", "psycopg", "sqlalchemy", "django"])
def test_a_run_commits_its_writes_result_follow_up_and_end_once(
    env: Env, pool: str, provider: str
) -> None:
    with workers(
        env,
        "a",
        pool=pool,
        concurrency=2,
        app=APP,
        environ={**QUICK, "TEST_ATOMIC_PROVIDER": provider},
    ) as (worker,):
        ids = [send(env, label=f"t{i}", follow=True) for i in range(6)]
        wait_for(lambda: all(result_state(env, t) == "SUCCESS" for t in ids), 60, "six results")
        wait_for(lambda: messages(env) == 0, 30, "every message gone (the follow-ups ran)")
        assert counts(env) == (6, 6)
        # Each follow-up ran once: enqueued at its run's commit, exactly once.
        assert (
            int(env.scalar("SELECT count(*) FROM {schema}.points WHERE point LIKE 'note:%%'")) == 6
        )
        log = worker.output()
    # No atomic delivery's renewal or ack is taken for a lapsed lease: its commit ended
    # it (the plain follow-ups' renewals may race their acks as before).
    refused = [line for line in log.splitlines() if "refused" in line]
    assert not [line for line in refused if any(t in line for t in ids)], refused
    assert env.scalar("SELECT count(*) FROM {schema}.dead_letter") == 0


def test_a_raise_rolls_the_writes_back_and_records_the_failure_once(
    env: Env, run: tuple[str, str]
) -> None:
    pool, provider = run
    environ = {**QUICK, "TEST_ATOMIC_PROVIDER": provider}
    with workers(env, "a", pool=pool, concurrency=2, app=APP, environ=environ):
        tid = send(env, label="boom", fail=True, follow=True)
        wait_for(lambda: result_state(env, tid) == "FAILURE", 60, "the failure stored")
        wait_for(lambda: messages(env) == 0, 30, "the message gone")
        assert counts(env) == (0, 0)
        # The follow-up published before the raise was rolled back with the body.
        assert points(env, tid, "written") == 1
        assert (
            int(env.scalar("SELECT count(*) FROM {schema}.points WHERE point LIKE 'note:%%'")) == 0
        )


def test_retry_rolls_back_the_first_run_and_commits_the_retry_with_its_end(
    env: Env, run: tuple[str, str]
) -> None:
    pool, provider = run
    environ = {**QUICK, "TEST_ATOMIC_PROVIDER": provider}
    with workers(env, "a", pool=pool, concurrency=2, app=APP, environ=environ):
        tid = send(env, label="again", retry=True)
        wait_for(lambda: result_state(env, tid) == "SUCCESS", 60, "the retry's success")
        wait_for(lambda: messages(env) == 0, 30, "the messages gone")
        assert points(env, tid, "written") == 2  # the body ran twice
        assert counts(env) == (1, 1)  # its first run's writes were rolled back


# -- crashes ------------------------------------------------------------------------
def test_a_kill_before_the_commit_leaves_nothing_and_the_message_comes_back(
    env: Env, run: tuple[str, str], stopped: list[Any]
) -> None:
    """SIGKILL of the process running the body (the prefork child; the threads
    worker itself) after its writes, before its commit."""
    pool, provider = run
    worker = start(env, "a", pool, provider)
    stopped.append(worker)
    tid = send(env, label="k", gate="hold", follow=True)
    wait_for(lambda: points(env, tid, "written") == 1, 60, "the body's writes")
    if pool == "prefork":
        (child,) = [
            p
            for p in child_pids(worker.proc.pid)
            if int(env.scalar("SELECT count(*) FROM {schema}.points WHERE pid = %s", p))
        ]
        import os

        os.kill(child, signal.SIGKILL)
    else:
        worker.kill()
    # Nothing of the run is visible: no write, no result, no follow-up message.
    assert counts(env) == (0, 0)
    assert result_state(env, tid) is None
    assert messages(env) == 1
    if pool != "prefork":
        stopped.append(start(env, "b", pool, provider))
    # The message comes back (the prefork parent settles it at once; a dead worker's
    # lease lapses after vt) and its redelivery commits once.
    wait_for(lambda: result_state(env, tid) == "SUCCESS", 60, "the redelivery's success")
    wait_for(lambda: messages(env) == 0, 30, "the follow-up run")
    assert counts(env) == (1, 1)
    assert points(env, tid, "written") == 2
    assert int(env.scalar("SELECT count(*) FROM {schema}.points WHERE point LIKE 'note:%%'")) == 1


def test_a_kill_after_the_commit_never_delivers_the_message_again(
    env: Env, run: tuple[str, str], stopped: list[Any]
) -> None:
    pool, provider = run
    worker = start(env, "a", pool, provider, TEST_BLOCK_AFTER_COMMIT="after")
    stopped.append(worker)
    tid = send(env, label="c")
    wait_for(lambda: points(env, tid, "committed") == 1, 60, "the commit")
    worker.kill()
    killed = time.monotonic()
    assert messages(env) == 0
    assert counts(env) == (1, 1)
    assert result_state(env, tid) == "SUCCESS"
    stopped.append(start(env, "b", pool, provider))
    # Nothing comes back: a lapsed lease would have made it visible within vt; three vt
    # from the kill, measured, bounds the wait.
    while time.monotonic() < killed + 3 * VT:
        assert points(env, tid, "written") == 1
        time.sleep(VT / 4)
    assert counts(env) == (1, 1)


def test_a_terminated_task_session_rolls_back_and_the_message_comes_back(
    env: Env, run: tuple[str, str], stopped: list[Any]
) -> None:
    pool, provider = run
    worker = start(env, "a", pool, provider)
    stopped.append(worker)
    tid = send(env, label="t", gate="hold")
    wait_for(lambda: points(env, tid, "written") == 1, 60, "the body's writes")
    with psycopg.connect(env.pg_url, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM"
            " (SELECT pid FROM pg_stat_activity WHERE (application_name LIKE 'pgq-atomic:%%'"
            " OR application_name LIKE 'test-atomic:%%')"
            " AND datname = current_database() AND state = 'idle in transaction') AS s"
        ).fetchone()
    assert row is not None and row[0] == 1
    open_gate(env, "hold")  # the first run goes on, and its commit fails
    wait_for(lambda: points(env, tid, "written") == 2, 60, "the redelivery")
    wait_for(lambda: result_state(env, tid) == "SUCCESS", 60, "the redelivery's success")
    wait_for(lambda: messages(env) == 0, 30, "the message gone")
    assert counts(env) == (1, 1)
    assert "connection was lost" in worker.output()


def test_a_stale_delivery_cannot_commit(env: Env, stopped: list[Any]) -> None:
    """Worker A's lease lapses while its body runs (its parent process stopped: no
    renewal lands); B runs the message and commits; A's commit is then refused
    (LeaseLost, logged) and nothing of its run is kept."""
    a = start(env, "a", "prefork")
    stopped.append(a)
    tid = send(env, label="s", gate="hold")
    wait_for(lambda: points(env, tid, "written") == 1, 60, "A's body")
    os_kill(a.proc.pid, signal.SIGSTOP)  # the parent only: its child runs on
    try:
        wait_for(
            lambda: env.scalar(
                "SELECT visible_at < now() FROM {schema}.message WHERE queue = 'celery'"
            ),
            30,
            "A's lease to lapse",
        )
        b = start(env, "b", "threads")
        stopped.append(b)
        # B's run waits for the counter row A's open transaction updated.
        wait_for(
            lambda: env.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND application_name LIKE 'pgq-atomic:%%' AND datname = current_database()"
            ),
            60,
            "B's run to wait on A's row lock",
        )
        assert messages(env) == 1  # B holds the message now (its lease, not A's)
        open_gate(env, "hold")  # A's run reaches its fence: refused, rolled back
        wait_for(lambda: result_state(env, tid) == "SUCCESS", 60, "B's success")
        wait_for(lambda: "lapsed and the message went to another" in a.output(), 60, "A refused")
    finally:
        os_kill(a.proc.pid, signal.SIGCONT)
    # Refused at its commit (the fence travels with it): one line says so.
    assert a.output().count("its commit was refused") == 1
    assert counts(env) == (1, 1)
    assert points(env, tid, "written") == 2  # both bodies ran; one committed
    wait_for(lambda: messages(env) == 0, 30, "the message gone")


def os_kill(pid: int, sig: int) -> None:
    import os

    os.kill(pid, sig)


# -- refusals -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("provider", "reason"),
    [
        ("autocommit", "autocommit mode"),
        ("serializable", "must be READ COMMITTED"),
    ],
)
def test_a_connection_it_cannot_run_on_dead_letters_with_the_reason(
    env: Env, provider: str, reason: str
) -> None:
    with workers(
        env, "a", pool="threads", app=APP, environ={**QUICK, "TEST_ATOMIC_PROVIDER": provider}
    ):
        tid = send(env, label="r")
        wait_for(
            lambda: env.scalar("SELECT reason FROM {schema}.dead_letter"), 60, "the dead letter"
        )
    assert reason in str(env.scalar("SELECT reason FROM {schema}.dead_letter"))
    assert counts(env) == (0, 0)
    assert points(env, tid, "written") == 0


def test_an_atomic_worker_on_gevent_runs_each_greenlet_in_a_transaction_of_its_own(
    env: Env,
) -> None:
    with workers(env, "g", pool="gevent", concurrency=4, app=APP, environ=QUICK):
        app = client(env)
        ids = [app.send_task(f"{APP}.part", args=[i], kwargs={"gate": "hold"}).id for i in range(3)]
        app.close()
        # Three runs open at once in one process: three sessions, each in its transaction.
        wait_for(
            lambda: (
                env.scalar("SELECT count(*) FROM {schema}.points WHERE point LIKE 'part%%'") == 3
            ),
            60,
            "three bodies running",
        )
        assert int(env.scalar("SELECT count(DISTINCT pid) FROM {schema}.points")) == 1
        assert (
            env.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE"
                " 'pgq-atomic:%%' AND datname = current_database()"
                " AND state = 'idle in transaction'"
            )
            == 3
        )
        assert int(env.scalar("SELECT count(*) FROM {schema}.audit")) == 0  # none committed
        open_gate(env, "hold")
        wait_for(lambda: all(result_state(env, t) == "SUCCESS" for t in ids), 60, "three results")
        wait_for(lambda: messages(env) == 0, 30, "every message gone")
        assert int(env.scalar("SELECT count(*) FROM {schema}.audit")) == 3


# -- chords and ordering ------------------------------------------------------------
def test_a_chord_of_atomic_parts_counts_each_part_once_through_a_kill(
    env: Env, stopped: list[Any]
) -> None:
    from celery import chord

    worker = start(env, "a", "prefork")
    stopped.append(worker)
    app = client(env)
    header = [app.signature(f"{APP}.part", args=[i]) for i in range(3)]
    header.append(app.signature(f"{APP}.part", args=[3], kwargs={"gate": "hold"}))
    chord(header, app=app)(app.signature(f"{APP}.collect", kwargs={"label": "sum"}))
    wait_for(
        lambda: (
            env.scalar("SELECT remaining FROM {schema}.barrier WHERE id LIKE 'celery-chord:%%'")
            == 1
        ),
        60,
        "three parts counted",
    )
    wait_for(
        lambda: env.scalar("SELECT count(*) FROM {schema}.points WHERE point = 'part3'"),
        60,
        "the last part's body",
    )
    worker.kill()  # inside the last part, before its commit
    assert env.scalar("SELECT remaining FROM {schema}.barrier WHERE id LIKE 'celery-chord:%%'") == 1
    stopped.append(start(env, "b", "prefork"))
    wait_for(
        lambda: env.scalar("SELECT count(*) FROM {schema}.points WHERE point LIKE 'sum:%%'"),
        60,
        "the chord's body",
    )
    wait_for(lambda: messages(env) == 0, 30, "every message gone")
    assert env.scalar("SELECT array_agg(point) FROM {schema}.points WHERE point LIKE 'sum:%%'") == [
        "sum:6"
    ]
    assert int(env.scalar("SELECT count(*) FROM {schema}.audit")) == 4  # each part once
    app.close()


def test_an_ordering_key_is_released_by_the_commit_and_kept_through_a_kill(
    env: Env, stopped: list[Any]
) -> None:
    worker = start(env, "a", "prefork")
    stopped.append(worker)
    app = client(env)
    first = app.send_task(
        f"{APP}.bump", kwargs={"label": "first", "gate": "hold"}, ordering_key="K"
    ).id
    second = app.send_task(f"{APP}.bump", kwargs={"label": "second"}, ordering_key="K").id
    app.close()
    wait_for(lambda: points(env, first, "written") == 1, 60, "the first body")
    worker.kill()  # before the first run's commit: the key stays held by it
    stopped.append(start(env, "b", "prefork"))
    wait_for(lambda: result_state(env, second) == "SUCCESS", 60, "the second task")
    assert result_state(env, first) == "SUCCESS"
    order = env.scalar(
        "SELECT array_agg(task_id ORDER BY at) FROM {schema}.points WHERE point = 'written'"
    )
    # The first ran (killed), ran again and committed; only then did the second start.
    assert order == [first, first, second]
    assert counts(env) == (2, 2)


# -- refusals at worker start -------------------------------------------------------
@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"TEST_ACKS_EARLY": "1"}, "has acks_late=False"),
        ({"PGQ_BROKER_URL": "memory://"}, "needs a pgq:// broker"),
    ],
)
def test_a_worker_whose_atomic_tasks_cannot_hold_does_not_start(
    env: Env, environ: dict[str, str], says: str
) -> None:
    extra = dict(environ)
    if "PGQ_BROKER_URL" in extra:
        extra["TEST_RESULT_BACKEND"] = env.broker_url
    worker = start_worker(env, "x", app=APP, environ={**QUICK, **extra}, may_exit=True, wait=False)
    assert worker.proc.wait(60) == 1
    assert "pgq: atomic task" in worker.output() and says in worker.output()


def test_a_foreign_result_backend_is_warned_about_at_start(env: Env) -> None:
    with workers(
        env, "w", app=APP, environ={**QUICK, "TEST_RESULT_BACKEND": "cache+memory://"}
    ) as (worker,):
        assert "results are stored at least once" in worker.output()


def test_a_connection_to_another_database_is_refused_naming_both(env: Env, pg_url: str) -> None:
    name = f"{env.schema}_other"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    metered_database(name)
    try:
        other = psycopg.conninfo.make_conninfo(pg_url, dbname=name)
        with workers(
            env,
            "a",
            pool="threads",
            app=APP,
            environ={**QUICK, "TEST_ATOMIC_PROVIDER": "other-database", "TEST_OTHER_URL": other},
        ):
            send(env, label="o")
            wait_for(
                lambda: env.scalar("SELECT reason FROM {schema}.dead_letter"),
                60,
                "the dead letter",
            )
        reason = str(env.scalar("SELECT reason FROM {schema}.dead_letter"))
        assert name in reason and env.pg_url.rsplit("/", 1)[1] in reason, reason
        assert counts(env) == (0, 0)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def test_leases_are_renewed_while_a_run_keeps_its_transaction_open(
    env: Env, stopped: list[Any]
) -> None:
    worker = start(env, "a", "threads")
    stopped.append(worker)
    tid = send(env, label="long", gate="hold")
    wait_for(lambda: points(env, tid, "written") == 1, 60, "the body's writes")
    opened = time.monotonic()
    # Three visibility timeouts with the transaction open: the lease is renewed, so no
    # other delivery starts (the worker's own claim would take a lapsed message back).
    while time.monotonic() < opened + 3 * VT:
        assert env.scalar("SELECT visible_at > now() FROM {schema}.message WHERE queue = 'celery'")
        time.sleep(VT / 4)
    assert points(env, tid, "written") == 1
    open_gate(env, "hold")
    wait_for(lambda: result_state(env, tid) == "SUCCESS", 60, "the success")
    assert counts(env) == (1, 1)
    assert points(env, tid, "written") == 1


def test_a_kept_connection_reaped_while_idle_is_replaced_not_refused(env: Env) -> None:
    with workers(env, "a", pool="threads", concurrency=1, app=APP, environ=QUICK):
        first = send(env, label="one")
        wait_for(lambda: result_state(env, first) == "SUCCESS", 60, "the first run")
        with psycopg.connect(env.pg_url, autocommit=True) as admin:
            row = admin.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM"
                " (SELECT pid FROM pg_stat_activity WHERE application_name LIKE"
                " 'pgq-atomic:%%' AND datname = current_database() AND state = 'idle') AS s"
            ).fetchone()
        assert row is not None and row[0] == 1
        second = send(env, label="two")
        wait_for(lambda: result_state(env, second) == "SUCCESS", 60, "the second run")
        wait_for(lambda: messages(env) == 0, 30, "the messages gone")
    assert counts(env) == (2, 2)
    assert env.scalar("SELECT count(*) FROM {schema}.dead_letter") == 0


def test_a_run_whose_role_may_not_end_its_delivery_is_dead_lettered_naming_the_grant(
    pg_url: str,
) -> None:
    """The run's connection logs in as docs/least-privilege.md's publisher role: it may
    publish, not end a delivery (DELETE on the message table). The run is refused as it
    opens, before the body, with ``NotPermitted`` naming the role and the grant, and the
    message dead-lettered with that reason (not Postgres's error at the fence)."""
    with page_roles(pg_url, blocks=("1",)) as made:
        roles = grant(made)
        env = Env(roles.pg_url, roles.schema)
        with workers(
            env,
            "a",
            pool="threads",
            concurrency=1,
            app=APP,
            environ={
                **QUICK,
                "PGQ_BROKER_URL": roles.url(roles.worker),
                "PGQ_AUTO_MIGRATE": "false",
                "TEST_ATOMIC_URL": roles.url(roles.publisher),
            },
        ) as (worker,):
            client = publisher_app(roles, ["celery"])
            client.send_task("tests.acceptance.atomic_app.bump", kwargs={"label": "p"})
            client.close()
            wait_for(
                lambda: env.scalar("SELECT count(*) FROM {schema}.dead_letter") == 1,
                60,
                "the refused run's message dead-lettered",
            )
            reason = str(env.scalar("SELECT reason FROM {schema}.dead_letter"))
            assert "refused: pgq cannot run an atomic task" in worker.output()
            assert roles.publisher in reason, reason
            assert "GRANT pgq_worker" in reason, reason
            assert "may not end a delivery" in reason, reason
            assert env.scalar("SELECT count(*) FROM {schema}.message WHERE queue = 'celery'") == 0
