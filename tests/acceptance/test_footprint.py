"""How many Postgres sessions a prefork worker at concurrency 8 and a producer hold.

docs/configuration.md gives the footprint per process and the formula for
``max_connections``; this checks it from pg_stat_activity while the pool children
publish (each task publishes the next one) and after everything went idle, with
``pool_idle_timeout`` shortened so the idle sessions close within the test.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter

import psycopg
import pytest

from tests.acceptance.harness import ROOT, Env, wait_for, workers

pytestmark = pytest.mark.acceptance

APP = "tests.acceptance.timing_app"
IDLE_TIMEOUT = "2"
PRODUCER = """
import sys, time
from tests.acceptance.timing_app import relay
for _ in range(40):
    relay.delay(3)
print("sent", flush=True)
sys.stdin.readline()  # stay alive, idle, until told
"""

# The documented footprint (docs/configuration.md, "Connections").
PARENT_MOST = 4  # the idle ones and a publish's for a moment (3 seen), or a VACUUM's
PARENT_IDLE = 2  # the consumer's session, queue maintenance and vacuum check
CHILD_MOST = 1  # a child publishing: one session, closed once idle
PRODUCER_MOST = 1  # one publishing thread: one session, closed once idle


def descendants(pid: int) -> set[int]:
    """The processes forked from ``pid``, and theirs (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = {int(c) for c in f.read().split()}
    except FileNotFoundError:
        return set()
    return children.union(*(descendants(c) for c in children))


class Sampler:
    """Sessions per pid (from application_name ``…:<pid>``) every few ms, and the most seen."""

    def __init__(self, pg_url: str) -> None:
        self.pg_url = pg_url
        self.most: Counter[int] = Counter()
        self.total_most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> Counter[int]:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            return self._count(conn)

    @staticmethod
    def _count(conn: psycopg.Connection) -> Counter[int]:
        rows = conn.execute(
            "SELECT split_part(application_name, ':', 2)::int, count(*)"
            " FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name ~ '^pgq[a-z-]*:[0-9]+(:|$)' GROUP BY 1"
        ).fetchall()
        return Counter({int(pid): int(n) for pid, n in rows})

    def _run(self) -> None:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            while not self._stop.wait(0.02):
                seen = self._count(conn)
                self.total_most = max(self.total_most, sum(seen.values()))
                for pid, n in seen.items():
                    self.most[pid] = max(self.most[pid], n)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.sessions(19)  # 14 seen (5 runs, -n 0), 17 side by side
def test_a_prefork_worker_and_a_producer_hold_what_the_docs_say(env: Env) -> None:
    idle = {"PGQ_POOL_IDLE_TIMEOUT": IDLE_TIMEOUT}
    with workers(env, "footprint", pool="prefork", concurrency=8, app=APP, environ=idle) as (
        worker,
    ):
        parent = worker.proc.pid
        with Sampler(env.pg_url) as sampler:
            producer = subprocess.Popen(
                [sys.executable, "-c", PRODUCER],
                cwd=ROOT,
                env=env.environ(**idle),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert producer.stdout is not None and producer.stdout.readline() == "sent\n"
                # 40 chains of 4 tasks, the last 3 of each published by a pool child.
                wait_for(
                    lambda: (
                        env.scalar("SELECT count(*) FROM {schema}.message") == 0 and sampler.most
                    ),
                    60,
                    "every relay to run",
                )
                # Only these processes count: the test's own (pytest's) pools are no part.
                pool = descendants(parent)
                ours = {parent, producer.pid, *pool}
                busy = {p: n for p, n in sampler.most.items() if p in ours}
                children = {p: n for p, n in busy.items() if p in pool}
                # Idle now: every pool session closes after pool_idle_timeout.
                wait_for(
                    lambda: set(sampler.now()) & ours <= {parent},
                    20,
                    "the children's and the producer's idle sessions to close",
                )
                after = sampler.now()
                assert producer.poll() is None  # still running: closed because idle
            finally:
                producer.communicate("\n", timeout=30)
    assert children, busy  # the children did publish
    assert len(children) <= 8
    assert max(children.values()) <= CHILD_MOST, busy
    assert busy.get(producer.pid, 0) <= PRODUCER_MOST, busy
    assert busy[parent] <= PARENT_MOST, busy
    assert after[parent] <= PARENT_IDLE, after
    assert sum(busy.values()) <= PARENT_MOST + 8 * CHILD_MOST + PRODUCER_MOST, busy
