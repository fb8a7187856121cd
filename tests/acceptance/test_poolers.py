"""Real workers behind PgBouncer in transaction pooling mode."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pg_transport.ops import health
from tests.acceptance.harness import Env, start_worker, wait_for, workers
from tests.bouncer import Bouncer, BouncerUnavailable, pgbouncer

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"


@pytest.fixture
def bouncer(pg_url: str) -> Iterator[Bouncer]:
    try:
        with pgbouncer(pg_url, pool_size=4) as found:
            yield found
    except BouncerUnavailable as exc:
        pytest.skip(str(exc))


def test_a_worker_behind_a_transaction_pooler_says_to_set_use_notify_off(
    env: Env, bouncer: Bouncer
) -> None:
    client = env.client()
    task_id = client.send_task(MARK, args=["never"]).id
    worker = start_worker(env, "pooled", environ={"PGQ_BROKER_URL": bouncer.url("pgq")}, wait=False)
    try:
        # Celery's consumer keeps trying to connect; each try says why it cannot.
        wait_for(lambda: "use_notify=false" in worker.output(), 60, "the worker's error")
    finally:
        worker.stop()
    output = worker.output()
    assert "use_notify=false" in output and "pool_mode = transaction" in output, output[-3000:]
    assert " ready." not in output and env.runs() == []
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 1, task_id


def test_workers_behind_a_transaction_pooler_with_use_notify_off_run_every_task_once(
    env: Env, bouncer: Bouncer
) -> None:
    environ = {
        "PGQ_BROKER_URL": bouncer.url("pgq"),
        "PGQ_USE_NOTIFY": "false",
        "PGQ_POLLING_INTERVAL": "0.1",
    }
    client = env.client()
    client.conf.broker_url = bouncer.url("pgq")
    client.conf.broker_transport_options = {"schema": env.schema, "use_notify": False}
    with workers(env, "p1", "p2", environ=environ):
        ids = [client.send_task(MARK, args=[f"t{n}"]).id for n in range(100)]
        wait_for(lambda: len(env.runs()) >= len(ids), 60, "every task to run")
        wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.message") == 0, 30, "every ack")
    per_id = Counter(r[0] for r in env.runs())
    assert set(per_id) == set(ids) and max(per_id.values()) == 1, per_id


def test_a_refused_worker_backs_off_exponentially_and_reports_unhealthy(
    env: Env, bouncer: Bouncer, tmp_path: Path
) -> None:
    beat = tmp_path / "worker.heartbeat"
    worker = start_worker(
        env,
        "refused",
        app="tests.acceptance.wedge_app",  # the acceptance app with pgq's heartbeat
        environ={"PGQ_BROKER_URL": bouncer.url("pgq"), health.FILE_ENV: str(beat)},
        wait=False,
    )
    try:
        # 1 + 2 + 4 s of back-off: the fourth refusal comes about 7 s after the first.
        wait_for(lambda: worker.output().count("refused by the broker") >= 4, 60, "4 refusals")
        found = health.check(beat, 3600)
    finally:
        worker.stop()
    output = worker.output()
    steps = re.findall(r"refused by the broker \((\d+) in a row\): .*?; next try in (\S+)s", output)
    assert [(int(n), float(d)) for n, d in steps[:4]] == [(1, 1), (2, 2), (3, 4), (4, 8)], output
    # One line per step, and the reason: use_notify=false.
    assert all("use_notify=false" in line for line in output.splitlines() if "in a row" in line)
    # Celery's own error line comes once per try, not seven times a second.
    assert output.count("Cannot connect to") <= len(steps) + 1, output[-3000:]
    # pgq health fails while the broker refuses the worker (its heartbeat is fresh).
    assert not found.healthy and "refused by the broker" in found.message, found
