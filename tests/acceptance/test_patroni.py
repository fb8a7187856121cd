"""Failover under Patroni: etcd and a two-member Patroni cluster in ``synchronous_mode``,
the leader killed (SIGKILL of its patroni and its postmaster), Patroni promotes the
synchronous standby.

Two Celery workers (threads pool, 4 each, ``acks_late``) and a producer (Celery's publish
retry) use one multi-host URL listing both members with
``target_session_attrs=read-write``, every pgq default kept (``durable_acks`` auto: acks
wait for the synchronous standby Patroni names; ``fenced_retry_window`` 60 s, longer than
Patroni's ``ttl + loop_wait``; visibility timeout 30 s). Every task published (its publish
returned) must run exactly once: 0 lost, 0 duplicate runs.

Measured and printed: the time from the leader's death to Patroni's promotion (its
detection), and to the first run of a task published after the death (the probe): the
time the queue stood still.

On request (``pytest -m failover``): Patroni, etcd or the Postgres binaries missing, it
skips saying which. A run takes two to three minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.failover_load import SCHEMA, Record, Tally, under_load
from tests.acceptance.harness import wait_for
from tests.acceptance.patroni import (
    DEFAULTS,
    SHORT,
    PatroniCluster,
    PatroniUnavailable,
    Timing,
    patroni_cluster,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.failover]


@dataclass
class Outcome(Tally):
    died_at: float = 0.0
    promoted_at: float = 0.0
    probe_published_at: float = 0.0
    probe_ran_at: float = 0.0

    def report(self, label: str) -> str:
        return (
            f"patroni failover [{label}]: published {len(self.published)}, "
            f"lost {len(self.lost)}, duplicate runs {self.duplicates}; "
            f"promotion {self.promoted_at - self.died_at:.2f} s after the leader died, "
            f"probe published {self.probe_published_at - self.died_at:.2f} s and "
            f"ran {self.probe_ran_at - self.died_at:.2f} s after it"
        )


def queued(cluster: PatroniCluster) -> int:
    """Messages in the queue table on the leader (waiting, or running under a lease)."""
    leader = cluster.leader()
    if leader is None:
        return -1
    with psycopg.connect(leader.url(), autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(SCHEMA))
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else -1


def fail_over(record: Record, timing: Timing, *, vt: float | None = None) -> Outcome:
    try:
        cluster_cm = patroni_cluster(members=2, timing=timing)
        cluster = cluster_cm.__enter__()
    except PatroniUnavailable as exc:
        pytest.skip(str(exc))
    outcome = Outcome()
    try:
        leader = cluster.leader()
        assert leader is not None
        environ = {} if vt is None else {"PGQ_VISIBILITY_TIMEOUT": str(vt)}
        # Outlasts Patroni's detection (ttl + loop_wait) with room: about 60 s of retries.
        with under_load(
            cluster.url(), leader.url(), record, outcome, retries=300, environ=environ
        ) as load:
            # The probe's connection is open before the death, as a running producer's
            # is: its publish then retries by the producer's policy.
            probe_conn = load.app.connection_for_write()
            probe_conn.default_channel  # noqa: B018 (connects)
            outcome.died_at = cluster.kill(leader)
            detection = timing.ttl + timing.loop_wait + timing.retry_timeout + 30
            promoted: list[float] = []
            watcher = threading.Thread(
                target=lambda: promoted.append(
                    cluster.wait_leader(other_than=leader, timeout=detection)[1]
                )
            )
            watcher.start()
            # Published now, ahead of the backlog: its publish returns once the producer
            # found the new leader, and it runs once a worker has too.
            probe = load.probe(probe_conn)
            outcome.probe_published_at = outcome.published[probe]
            outcome.probe_ran_at = load.ran_at(
                probe, detection, "the probe to run on the new leader"
            )
            watcher.join(detection)
            assert promoted, "Patroni promoted no member"
            outcome.promoted_at = promoted[0]
            # A second of publishing to the new leader (returned publishes count).
            wait_for(
                lambda: outcome.last_published > outcome.probe_ran_at + 1,
                30,
                "publishing to go on after the failover",
            )
            load.stop()
            load.wait_all_ran(120)
            # A task could still run twice only while its message is in the queue (a
            # lease that lapsed is claimed again): wait until every message is acked.
            wait_for(
                lambda: queued(cluster) == 0,
                (vt or 30) + 30,
                "every message to be acked",
                step=0.5,
            )
        return outcome
    finally:
        cluster_cm.__exit__(None, None, None)


def test_patroni_failover_in_synchronous_mode_loses_nothing_and_runs_nothing_twice(
    record: Record,
) -> None:
    outcome = fail_over(record, SHORT)
    label = f"ttl {SHORT.ttl} s, loop_wait {SHORT.loop_wait} s"
    print(outcome.report(label))
    assert outcome.lost == set(), outcome.report(label)
    assert outcome.duplicates == 0, outcome.report(label)


def test_patroni_defaults_fail_over_within_the_fenced_retry_window(record: Record) -> None:
    # Patroni's defaults promote up to ~40 s after the leader died: within the 60 s the
    # workers' acks keep trying, but past the default 30 s lease, so the lease here is 60 s.
    outcome = fail_over(record, DEFAULTS, vt=60)
    label = f"Patroni defaults: ttl {DEFAULTS.ttl} s, loop_wait {DEFAULTS.loop_wait} s"
    print(outcome.report(label))
    assert outcome.lost == set(), outcome.report(label)
    assert outcome.duplicates == 0, outcome.report(label)
