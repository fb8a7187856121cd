"""ETA and countdown tasks wait in Postgres until due, not in worker memory."""

from __future__ import annotations

import time

import pytest

from tests.acceptance.harness import Env, wait_for, workers

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"


def test_countdown_waits_in_postgres_and_runs_when_due(env: Env) -> None:
    client = env.client()
    # The worker is up before the countdown starts: however long it takes to start (many
    # seconds on a loaded machine), the countdown is measured from a running worker.
    with workers(env, "patient", concurrency=2):
        client.send_task(MARK, args=["later"], countdown=3)
        due_in = env.scalar(
            "SELECT extract(epoch FROM visible_at - enqueued_at) FROM {schema}.message"
        )
        assert 0 < due_in <= 3.0  # due in the future, no later than asked
        due = env.scalar("SELECT visible_at FROM {schema}.message")
        # The publish woke the idle worker. Until the row is due no worker holds it: it
        # stays unclaimed (read in one statement with the time it was read at, so that a
        # machine too slow to look before it fell due checks nothing false).
        claimed, early = env.row(
            "SELECT read_ct, clock_timestamp() < visible_at FROM {schema}.message"
        )
        if early:
            assert claimed == 0
        wait_for(lambda: env.runs(), 30, "the delayed task to run")
        wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 30, "ack")
    started_after_due = env.scalar(
        "SELECT extract(epoch FROM min(at) - %s) FROM {schema}.task_runs", due
    )
    assert started_after_due >= 0  # never before it was due
    assert [r[1] for r in env.runs()] == ["later"]


def test_native_delayed_delivery_off_publishes_visible_at_once(env: Env) -> None:
    client = env.client()
    client.conf.broker_transport_options = {
        "schema": env.schema,
        "native_delayed_delivery": False,
    }
    client.send_task(MARK, args=["held-by-worker"], countdown=600)
    assert env.scalar("SELECT visible_at <= now() FROM {schema}.message") is True


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_ten_thousand_countdowns_stay_in_postgres(env: Env) -> None:
    total = 10_000
    # What is measured is the worker: one countdown is published, and the rest are
    # copies of its row made in Postgres, each with a task id (and publish key) of its
    # own (publishing 10,000 through Celery takes a quiet 2-core machine ~10 s).
    env.client().send_task(MARK, args=["h0"], countdown=3600)
    env.scalar(
        "WITH copies AS (INSERT INTO {schema}.message"
        " (queue, priority, visible_at, enqueued_at, publish_key, payload)"
        " SELECT m.queue, m.priority, m.visible_at, m.enqueued_at, md5(t.id),"
        " jsonb_set(jsonb_set(jsonb_set(jsonb_set(m.payload::jsonb,"
        " '{{headers,id}}', to_jsonb(t.id)), '{{headers,root_id}}', to_jsonb(t.id)),"
        " '{{properties,correlation_id}}', to_jsonb(t.id)),"
        " '{{properties,delivery_tag}}', to_jsonb(gen_random_uuid()::text))::json"
        " FROM {schema}.message AS m,"
        " LATERAL (SELECT gen_random_uuid()::text AS id FROM generate_series(2, %s)) AS t"
        " RETURNING 1) SELECT count(*) FROM copies",
        total,
    )
    assert (
        env.scalar("SELECT count(DISTINCT payload->'headers'->>'id') FROM {schema}.message")
        == total
    )
    assert env.scalar("SELECT count(*) FROM {schema}.message WHERE visible_at > now()") == total
    # Polls every 0.2 s (the default is 1 s): the span below holds five of them.
    with workers(env, "flat", concurrency=2, environ={"PGQ_POLLING_INTERVAL": "0.2"}) as (worker,):
        before = rss_kib(worker.proc.pid)
        # A worker holding ETA tasks in memory would claim them all at once: give it
        # several polls to do so (waiting for the absence of an event needs a span).
        wait_for(
            lambda: env.scalar(
                "SELECT count(*) FROM {schema}.queue WHERE last_used > now() - interval '1 s'"
            ),
            30,
            "the worker to be consuming",
        )
        # A worker holding ETA tasks in memory would claim them all in its first
        # polls: give it five (waiting for the absence of an event takes a span).
        time.sleep(1.0)
        assert env.scalar("SELECT count(*) FROM {schema}.message WHERE read_ct > 0") == 0
        after = rss_kib(worker.proc.pid)
    assert env.runs() == []
    assert env.scalar("SELECT count(*) FROM {schema}.message WHERE read_ct = 0") == total
    assert after - before < 20_000  # KiB: flat, not 10,000 requests held in memory
