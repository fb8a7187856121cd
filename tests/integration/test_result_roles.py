"""docs/results.md's Roles, run with real roles: a publisher reads the results whose ids it
holds, through ``result_read``, and can neither list other tasks' ids nor write a result
or a chord's part.

A role that could list the results could learn a chord's header ids and group id and
publish a part of that chord under one of them: a worker would run it and count it, and
the chord's body would get the forged value (a SUCCESS is never replaced). The roles and
blocks are those of docs/least-privilege.md (tests/integration/test_privileges.py), then
results.md's block runs as the owner.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, states
from celery.result import GroupResult
from psycopg import sql

from pg_transport.errors import NotPermitted
from tests.integration.test_docs import DOCS, sql_blocks
from tests.integration.test_privileges import Roles, grant, options, page_roles, refused

PAGE = DOCS / "results.md"


def publisher_block() -> str:
    (block,) = [b for b in sql_blocks(PAGE) if b.startswith("-- results for a publisher")]
    return block


@pytest.fixture(scope="module")
def database(pg_url: str) -> Iterator[str]:
    from tests.integration.test_privileges import throwaway_database

    with throwaway_database(pg_url) as url:
        yield url


@pytest.fixture
def granted(database: str) -> Iterator[Roles]:
    with page_roles(database) as made:
        grant(made)
        with made.connect(made.owner) as owner:
            owner.execute(made.substitute(publisher_block()))
        yield made


def app_as(roles: Roles, role: str) -> Celery:
    app = Celery("results", broker=roles.url(role), backend=roles.url(role), set_as_current=False)
    app.conf.broker_transport_options = options(roles)
    app.conf.result_backend_transport_options = options(roles)
    return app


def table(roles: Roles, name: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(roles.schema), sql.Identifier(name))


def test_a_publisher_reads_the_results_it_holds_and_lists_none(granted: Roles) -> None:
    worker, publisher = app_as(granted, granted.worker), app_as(granted, granted.publisher)
    task_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    worker.backend.store_result(task_id, {"total": 5}, states.SUCCESS)
    worker.backend.store_result(other, "someone else's", states.SUCCESS)

    # What a web front end does: wait for a task it sent, by its id.
    assert publisher.AsyncResult(task_id).get(timeout=30) == {"total": 5}
    assert publisher.backend.get_task_meta(task_id)["status"] == states.SUCCESS
    assert publisher.AsyncResult(str(uuid.uuid4())).state == states.PENDING

    with granted.connect(granted.publisher) as conn:
        # No listing: not the ids, not the results, not the saved groups, by any route.
        for statement in (
            sql.SQL("SELECT task_id FROM {}").format(table(granted, "result")),
            sql.SQL("SELECT count(*) FROM {}").format(table(granted, "result")),
            sql.SQL("SELECT group_id FROM {}").format(table(granted, "result_group")),
            sql.SQL("SELECT task_id FROM {}").format(table(granted, "barrier_part")),
            sql.SQL("SELECT metadata FROM {}").format(table(granted, "barrier")),
        ):
            assert refused(conn, statement), statement.as_string(conn)
        # result_read matches ids exactly: a pattern or a near miss finds nothing.
        read = sql.SQL("SELECT task_id FROM {}.result_read(%s::text[])").format(
            sql.Identifier(granted.schema)
        )
        assert conn.execute(read, [["%", "*", task_id[:-1], ""]]).fetchall() == []
        assert conn.execute(read, [[task_id]]).fetchall() == [(task_id,)]

        # No forging: a result written or replaced, a chord's part recorded or counted.
        result, part, chord = (table(granted, t) for t in ("result", "barrier_part", "barrier"))
        forged: list[tuple[str, sql.Composed, list[str]]] = [
            (
                "store a result",
                sql.SQL(
                    "INSERT INTO {} (task_id, status, content_type, content_encoding, meta)"
                    " VALUES (%s, 'SUCCESS', 'application/json', 'utf-8', '\\x7b7d')"
                ).format(result),
                [other],
            ),
            (
                "replace a result",
                sql.SQL("UPDATE {} SET status = 'SUCCESS' WHERE task_id = %s").format(result),
                [other],
            ),
            ("drop a result", sql.SQL("DELETE FROM {} WHERE task_id = %s").format(result), [other]),
            (
                "record a chord's part",
                sql.SQL(
                    "INSERT INTO {} (barrier_id, idx, task_id, outcome)"
                    " VALUES (%s, 0, %s, 'succeeded')"
                ).format(part),
                ["celery-chord:g", other],
            ),
            (
                "count a chord's part",
                sql.SQL("UPDATE {} SET remaining = 0 WHERE id = %s").format(chord),
                ["celery-chord:g"],
            ),
        ]
        for what, statement, params in forged:
            assert refused(conn, statement, *params), what
        # What results.md grants only on request (forget, groups) is not granted here.
        for call in (
            "SELECT {}.result_forget(%s)",
            "SELECT * FROM {}.result_group_read(%s)",
            "SELECT {}.result_group_delete(%s)",
        ):
            statement = sql.SQL(call).format(sql.Identifier(granted.schema))
            assert refused(conn, statement, other), call
    with pytest.raises(NotPermitted, match=r"docs/results\.md"):
        publisher.backend.forget(task_id)
    assert worker.AsyncResult(other).get(timeout=30) == "someone else's"


@pytest.mark.parametrize("kind", ["monitor", "nobody"])
def test_the_monitor_and_a_role_without_grants_read_no_result(granted: Roles, kind: str) -> None:
    task_id = str(uuid.uuid4())
    app_as(granted, granted.worker).backend.store_result(task_id, 1, states.SUCCESS)
    read = sql.SQL("SELECT * FROM {}.result_read(%s::text[])").format(
        sql.Identifier(granted.schema)
    )
    if kind == "nobody":  # let it in: what it may do once in is the point
        with psycopg.connect(granted.pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                    sql.Identifier(granted.database), sql.Identifier(granted.nobody)
                )
            )
    with granted.connect(granted.role(kind)) as conn:
        assert refused(conn, read, [task_id]), kind


def test_the_worker_role_forgets_and_keeps_groups_through_the_functions(granted: Roles) -> None:
    worker = app_as(granted, granted.worker)
    ids = [str(uuid.uuid4()) for _ in range(2)]
    for n, task_id in enumerate(ids):
        worker.backend.store_result(task_id, n, states.SUCCESS)
    group = GroupResult(str(uuid.uuid4()), [worker.AsyncResult(i) for i in ids], app=worker)
    group.save(backend=worker.backend)
    restored = GroupResult.restore(group.id, backend=worker.backend, app=worker)
    assert restored is not None and [r.id for r in restored.results] == ids
    assert restored.get(timeout=30) == [0, 1]
    restored.delete(backend=worker.backend)
    assert GroupResult.restore(group.id, backend=worker.backend, app=worker) is None
    worker.AsyncResult(ids[0]).forget()
    assert worker.backend.get_task_meta(ids[0])["status"] == states.PENDING


def test_the_page_grants_the_publisher_one_function_and_takes_back_the_table(
    granted: Roles,
) -> None:
    """The block runs again as it is (and over the SELECT earlier versions granted). Of
    the functions that run as their owner (the ones that can do more than the caller's own
    grants), the publisher may call the result read and, from least-privilege.md, the unique
    key's holder look-up, nothing else; the ones that run as the caller (the flow gates')
    stay callable by anyone and do nothing without the worker's tables."""
    with granted.connect(granted.owner) as owner:
        owner.execute(
            sql.SQL("GRANT SELECT ON {} TO {}").format(
                table(granted, "result"), sql.Identifier(granted.publisher)
            )
        )
        owner.execute(granted.substitute(publisher_block()))
    with granted.connect(granted.publisher) as conn:
        assert refused(conn, sql.SQL("SELECT task_id FROM {}").format(table(granted, "result")))
        rows: list[Any] = conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = %s AND has_function_privilege(p.oid, 'EXECUTE')"
            " AND p.prosecdef ORDER BY 1",
            [granted.schema],
        ).fetchall()
        assert refused(
            conn,
            sql.SQL("SELECT * FROM {}.flow_tokens('task:t', 'k', 1)").format(
                sql.Identifier(granted.schema)
            ),
        )
    assert json.dumps(rows) == json.dumps([["result_read"], ["unique_holder"]])


def test_a_role_without_the_functions_is_told_what_to_grant(granted: Roles) -> None:
    monitor = app_as(granted, granted.monitor)
    with pytest.raises(NotPermitted, match="EXECUTE on the result functions"):
        monitor.backend.get_task_meta(str(uuid.uuid4()))
