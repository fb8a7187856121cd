"""Celery headers of every wrong shape, published to real workers of each pool: no worker
dies, none wedges (a task sent after them runs), and every bad message is in dead_letter
with a reason naming its field. And a worker that wedges all the same (its pool never
starts what it holds) fails ``pgq health``."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.types.json import Json

from pg_transport.ops import health
from pg_transport.ops.cli import main
from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"
SLOW = "tests.acceptance.app.slow_mark"
RAISES = "tests.acceptance.headers_app.cannot_run"

#: (field, value): what a publisher could put in the headers a worker unpacks.
BAD: list[tuple[str, Any]] = [
    ("timelimit", "abc"),
    ("timelimit", [1, 2, 3]),
    ("timelimit", [1]),
    ("timelimit", 5),
    ("timelimit", ["1", None]),
    ("timelimit", [-1, None]),
    ("eta", "abc"),
    ("eta", 12),
    ("eta", ""),
    ("expires", "tomorrow"),
    ("expires", [2030]),
    ("retries", "1"),
    ("argsrepr", ["a"]),
    ("kwargsrepr", 12),
    ("id", 12),
    ("task", ["x"]),
    ("root_id", {}),
    ("stamped_headers", "a"),
    ("stamps", [1]),
    ("ignore_result", "yes"),
    ("shadow", 12),
    ("parent_id", [1]),
    ("group", 12),
    ("group_index", "0"),
    ("replaced_task_nesting", -1),
]
#: The same fields where protocol 1 has them (in the body, no task header), and in the
#: body of a hybrid message (protocol 2 headers, a body with args): (field, row payload).
BODIES: list[tuple[str, dict[str, Any]]] = [
    (
        "timelimit",
        {"headers": {}, "body": {"task": MARK, "id": "v1", "args": [], "timelimit": "abc"}},
    ),
    (
        "eta",
        {"headers": {"task": MARK, "id": "hybrid"}, "body": {"args": [], "eta": 12}},
    ),
]


def insert_rows(env: Env, rows: list[dict[str, Any]]) -> None:
    """Rows as a publisher other than Celery could write them (JSON bodies)."""
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        for row in rows:
            payload = {
                "body": json.dumps(row["body"]),
                "content-type": "application/json",
                "content-encoding": "utf-8",
                "headers": row["headers"],
                "properties": {"delivery_info": {"exchange": "", "routing_key": "celery"}},
            }
            conn.execute(
                sql.SQL("INSERT INTO {}.message (queue, payload) VALUES ('celery', %s)").format(
                    sql.Identifier(env.schema)
                ),
                [Json(payload)],
            )


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
@pytest.mark.sessions(9)  # side by side, the run's meter
def test_bad_headers_are_dead_lettered_and_the_worker_goes_on(env: Env, pool: str) -> None:
    client = env.client()
    # A slow task first, so that the bad messages come to a pool that is busy (prefork
    # runs them from its callback when the slot frees) and then idle.
    client.send_task(SLOW, args=["busy", 0.5])
    for n, (field, value) in enumerate(BAD):
        client.send_task(MARK, args=[f"bad-{n}"], headers={field: value})
    # A bad one with an ETA (Celery would run it from a timer, not the delivery).
    client.send_task(MARK, args=["bad-eta"], headers={"timelimit": "abc"}, countdown=0.01)
    insert_rows(env, [row for _, row in BODIES])
    # Celery raising after the pool took a slot, for reasons no check could foresee.
    for n in range(3):
        client.send_task(RAISES, args=[f"raises-{n}"])
    worker = start_worker(
        env,
        f"headers-{pool}",
        pool=pool,
        concurrency=1,
        app="tests.acceptance.headers_app",
        environ=QUICK_STOP,
    )
    try:
        count = len(BAD) + 1 + len(BODIES) + 3
        wait_for(
            lambda: env.scalar("SELECT count(*) FROM {schema}.dead_letter") == count,
            60,
            f"{count} dead letters",
        )
        client.send_task(MARK, args=["after"])
        wait_for(lambda: "after" in [r[1] for r in env.runs()], 30, "a task sent after them")
        assert worker.proc.poll() is None, "the worker died"
    finally:
        worker.stop()
    assert sorted(r[1] for r in env.runs()) == ["after", "busy"], worker.output()
    with_reasons = env.scalar("SELECT array_agg(reason) FROM {schema}.dead_letter")
    named = Counter(
        m.group(1) for r in with_reasons if (m := re.search(r"(?:header|field) '(\w+)'", r))
    )
    sent = [field for field, _ in BAD] + ["timelimit"] + [field for field, _ in BODIES]
    assert named == Counter(sent), with_reasons
    raised = [r for r in with_reasons if "raised after the pool slot was taken" in r]
    assert len(raised) == 3, with_reasons
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0


@pytest.mark.sessions(5)  # the most of two runs, -n 0
def test_a_worker_holding_a_task_its_pool_never_starts_is_unhealthy(
    env: Env, tmp_path: Path
) -> None:
    heartbeat = tmp_path / "worker.heartbeat"

    def pgq_health() -> Any:
        return CliRunner().invoke(main, ["health", "--file", str(heartbeat), "--stale-after", "3"])

    worker = start_worker(
        env,
        "wedged",
        pool="prefork",
        concurrency=1,
        app="tests.acceptance.wedge_app",
        environ={**QUICK_STOP, health.FILE_ENV: str(heartbeat), "TEST_WEDGE": "1"},
    )
    try:
        wait_for(lambda: pgq_health().exit_code == 0, 30, "a healthy idle worker")
        env.client().send_task(MARK, args=["never"])
        # (Stuck is reported first, whatever the heartbeat's age, once it lasts 3 s.)
        found = wait_for(
            lambda: "without starting any" in (r := pgq_health()).stderr and r,
            30,
            "pgq health to report the stuck pool",
        )
        assert found.exit_code == 1
        assert worker.proc.poll() is None
        # Its consume loop still turns: only the stuck pool makes it unhealthy.
        assert health.check(heartbeat, 30).healthy
        assert env.runs() == []
    finally:
        worker.stop()
