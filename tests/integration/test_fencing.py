"""Acks and renewals through a failover: they outlast it, and a refused one is seen.

A fenced statement (ack, release, renewal) that meets a dead connection keeps trying
for the fenced window; once its lease lapsed and the message was claimed again, the
fencing refuses it, and that refusal is logged (task id, queue) and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from kombu import Connection

from pg_transport import fencing
from pg_transport.config import Options
from pg_transport.db.retry import FENCED_RETRY_SECONDS
from pg_transport.message.rows import Lease
from pg_transport.ops import health
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.proxy import CuttingProxy

# The fenced window pgq had before it followed the deployment.
OLD_WINDOW = 5.0


def test_the_fenced_window_covers_patronis_defaults_and_every_lease() -> None:
    # Patroni's defaults (ttl 30 s, loop_wait 10 s) promote up to ~40 s after a crash.
    assert Options().fenced_window == FENCED_RETRY_SECONDS >= 40
    assert Options(visibility_timeout=300).fenced_window == 300
    assert Options(queue_visibility_timeouts={"slow": 900}).fenced_window == 900
    env = Options.from_sources({}, {"PGQ_FENCED_RETRY_WINDOW": "120"})
    assert env.fenced_window == 120


def test_an_ack_made_during_an_outage_longer_than_five_seconds_lands_once_it_ends(
    proxied_url: str, proxy: CuttingProxy, rows: Peek, schema: str
) -> None:
    with Connection(proxied_url, transport_options={"schema": schema}) as conn:
        queue = conn.SimpleQueue("through-failover")
        queue.put({"n": 1})
        message = queue.get(timeout=10)
        # The primary crashes: every session is gone and the server refuses new ones.
        proxy.crash()
        done = threading.Event()
        failure: list[BaseException] = []

        def ack() -> None:
            try:
                message.ack()
            except BaseException as exc:  # (reported below)
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=ack, daemon=True).start()
        # The outage lasts past the old window, measured on the refusals the ack met.
        deadline = time.monotonic() + 60
        while not (proxy.refused and proxy.refused[-1] - proxy.refused[0] > OLD_WINDOW + 0.5):
            assert not done.is_set(), "the ack gave up during the outage"
            assert time.monotonic() < deadline, "the ack stopped trying"
            done.wait(0.05)
        assert not done.is_set(), "the ack gave up during the outage"
        proxy.recover()  # the standby is promoted
        assert done.wait(30), "the ack did not land after the outage"
        assert failure == []
        assert rows("SELECT count(*) FROM {schema}.message") == [(0,)]
        queue.close()


def _lapse_and_reclaim(store: Store, rows: Peek, queue: str) -> Lease:
    """The holder's lease lapses and another consumer claims the message: its token."""
    rows("UPDATE {schema}.message SET visible_at = now() - interval '1 second'")
    (again,) = store.claim([queue], [30.0], 1)
    return again.token


def test_a_refused_ack_is_logged_with_its_task_and_counted(
    conn: Connection, rows: Peek, caplog: pytest.LogCaptureFixture
) -> None:
    store = conn.transport.store
    queue = conn.SimpleQueue("refusals")
    queue.put({"n": 1}, headers={"id": "task-refused-1"})
    message = queue.get(timeout=10)
    _lapse_and_reclaim(store, rows, "refusals")
    before = fencing.counts()["ack"]
    with caplog.at_level(logging.WARNING, logger="pg_transport.fencing"):
        message.ack()
    lines = [r.getMessage() for r in caplog.records if r.name == "pg_transport.fencing"]
    assert len(lines) == 1, lines
    assert "task-refused-1" in lines[0] and "'refusals'" in lines[0] and "ack" in lines[0]
    assert fencing.counts()["ack"] == before + 1
    # The message is the other consumer's now, untouched.
    assert rows("SELECT read_ct FROM {schema}.message") == [(2,)]
    queue.close()


def test_an_ack_riding_on_a_claim_and_a_renewal_report_their_refusals(
    store: Store, pg_url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    rows = Peek(pg_url, schema)
    try:
        store.declare_queue("riding")
        for n in range(2):
            store.publisher.publish("riding", {"body": f"m{n}", "headers": {}}, priority=0)
        first, second = store.claim(["riding"], [30.0], 2)
        mine = Lease(first.id, first.lease, "riding", "task-lapsed")
        kept = Lease(second.id, second.lease, "riding", "task-kept")
        rows(
            "UPDATE {schema}.message SET visible_at = now() - interval '1 second' WHERE id = %s",
            first.id,
        )
        (again,) = store.claim(["riding"], [30.0], 1)
        assert again.id == first.id
        before = fencing.counts()
        with caplog.at_level(logging.WARNING, logger="pg_transport.fencing"):
            assert store.renew([(mine, 30.0), (kept, 30.0)]) == 1
            # Both acks ride on a claim (of nothing more): one lands, one is refused.
            assert store.claim(["riding"], [30.0], 1, acks=[mine, kept]) == []
        lines = [r.getMessage() for r in caplog.records if r.name == "pg_transport.fencing"]
        assert len(lines) == 2, lines
        assert all("task-lapsed" in line for line in lines), lines
        assert fencing.counts()["renewal"] == before["renewal"] + 1
        assert fencing.counts()["ack"] == before["ack"] + 1
        assert rows("SELECT id FROM {schema}.message") == [(first.id,)]
    finally:
        rows.conn.close()


def test_pgq_health_shows_the_refusals_the_worker_counted(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    beat = health.Heartbeat(path)
    beat.start()
    beat.refused({"ack": 3, "renewal": 1})
    found = health.check(path, 60)
    assert found.healthy
    assert "3 ack(s)" in found.message and "1 renewal(s)" in found.message


def test_an_ack_after_a_lost_connection_waits_on_no_caller_and_lands_after_the_outage(
    proxied_url: str, proxy: CuttingProxy, rows: Peek, schema: str
) -> None:
    with Connection(proxied_url, transport_options={"schema": schema}) as conn:
        queue = conn.SimpleQueue("after-loss")
        queue.put({"n": 1})
        message = queue.get(timeout=10)
        transport = conn.transport
        proxy.crash()
        # Celery collects a lost connection (and reconnects, on the thread that acks
        # with the prefork pool): the ack must not hold that thread for the window.
        transport._collect(conn.connection)
        started = time.monotonic()
        message.ack()
        returned = time.monotonic() - started
        assert returned < 1.0, f"the ack held its caller {returned:.1f}s"
        # It keeps trying meanwhile, on a thread of its own: it lands once the server is back.
        deadline = time.monotonic() + 30
        while not proxy.refused:
            assert time.monotonic() < deadline, "the ack never tried"
            time.sleep(0.01)
        proxy.recover()
        while rows("SELECT count(*) FROM {schema}.message") != [(0,)]:
            assert time.monotonic() < deadline, "the ack did not land after the outage"
            time.sleep(0.05)
