"""Failover under real workers: a primary and a streaming standby, the primary crashed
while the standby had stopped receiving, the standby promoted.

Two Celery workers (4 threads each, acks_late) and a producer (Celery's publish retry) use
one multi-host URL with ``target_session_attrs=read-write``. The run: a backlog and a
steady trickle of tasks; replication stalls for :data:`STALL` seconds (the standby
receives nothing); the primary is stopped with ``-m immediate``; the standby is
promoted; every task published (its publish returned) must then run.

- Synchronous replication (runs by default): nothing is lost, and a task runs twice only
  if a worker held it at the stall (its ack could not reach the standby): at most
  workers times prefetch. With ``durable_acks=off`` (on request: ``pytest -m failover``),
  acks made during the stall vanish with the primary and many more tasks run again.
- Asynchronous replication (on request): publishes that returned during the stall are
  lost, and only those: the loss window is the standby's lag.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from tests.acceptance.cluster import ClusterUnavailable
from tests.acceptance.failover_load import (
    CONCURRENCY,
    SCHEMA,
    WORKERS,
    Record,
    Tally,
    migrate,
    under_load,
)
from tests.acceptance.replication import replicated_pair

# The servers that fail are a pair of their own; on the test server only the runs are
# recorded (measured peak 4, -n 0).
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(4)]

PREFETCH = 4  # failover_app's worker_prefetch_multiplier
#: Deliveries a worker holds at once (running and prefetched).
HELD = CONCURRENCY * PREFETCH
STALL = 2.0
VT = 4
#: Seconds from the crash to the promotion in the late-promotion case (past the 5 s the
#: fenced retries had before they followed the deployment).
LATE_PROMOTION = 8.0


@dataclass
class Outcome(Tally):
    stalled_at: float = 0.0
    crashed_at: float = 0.0
    promoted_at: float = 0.0
    first_run_after_promotion: float | None = None

    def report(self, label: str) -> str:
        after = self.first_run_after_promotion
        return (
            f"failover [{label}]: published {len(self.published)}, "
            f"lost {len(self.lost)}, duplicate runs {self.duplicates}, "
            f"tasks flow again {after:.2f} s after promotion"
            if after is not None
            else f"failover [{label}]: no task published after promotion ran"
        )


def fail_over(
    record: Record,
    *,
    synchronous: bool,
    durable_acks: str,
    promote_after: float = 0.0,
    vt: float = VT,
) -> Outcome:
    """``promote_after``: seconds between the crash and the promotion (a failover
    manager's detection time)."""
    try:
        pair_cm = replicated_pair(synchronous=synchronous)
        pair = pair_cm.__enter__()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    outcome = Outcome()
    try:
        environ = {"PGQ_VISIBILITY_TIMEOUT": str(vt), "PGQ_DURABLE_ACKS": durable_acks}
        # Through the failover: the promotion takes a second or two.
        with under_load(
            pair.url(), pair.primary.url(), record, outcome, retries=200, environ=environ
        ) as load:
            outcome.stalled_at = time.time()
            pair.link.pause()  # the standby receives nothing from here on
            time.sleep(STALL)  # the length of the stall is the scenario, not an ordering
            pair.crash_primary()
            outcome.crashed_at = time.time()  # (pg_ctl stop -m immediate has returned)
            time.sleep(promote_after)  # the failover manager's delay is the scenario
            pair.promote()
            outcome.promoted_at = time.time()
            # Tasks flowing again: a probe published now, ahead of the backlog, runs
            # once a producer and a worker have both found the new primary.
            probe = load.probe()
            probe_at = load.ran_at(probe, 60, "the probe to run after the promotion")
            outcome.first_run_after_promotion = probe_at - outcome.promoted_at
            time.sleep(1.0)  # a second of publishing after the promotion
            load.stop()
            if synchronous:
                load.wait_all_ran(vt * 3 + 30)
            else:
                # What was not lost runs: the queue drains (a delivery a crashed
                # primary's worker held comes back after its lease).
                load.wait_drained(pair.url(), vt * 3 + 30)
        return outcome
    finally:
        pair_cm.__exit__(None, None, None)


def test_synchronous_replication_loses_nothing_and_runs_again_only_what_workers_held(
    record: Record,
) -> None:
    outcome = fail_over(record, synchronous=True, durable_acks="auto")
    print(outcome.report("synchronous, durable_acks=auto"))
    assert outcome.lost == set()
    # A duplicate is a delivery held at the stall: its ack could not reach the standby.
    assert outcome.duplicates <= len(WORKERS) * HELD, outcome.report("synchronous")


@pytest.mark.failover
def test_a_promotion_later_than_five_seconds_but_within_the_lease_runs_nothing_twice(
    record: Record,
) -> None:
    # The acks the workers made when the primary crashed keep trying past the 5 s they
    # had before (a failover manager promotes later: Patroni's defaults, up to ~40 s),
    # and land on the new primary within the lease.
    outcome = fail_over(
        record, synchronous=True, durable_acks="auto", promote_after=LATE_PROMOTION, vt=15
    )
    print(outcome.report(f"synchronous, promoted {LATE_PROMOTION:g} s after the crash"))
    assert outcome.lost == set()
    assert outcome.duplicates == 0, outcome.report("late promotion")


@pytest.mark.failover
def test_relaxed_acks_under_synchronous_replication_run_acked_tasks_again(
    record: Record,
) -> None:
    outcome = fail_over(record, synchronous=True, durable_acks="off")
    print(outcome.report("synchronous, durable_acks=off"))
    assert outcome.lost == set()
    # The acks of the stall returned without the standby and vanished with the primary.
    assert outcome.duplicates > len(WORKERS) * HELD, outcome.report("durable_acks=off")


@pytest.mark.failover
def test_asynchronous_replication_loses_what_was_published_while_the_standby_lagged(
    record: Record,
) -> None:
    outcome = fail_over(record, synchronous=False, durable_acks="auto")
    print(outcome.report("asynchronous"))
    lost_at = sorted(outcome.published[task] for task in outcome.lost)
    assert lost_at, "a standby that received nothing for the stall lost nothing"
    # Only publishes that returned while the standby received nothing are lost.
    assert outcome.stalled_at <= lost_at[0] and lost_at[-1] <= outcome.crashed_at
    print(
        f"asynchronous loss window: {len(lost_at)} publishes returned in the "
        f"{outcome.crashed_at - outcome.stalled_at:.1f} s the standby lagged"
    )


def test_durable_acks_auto_waits_on_a_server_with_synchronous_standbys() -> None:
    # (On a server without them, auto is relaxed: tests/integration/test_transport.py.)
    from kombu import Connection

    try:
        pair_cm = replicated_pair(synchronous=True)
        pair = pair_cm.__enter__()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    try:
        migrate(pair.primary.url())
        for durable_acks, expected in (("auto", "on"), ("on", "on"), ("off", "off")):
            options = {"schema": SCHEMA, "durable_acks": durable_acks}
            with Connection(pair.url("pgq"), transport_options=options) as conn:
                conn.connect()
                with conn.transport.relaxed.connection() as session:
                    row = session.execute("SHOW synchronous_commit").fetchone()
                assert row is not None and row[0] == expected, durable_acks
    finally:
        pair_cm.__exit__(None, None, None)
