"""A test session's database is dropped by the next session when its own run was killed,
never while the session that made it is still running (other runs share the server).

Each "session" here is a real process that makes its session database the way pytest's
does (``tests.pg.session_database``) and holds it until told to end or killed with
SIGKILL; every test uses a name prefix of its own (PGQ_TEST_DB_PREFIX), so nothing it
drops can be another run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.acceptance.harness import wait_for
from tests.pg import (
    DEFAULT_DB_PREFIX,
    RUN_DIR_ENV,
    RunMeter,
    create_database,
    database_prefix,
    drop_abandoned_databases,
    drop_database,
    find_postgres,
    metered_database,
)

ROOT = Path(__file__).resolve().parents[2]
SESSION = """
import sys
from urllib.parse import unquote, urlsplit
from tests.pg import drop_session_database, session_database
print(unquote(urlsplit(session_database()).path[1:]), flush=True)
sys.stdin.read()
drop_session_database()
"""


def databases(server: str, prefix: str) -> set[str]:
    with psycopg.connect(server) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", [prefix]
        ).fetchall()
    return {str(name) for (name,) in rows}


def backend_alive(server: str, pid: int) -> bool:
    with psycopg.connect(server) as conn:
        row = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return row is not None


class Session:
    def __init__(self, server: str, prefix: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
        env.update(PGQ_TEST_URL=server, PGQ_TEST_DB_PREFIX=prefix, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SESSION],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.name = ""

    def started(self) -> str:
        """The session database's name, once the session has made it."""
        assert self.proc.stdout is not None
        self.name = self.proc.stdout.readline().strip()
        assert self.name, f"session exited with {self.proc.wait()}"
        return self.name

    @property
    def keeper_pid(self) -> int:
        return int(self.name.rsplit("_", 2)[-2])

    def end(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(60)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix of this test's own; whatever databases it names are dropped afterwards."""
    name = f"pgq_t_c{uuid.uuid4().hex[:8]}_"
    yield name
    server = find_postgres()
    for db in databases(server, name):
        drop_database(server, db)


def test_a_killed_sessions_database_is_dropped_by_the_next_session_and_live_ones_kept(
    prefix: str,
) -> None:
    server = find_postgres()
    # Sessions start side by side, each dropping what it takes for abandoned as it starts.
    live = [Session(server, prefix) for _ in range(2)]
    killed = Session(server, prefix)
    sessions = [*live, killed]
    try:
        names = {s.started() for s in sessions}
        assert databases(server, prefix) == names
        # Named with the prefix but not as a session: not this cleanup's to judge.
        foreign = f"{prefix}kept"
        create_database(server, foreign)

        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait(30)
        # Its keeper's backend ends when the server sees the connection closed.
        wait_for(
            lambda: not backend_alive(server, killed.keeper_pid),
            60,
            "the killed session's keeper backend to end",
        )
        assert killed.name in databases(server, prefix)  # left behind, as the issue says

        following = Session(server, prefix)
        sessions.append(following)
        following.started()
        assert databases(server, prefix) == {*(s.name for s in live), following.name, foreign}
    finally:
        for s in sessions:  # ended side by side: each drop waits for a checkpoint
            if s.proc.poll() is None and s.proc.stdin is not None:
                s.proc.stdin.close()
        for s in sessions:
            s.end()
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(30)
    # A session that ends drops its own database.
    assert databases(server, prefix) == {foreign}


def test_this_runs_own_database_is_never_taken_for_abandoned(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    own = str(row[0])
    dropped = drop_abandoned_databases(find_postgres(), database_prefix())
    assert own not in dropped
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_the_session_database_is_named_with_the_chosen_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGQ_TEST_DB_PREFIX", raising=False)
    assert database_prefix() == DEFAULT_DB_PREFIX
    monkeypatch.setenv("PGQ_TEST_DB_PREFIX", "ci_job_17_")
    assert database_prefix() == "ci_job_17_"
    monkeypatch.setenv("PGQ_TEST_DB_PREFIX", "x" * 41)
    with pytest.raises(ValueError, match=r"PGQ_TEST_DB_PREFIX .* is too long"):
        database_prefix()


@pytest.mark.sessions(8)
def test_a_parallel_runs_meter_counts_the_databases_its_tests_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions on a database a test made for itself share the server's connections with
    the run's: the run's meter counts them, against the process whose test made it."""
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    # The process's own database, where nobody is connected: what the meter sees is
    # the made one's.
    quiet = f"{database_prefix()}quiet_{uuid.uuid4().hex[:8]}"
    create_database(find_postgres(), quiet)
    (tmp_path / "db-gw7").write_text(quiet)
    (tmp_path / "running-gw7").write_text("3\tsome/test.py::made_a_database")
    name = f"{database_prefix()}made_{uuid.uuid4().hex[:8]}"
    url = create_database(find_postgres(), name)
    meter = RunMeter(find_postgres(), tmp_path, interval=0.02)
    meter.start()
    try:
        metered_database(name)
        assert (tmp_path / f"db-gw7+{name}").read_text() == name
        with psycopg.connect(url) as a, psycopg.connect(url) as b:
            assert a.execute("SELECT 1").fetchone() == b.execute("SELECT 1").fetchone()
            # Both sessions stay open until the meter has seen them (its own bound).
            wait_for(lambda: meter.peak >= 2, 30, "the meter to see the made database")
    finally:
        meter.stop()
        drop_database(find_postgres(), name)
        drop_database(find_postgres(), quiet)
    assert meter.peak == 2
    assert meter.by_test["some/test.py::made_a_database"] == (2, 3)
