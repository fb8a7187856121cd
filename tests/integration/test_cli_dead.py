"""`pgq dead list|requeue|purge|rehook` against a real Postgres."""

from __future__ import annotations

import json
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from pg_transport.db.pool import Connector, mask_url
from pg_transport.ops.cli import main
from pg_transport.ops.dead import DeadLetters
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.integration.test_cli import (
    HOSTILE,
    SHOWN,
    UNREACHABLE,
    clean_env,
    invoke,
    pgq_command,
    raw_controls,
    run_pgq,
)

TASK = "tests.app.run_pipeline"


def task_message(n: int, *, organization: int = 1) -> dict[str, Any]:
    """A Celery protocol-2 message as the transport stores it: run_pipeline(org, n)."""
    return {
        "body": json.dumps([[organization, n], {"step": f"s{n}"}, {}]),
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {"id": f"task-{n}", "task": TASK},
        "properties": {"priority": 0},
    }


def poison(store: Store, peek: Peek, queue: str, payload: dict[str, Any], priority: int = 0) -> int:
    """Dead-letter one message the way a worker does: its second delivery exceeds 1 attempt.

    Must run while ``queue`` holds no other visible message (it claims whatever is first).
    """
    store.publisher.publish(queue, payload, priority=priority)
    [first] = store.claim([queue], [30.0], 1, [1])
    assert first.dead_letter_id is None
    peek.expire_leases()
    [poisoned] = store.claim([queue], [30.0], 1, [1])
    assert poisoned.dead_letter_id is not None
    return poisoned.dead_letter_id


def dead(*args: str, url: str, schema: str, input: str | None = None) -> Result:
    runner = CliRunner(env={"PGQ_URL": None, "PGQ_SCHEMA": None})
    return runner.invoke(main, ["dead", *args, "--url", url, "--schema", schema], input=input)


def dead_ids(peek: Peek) -> list[int]:
    return [r[0] for r in peek("SELECT id FROM {schema}.dead_letter ORDER BY id")]


# -- list ---------------------------------------------------------------------
def test_list_shows_rows_newest_first_with_identity_and_hooks(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    first = poison(store, peek, "jobs", task_message(1, organization=7))
    second = poison(store, peek, "jobs", task_message(2))
    other = poison(store, peek, "other", task_message(3))
    store.identify_dead_letter(
        first,
        task_id="task-1",
        task_name=TASK,
        identity={"organization_id": 7, "execution_id": 1},
        reasons=[],
    )
    store.record_hooks(
        first,
        [{"receiver": "a.ok", "ok": True}, {"receiver": "a.bad", "ok": False, "error": "boom"}],
    )

    result = dead("list", url=broker_url, schema=schema)
    assert result.exit_code == 0, result.output
    header, *lines = result.stdout.splitlines()
    assert header.split() == [
        "ID",
        "QUEUE",
        "TASK",
        "TASK",
        "ID",
        "IDENTITY",
        "READS",
        "DEAD",
        "AT",
        "HOOKS",
        "REASON",
    ]
    assert [int(line.split()[0]) for line in lines] == [other, second, first]
    assert lines[2].split()[1:4] == ["jobs", TASK, "task-1"]
    assert " execution_id=1 organization_id=7 " in lines[2]
    assert "1 ok, 1 failed" in lines[2]
    assert "delivered 1 times; max_attempts is 1" in lines[0]

    as_json = json.loads(dead("list", "--json", url=broker_url, schema=schema).stdout)
    assert as_json["total"] == 3
    rows = {r["id"]: r for r in as_json["dead_letters"]}
    assert list(rows) == [other, second, first]
    assert rows[first] | {"dead_at": None, "hooks": None} == {
        "id": first,
        "queue": "jobs",
        "task_name": TASK,
        "task_id": "task-1",
        "identity": {"organization_id": 7, "execution_id": 1},
        "reason": "delivered 1 times; max_attempts is 1",
        "read_ct": 1,
        "dead_at": None,
        "hooks_ok": 1,
        "hooks_failed": 1,
        "hooks": None,
    }
    assert rows[other]["hooks"] == [] and rows[other]["hooks_failed"] == 0


def test_list_filters_by_queue_and_limits(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    ids = [poison(store, peek, "jobs", task_message(n)) for n in range(3)]
    other = poison(store, peek, "other", task_message(9))

    only = json.loads(
        dead("list", "--json", "--queue", "other", url=broker_url, schema=schema).stdout
    )
    assert only["total"] == 1 and [r["id"] for r in only["dead_letters"]] == [other]

    limited = dead("list", "--queue", "jobs", "--limit", "2", url=broker_url, schema=schema)
    assert limited.exit_code == 0, limited.output
    *rows, footer = limited.stdout.splitlines()[1:]
    assert [int(r.split()[0]) for r in rows] == [ids[2], ids[1]]
    assert footer == "(2 of 3 shown; raise --limit to see more)"

    empty = dead("list", "--queue", "nothing-here", url=broker_url, schema=schema)
    assert empty.stdout.strip() == "no dead-letter rows in queue 'nothing-here'"


# -- requeue ------------------------------------------------------------------
def test_requeue_one_moves_it_back_fresh_and_wakes_listeners(
    pg_url: str, broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    payload = task_message(1)
    target = poison(store, peek, "jobs", payload, priority=7)
    kept = poison(store, peek, "jobs", task_message(2))

    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.channel("jobs")}"')
        result = dead("requeue", str(target), url=broker_url, schema=schema)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "1 dead-letter row requeued: 1 to queue 'jobs'"
        notified = next(listener.notifies(timeout=5, stop_after=1))
    assert (notified.channel, notified.payload) == (store.channel("jobs"), "")

    assert dead_ids(peek) == [kept]
    [(queue, priority, read_ct, key, ready, stored)] = peek(
        "SELECT queue, priority, read_ct, publish_key, visible_at <= now(), payload"
        " FROM {schema}.message"
    )
    assert (queue, priority, read_ct, key, ready) == ("jobs", 7, 0, None, True)
    assert stored == payload
    # A consumer gets it as a first delivery: it has all its attempts again.
    [claimed] = store.claim(["jobs"], [30.0], 10, [1])
    assert (claimed.read_ct, claimed.dead_letter_id, claimed.payload) == (1, None, payload)


def test_requeue_all_and_all_of_one_queue(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    jobs = [poison(store, peek, "jobs", task_message(n)) for n in range(2)]
    poison(store, peek, "other", task_message(5))
    mail = poison(store, peek, "mail", task_message(6))

    one_queue = dead("requeue", "--all", "--queue", "other", url=broker_url, schema=schema)
    assert one_queue.exit_code == 0, one_queue.output
    assert one_queue.stdout.strip() == "1 dead-letter row requeued: 1 to queue 'other'"
    assert dead_ids(peek) == [*jobs, mail]

    everything = dead("requeue", "--all", url=broker_url, schema=schema)
    assert everything.exit_code == 0, everything.output
    assert everything.stdout.strip() == (
        "3 dead-letter rows requeued: 2 to queue 'jobs', 1 to queue 'mail'"
    )
    assert dead_ids(peek) == []
    assert peek(
        "SELECT queue, count(*), max(read_ct) FROM {schema}.message GROUP BY queue ORDER BY queue"
    ) == [("jobs", 2, 0), ("mail", 1, 0), ("other", 1, 0)]
    claimed = store.claim(["jobs", "mail", "other"], [30.0] * 3, 10)
    assert sorted(c.payload["headers"]["id"] for c in claimed) == [
        "task-0",
        "task-1",
        "task-5",
        "task-6",
    ]

    nothing = dead("requeue", "--all", url=broker_url, schema=schema)
    assert nothing.stdout.strip() == "0 dead-letter rows requeued"


def test_requeue_of_unknown_ids_is_an_error_after_moving_the_known_ones(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    known = poison(store, peek, "jobs", task_message(1))
    only_unknown = dead("requeue", "999999", url=broker_url, schema=schema)
    assert only_unknown.exit_code == 1
    assert only_unknown.stdout == ""
    assert only_unknown.stderr.splitlines() == [
        f"Error: no dead-letter row 999999 in schema {schema!r}"
    ]

    mixed = dead("requeue", str(known), "999998", url=broker_url, schema=schema)
    assert mixed.exit_code == 1
    assert mixed.stdout.strip() == "1 dead-letter row requeued: 1 to queue 'jobs'"
    assert mixed.stderr.splitlines() == [f"Error: no dead-letter row 999998 in schema {schema!r}"]
    assert dead_ids(peek) == []


@pytest.mark.parametrize(
    "args", [[], ["1", "--all"], ["1", "--queue", "jobs"]], ids=["neither", "both", "queue"]
)
def test_requeue_needs_ids_or_all(broker_url: str, schema: str, args: list[str]) -> None:
    result = dead("requeue", *args, url=broker_url, schema=schema)
    assert result.exit_code == 2
    assert "Traceback" not in result.output


@pytest.mark.sessions(13)
def test_concurrent_requeues_of_one_row_move_it_once(
    pg_url: str, schema: str, store: Store, peek: Peek
) -> None:
    target = poison(store, peek, "jobs", task_message(1))
    workers = 6
    start = threading.Barrier(workers)
    moved: list[dict[str, list[int]]] = []
    connector = Connector(pg_url)
    dead_letters = DeadLetters(Store(connector, schema))

    def requeue() -> None:
        start.wait()
        moved.append(dead_letters.requeue([target]))

    threads = [threading.Thread(target=requeue) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    connector.close()
    assert sorted(map(len, moved)) == [0] * (workers - 1) + [1]
    assert peek("SELECT count(*) FROM {schema}.message") == [(1,)]
    assert dead_ids(peek) == []


# -- purge --------------------------------------------------------------------
def test_purge_older_than_keeps_newer_rows(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    old = [poison(store, peek, "jobs", task_message(n)) for n in range(2)]
    old_other = poison(store, peek, "other", task_message(3))
    recent = poison(store, peek, "jobs", task_message(4))
    peek(
        "UPDATE {schema}.dead_letter SET dead_at = now() - interval '8 days' WHERE id = ANY(%s)",
        [*old, old_other],
    )

    nine_days = dead("purge", "--older-than", "9d", "-y", url=broker_url, schema=schema)
    assert nine_days.stdout.strip() == "0 dead-letter rows purged (dead for longer than 9d)"

    of_queue = dead(
        "purge", "--older-than", "7d", "--queue", "other", "-y", url=broker_url, schema=schema
    )
    assert of_queue.exit_code == 0, of_queue.output
    assert of_queue.stdout.strip() == (
        "1 dead-letter row purged from queue 'other' (dead for longer than 7d)"
    )
    result = dead("purge", "--older-than", "7d", "--yes", url=broker_url, schema=schema)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "2 dead-letter rows purged (dead for longer than 7d)"
    assert dead_ids(peek) == [recent]


def test_purge_of_everything_asks_unless_yes(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    ids = [poison(store, peek, "jobs", task_message(n)) for n in range(2)]

    declined = dead("purge", url=broker_url, schema=schema, input="n\n")
    assert declined.exit_code == 1
    assert f"Delete every dead-letter row in pgq schema {schema!r}" in declined.output
    assert dead_ids(peek) == ids

    result = dead("purge", "--yes", url=broker_url, schema=schema)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "2 dead-letter rows purged"
    assert dead_ids(peek) == []


def test_a_filtered_purge_asks_too_unless_yes(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    """`--older-than 0s --queue q` deletes as much as a bare purge of q: it asks alike."""
    ids = [poison(store, peek, "jobs", task_message(n)) for n in range(2)]
    for given in ("n\n", ""):  # declined, and no answer at all (cron, a pipe)
        declined = dead(
            "purge",
            "--older-than",
            "0s",
            "--queue",
            "jobs",
            url=broker_url,
            schema=schema,
            input=given,
        )
        assert declined.exit_code == 1, declined.output
        assert (
            "Delete the dead-letter rows of queue 'jobs' dead for longer than 0s in pgq "
            f"schema {schema!r}"
        ) in declined.output
        assert dead_ids(peek) == ids
    accepted = dead(
        "purge",
        "--older-than",
        "0s",
        "--queue",
        "jobs",
        url=broker_url,
        schema=schema,
        input="y\n",
    )
    assert accepted.exit_code == 0, accepted.output
    assert accepted.stdout.strip().endswith(
        "2 dead-letter rows purged from queue 'jobs' (dead for longer than 0s)"
    )
    assert dead_ids(peek) == []


def test_bad_duration_is_one_line(broker_url: str, schema: str, store: Store) -> None:
    result = dead("purge", "--older-than", "7 days", url=broker_url, schema=schema)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "Error: bad duration '7 days': expected a number and a unit (s, m, h, d, w), "
        "e.g. 90s, 30m, 12h, 7d or 1h30m"
    ]


# -- rehook -------------------------------------------------------------------
APP = '''
"""Poison hooks of a user's app: one records its calls, one fails unless told not to."""
import os

import psycopg
from psycopg import sql
from psycopg.types.json import Json

from pg_transport import identity, signals

identity.register("{task}", execution_id=1, organization_id=0)


@signals.message_poisoned.connect
def record_call(sender, queue, task_id, identity, args, kwargs, attempts, dead_letter_id, **_):
    with psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {{}}.hook_calls (sender, queue, task_id, identity, args, kwargs,"
                " attempts, dead_letter_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
            ).format(sql.Identifier(os.environ["TEST_SCHEMA"])),
            [sender, queue, task_id, Json(identity), Json(args), Json(kwargs), attempts,
             dead_letter_id],
        )


@signals.message_poisoned.connect
def notify_status_service(sender, **_):
    if os.environ.get("HOOK_FAILS") == "1":
        raise RuntimeError("the status service is down")
'''


@pytest.fixture
def app_dir(tmp_path: Path, peek: Peek) -> Path:
    (tmp_path / "poison_hooks.py").write_text(textwrap.dedent(APP.format(task=TASK)))
    peek(
        "CREATE TABLE {schema}.hook_calls (sender text, queue text, task_id text,"
        " identity jsonb, args jsonb, kwargs jsonb, attempts int, dead_letter_id bigint)"
    )
    return tmp_path


def rehook(
    *args: str, cwd: Path, pg_url: str, schema: str, fails: bool = True
) -> subprocess.CompletedProcess[str]:
    # A subprocess, like `celery -A`: importing the app connects handlers for good,
    # which must not leak into the other tests of this session.
    return subprocess.run(
        [*pgq_command(), "dead", "rehook", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=clean_env(TEST_PG_URL=pg_url, TEST_SCHEMA=schema, HOOK_FAILS="1" if fails else "0"),
    )


def test_rehook_runs_the_apps_handlers_and_records_each_outcome(
    pg_url: str, broker_url: str, schema: str, store: Store, peek: Peek, app_dir: Path
) -> None:
    target = poison(store, peek, "jobs", task_message(42, organization=7))
    store.record_hooks(target, [{"receiver": "old", "ok": False, "error": "before"}])

    result = rehook(
        str(target),
        "-A",
        "poison_hooks",
        "--url",
        broker_url,
        "--schema",
        schema,
        cwd=app_dir,
        pg_url=pg_url,
        schema=schema,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"dead-letter row {target} of queue 'jobs': task {TASK} task-42, "
        "identity execution_id=42 organization_id=7",
        "  ok      poison_hooks.record_call",
        "  FAILED  poison_hooks.notify_status_service: RuntimeError('the status service is down')",
    ]
    assert result.stderr.splitlines() == [
        f"Error: 1 of 2 handlers failed; outcomes recorded on dead-letter row {target}"
    ]
    assert peek(
        "SELECT sender, queue, task_id, identity, args, kwargs, attempts, dead_letter_id"
        " FROM {schema}.hook_calls"
    ) == [
        (
            TASK,
            "jobs",
            "task-42",
            {"execution_id": 42, "organization_id": 7},
            [7, 42],
            {"step": "s42"},
            1,
            target,
        )
    ]
    [(hooks,)] = peek("SELECT hooks FROM {schema}.dead_letter WHERE id = %s", target)
    assert [(h["receiver"], h["ok"], h.get("error")) for h in hooks] == [
        ("poison_hooks.record_call", True, None),
        ("poison_hooks.notify_status_service", False, "RuntimeError('the status service is down')"),
    ]

    healed = rehook(
        str(target),
        "--app",
        "poison_hooks",
        "--url",
        broker_url,
        "--schema",
        schema,
        cwd=app_dir,
        pg_url=pg_url,
        schema=schema,
        fails=False,
    )
    assert healed.returncode == 0, healed.stderr
    assert healed.stdout.splitlines()[1:] == [
        "  ok      poison_hooks.record_call",
        "  ok      poison_hooks.notify_status_service",
    ]
    [(hooks,)] = peek("SELECT hooks FROM {schema}.dead_letter WHERE id = %s", target)
    assert [h["ok"] for h in hooks] == [True, True]
    listed = json.loads(dead("list", "--json", url=broker_url, schema=schema).stdout)
    assert (listed["dead_letters"][0]["hooks_ok"], listed["dead_letters"][0]["hooks_failed"]) == (
        2,
        0,
    )
    # The row stays dead-lettered: rehook tells the app again, it does not redeliver.
    assert dead_ids(peek) == [target]


def test_rehook_escapes_what_it_prints_of_the_row(
    pg_url: str, broker_url: str, schema: str, store: Store, peek: Peek, app_dir: Path
) -> None:
    payload = task_message(5)
    payload["headers"] = {"id": HOSTILE, "task": HOSTILE}
    target = poison(store, peek, HOSTILE, payload)
    result = rehook(
        str(target),
        "-A",
        "poison_hooks",
        "--url",
        broker_url,
        "--schema",
        schema,
        cwd=app_dir,
        pg_url=pg_url,
        schema=schema,
    )
    assert result.returncode == 1, result.stderr
    assert raw_controls(result.stdout + result.stderr) == []
    assert result.stdout.splitlines()[0] == (
        f"dead-letter row {target} of queue '{SHOWN}': task {SHOWN} {SHOWN}, identity -"
    )


def test_rehook_without_handlers_changes_nothing(
    pg_url: str, broker_url: str, schema: str, store: Store, peek: Peek, app_dir: Path
) -> None:
    target = poison(store, peek, "jobs", task_message(1))
    recorded = [{"receiver": "old", "ok": False, "error": "before"}]
    store.record_hooks(target, recorded)
    result = rehook(
        str(target),
        "--url",
        broker_url,
        "--schema",
        schema,
        cwd=app_dir,
        pg_url=pg_url,
        schema=schema,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "Error: no message_poisoned handler is connected: pass the module that connects "
        "them with -A/--app MODULE"
    ]
    assert peek("SELECT hooks FROM {schema}.dead_letter") == [(recorded,)]


def test_rehook_errors_are_one_line(
    pg_url: str, broker_url: str, schema: str, store: Store, app_dir: Path
) -> None:
    (app_dir / "broken_app.py").write_text("raise ImportError('half-installed dependency')\n")
    cases = {
        ("999999", "-A", "poison_hooks"): f"Error: no dead-letter row 999999 in schema {schema!r}",
        ("1", "-A", "no_such_module"): "Error: cannot import app module 'no_such_module': "
        "ModuleNotFoundError: No module named 'no_such_module'",
        ("1", "-A", "broken_app:app"): "Error: cannot import app module 'broken_app': "
        "ImportError: half-installed dependency",
    }
    for args, expected in cases.items():
        result = rehook(
            *args,
            "--url",
            broker_url,
            "--schema",
            schema,
            cwd=app_dir,
            pg_url=pg_url,
            schema=schema,
        )
        assert result.returncode == 1, args
        assert result.stderr.splitlines() == [expected], args


# -- errors at the boundary ---------------------------------------------------
COMMANDS = [
    ["dead", "list"],
    ["dead", "requeue", "--all"],
    ["dead", "purge", "--yes"],
    ["dead", "purge", "--older-than", "1d"],
    ["dead", "rehook", "1"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_missing_schema_says_to_migrate(broker_url: str, schema: str, command: list[str]) -> None:
    result = invoke(*command, "--url", broker_url, "--schema", schema)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: pgq schema {schema!r} at {mask_url(broker_url)} does not exist: "
        "run `pgq migrate` first"
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_unreachable_server_is_one_line_without_traceback(command: list[str]) -> None:
    result = run_pgq(*command, "--url", UNREACHABLE)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: cannot connect to Postgres at {UNREACHABLE}")
