"""The compose healthcheck's two halves without a worker: the heartbeat and `pgq health`.

tests/acceptance/test_compose.py runs them together in real workers; here each piece
is driven directly, with an injected clock, so the edges (rate limit, missing file,
a drain that raises) are exact.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from pg_transport.ops import health
from pg_transport.ops.cli import main
from tests.clock import Clock


def age_file(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_start_writes_who_is_beating(tmp_path: Path) -> None:
    beat = health.Heartbeat(tmp_path / "sub" / "hb")
    beat.start()
    info = json.loads((tmp_path / "sub" / "hb").read_text())
    assert info["pid"] == os.getpid()
    assert info["hostname"] == socket.gethostname()
    assert list((tmp_path / "sub").iterdir()) == [tmp_path / "sub" / "hb"]  # no temp file left


def test_beat_refreshes_at_most_once_per_interval(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "hb"
    beat = health.Heartbeat(path, min_interval=1.0, clock=clock)
    beat.start()
    age_file(path, 50)
    clock.now += 0.5
    beat.beat()  # within the interval of start(): no write
    assert time.time() - path.stat().st_mtime > 40
    clock.now += 0.6
    beat.beat()
    assert time.time() - path.stat().st_mtime < 5


def test_beat_rewrites_a_file_removed_behind_its_back(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "hb"
    beat = health.Heartbeat(path, clock=clock)
    beat.start()
    path.unlink()
    clock.now += 5
    beat.beat()
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_unwritable_location_warns_once_and_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    beat = health.Heartbeat(blocker / "hb")  # a path under a regular file
    beat.start()
    beat.start()
    warnings = [r for r in caplog.records if "cannot write the pgq heartbeat" in r.message]
    assert len(warnings) == 1


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of someone else's that a symlink at the heartbeat path points to."""
    target = tmp_path / "victim"
    target.write_text("precious")
    age_file(target, 1000)
    return target


def untouched(victim: Path) -> bool:
    return victim.read_text() == "precious" and time.time() - victim.stat().st_mtime > 900


def test_a_symlink_planted_at_the_path_is_replaced_not_written_through(
    tmp_path: Path, victim: Path
) -> None:
    path = tmp_path / "hb"
    path.symlink_to(victim)
    clock = Clock()
    beat = health.Heartbeat(path, clock=clock)
    beat.start()
    assert untouched(victim)
    assert not path.is_symlink()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hb", "victim"]  # no temp file left


def test_a_symlink_swapped_in_later_is_never_followed_nor_removed(
    tmp_path: Path, victim: Path
) -> None:
    path = tmp_path / "hb"
    clock = Clock()
    beat = health.Heartbeat(path, clock=clock)
    beat.start()
    path.unlink()
    path.symlink_to(victim)  # between two beats
    clock.now += 5
    beat.beat()
    assert untouched(victim)
    assert not path.is_symlink() and json.loads(path.read_text())["pid"] == os.getpid()

    path.unlink()
    path.symlink_to(victim)
    beat.clear()  # not the file it wrote: left alone, and its target too
    assert path.is_symlink() and untouched(victim)


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory, as $TMPDIR would set it: the default location is in it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(health.FILE_ENV, raising=False)
    return tmp_path


def test_the_default_location_is_a_private_directory_pgq_health_reads(
    private_tmp: Path,
) -> None:
    default = health.default_file()
    assert default.parent == private_tmp / f"pgq-{os.getuid()}"
    health.Heartbeat(health.heartbeat_path(os.environ)).start()
    found = default.parent.lstat()
    assert stat.S_ISDIR(found.st_mode) and stat.S_IMODE(found.st_mode) == 0o700
    assert found.st_uid == os.getuid()
    assert json.loads(default.read_text())["pid"] == os.getpid()
    ok = invoke_health()  # no --file, no PGQ_HEALTH_FILE: the same default
    assert ok.exit_code == 0, ok.output
    # And so does the command run as a process of its own, given the same $TMPDIR.
    result = subprocess.run(
        [sys.executable, "-m", "pg_transport.ops.cli", "health"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(private_tmp)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"healthy: worker pid {os.getpid()}")


def make_unsafe(directory: Path, how: str) -> str:
    """Prepare ``directory`` as someone else could have; the refusal expected."""
    if how == "world-writable":
        directory.mkdir()
        directory.chmod(0o777)  # after mkdir: the umask would have narrowed it
        return "has mode 0777, open to other users (it must be 0700)"
    if how == "group-readable":
        directory.mkdir()
        directory.chmod(0o750)
        return "has mode 0750, open to other users"
    if how == "symlink":
        elsewhere = directory.with_name("elsewhere")
        elsewhere.mkdir(mode=0o700)
        directory.symlink_to(elsewhere)
        return "is not a directory (a symlink or a file is in its place)"
    assert how == "someone else's"
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    return "belongs to uid 65534, not to this user"


@pytest.mark.parametrize("how", ["world-writable", "group-readable", "symlink", "someone else's"])
def test_an_unsafe_default_directory_is_refused_by_worker_and_check(
    private_tmp: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = health.default_dir()
    refusal = make_unsafe(directory, how)
    health.Heartbeat(health.default_file()).start()
    [warning] = [
        r.getMessage() for r in caplog.records if "cannot write the pgq heartbeat" in r.getMessage()
    ]
    assert refusal in warning and health.FILE_ENV in warning
    assert not health.default_file().exists()

    # A fresh heartbeat planted in it must not pass for a live worker.
    planted = directory / health.default_file().name
    planted.write_text("{}")
    result = invoke_health()
    assert result.exit_code == 1
    assert refusal in result.stderr and "refusing it for the heartbeat" in result.stderr


def test_check_fresh_stale_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    missing = health.check(path, 30)
    assert not missing.healthy and missing.age is None
    assert "no heartbeat file" in missing.message and health.FILE_ENV in missing.message

    health.Heartbeat(path).start()
    mtime = path.stat().st_mtime
    fresh = health.check(path, 30, now=mtime + 29)
    assert fresh.healthy and fresh.age == pytest.approx(29)
    assert f"pid {os.getpid()}" in fresh.message

    stale = health.check(path, 30, now=mtime + 31)
    assert not stale.healthy
    assert "has not consumed for 31.0s (stale after 30s" in stale.message


class FakeConnection:
    def __init__(self, *, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.calls: list[dict[str, Any]] = []

    def drain_events(self, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        if self.raises is not None:
            raise self.raises
        return "drained"


def make_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> health.HeartbeatStep:
    monkeypatch.setenv(health.FILE_ENV, str(tmp_path / "hb"))
    step = health.HeartbeatStep(SimpleNamespace())
    step.heartbeat.min_interval = 0.0
    return step


def test_step_beats_after_every_drain_even_an_idle_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = make_step(tmp_path, monkeypatch)
    idle = FakeConnection(raises=TimeoutError())
    consumer = SimpleNamespace(hub=None, connection=idle)
    step.start(consumer)
    path = tmp_path / "hb"
    assert path.exists()
    age_file(path, 100)
    # Celery's synloop: connection.drain_events(timeout=2.0); an idle poll times out.
    with pytest.raises(TimeoutError):
        consumer.connection.drain_events(timeout=2.0)
    assert idle.calls == [{"timeout": 2.0}]
    assert health.check(path, 5).healthy


def test_step_does_not_beat_while_a_drain_has_not_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = make_step(tmp_path, monkeypatch)
    path = tmp_path / "hb"
    seen: list[bool] = []

    class Stuck(FakeConnection):
        def drain_events(self, **kwargs: Any) -> str:
            # Inside the drain, the file is as old as it was before it started.
            seen.append(health.check(path, 5).healthy)
            return "drained"

    consumer = SimpleNamespace(hub=None, connection=Stuck())
    step.start(consumer)
    age_file(path, 100)
    assert consumer.connection.drain_events(timeout=2.0) == "drained"
    assert seen == [False]
    assert health.check(path, 5).healthy


def test_step_restarted_on_the_same_connection_wraps_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = make_step(tmp_path, monkeypatch)
    connection = FakeConnection()
    consumer = SimpleNamespace(hub=None, connection=connection)
    step.start(consumer)
    wrapped = consumer.connection.drain_events
    step.stop(consumer)
    step.start(consumer)
    assert consumer.connection.drain_events is wrapped
    assert consumer.connection.drain_events(timeout=2.0) == "drained"
    assert connection.calls == [{"timeout": 2.0}]


def test_step_with_an_event_loop_beats_from_a_hub_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = make_step(tmp_path, monkeypatch)
    registered: list[tuple[float, Any]] = []
    cancelled: list[bool] = []

    class Hub:
        def call_repeatedly(self, interval: float, fun: Any) -> Any:
            registered.append((interval, fun))
            return SimpleNamespace(cancel=lambda: cancelled.append(True))

    step.start(SimpleNamespace(hub=Hub(), connection=FakeConnection()))
    [(interval, fun)] = registered
    assert interval == health.MIN_BEAT_INTERVAL
    age_file(tmp_path / "hb", 100)
    fun()
    assert health.check(tmp_path / "hb", 5).healthy
    step.stop(SimpleNamespace())
    assert cancelled == [True]


def test_step_shutdown_removes_the_file_but_a_reconnect_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = make_step(tmp_path, monkeypatch)
    consumer = SimpleNamespace(hub=None, connection=FakeConnection())
    step.start(consumer)
    step.stop(consumer)
    assert (tmp_path / "hb").exists()
    step.shutdown(consumer)
    assert not (tmp_path / "hb").exists()


def invoke_health(*args: str, **env: str) -> Any:
    base: dict[str, str | None] = {health.FILE_ENV: None, health.STALE_ENV: None}
    return CliRunner(env={**base, **env}).invoke(main, ["health", *args])


def test_pgq_health_exit_codes_follow_the_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    missing = invoke_health("--file", str(path))
    assert missing.exit_code == 1
    assert missing.stderr.startswith("Error: no heartbeat file")

    health.Heartbeat(path).start()
    ok = invoke_health(**{health.FILE_ENV: str(path), health.STALE_ENV: "30"})
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.startswith("healthy: worker pid")

    age_file(path, 45)
    stale = invoke_health(**{health.FILE_ENV: str(path), health.STALE_ENV: "30"})
    assert stale.exit_code == 1
    assert "has not consumed for 45" in stale.stderr and len(stale.stderr.splitlines()) == 1
    assert invoke_health("--file", str(path), "--stale-after", "60").exit_code == 0


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_pgq_health_refuses_a_bad_threshold(tmp_path: Path, value: str) -> None:
    result = invoke_health("--file", str(tmp_path / "hb"), **{health.STALE_ENV: value})
    assert result.exit_code == 2
    assert "--stale-after" in result.stderr


def test_stuck_counts_from_the_first_beat_with_tasks_waiting_and_none_running() -> None:
    stuck = health.Stuck()
    assert stuck.observe(0, 0, now=1.0) is None  # idle
    assert stuck.observe(3, 2, now=2.0) is None  # a full pool, tasks queued behind it
    assert stuck.observe(2, 0, now=3.0) == 3.0
    assert stuck.observe(4, 0, now=9.0) == 3.0  # still: since the first
    assert stuck.observe(4, 1, now=10.0) is None  # the pool started one
    assert stuck.observe(1, 0, now=11.0) == 11.0


class Request:
    """Stands for a Celery request in the worker's state (weakly referenced there)."""


def test_a_worker_holding_tasks_its_pool_never_starts_turns_unhealthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.worker import state

    step = make_step(tmp_path, monkeypatch)
    consumer = SimpleNamespace(hub=None, connection=FakeConnection())
    step.start(consumer)
    path = tmp_path / "hb"
    waiting, running = Request(), Request()
    try:
        state.reserved_requests.add(waiting)
        consumer.connection.drain_events(timeout=2.0)
        since = json.loads(path.read_text())["stuck_since"]
        # The loop keeps turning (fresh beats): healthy until the threshold has passed.
        consumer.connection.drain_events(timeout=2.0)
        assert health.check(path, 30, now=since + 29).healthy
        found = health.check(path, 30, now=since + 31)
        assert not found.healthy
        assert "has held 1 task(s) without starting any for 31.0s" in found.message
        # The threshold below is 1 ms: let that much pass since the first stuck beat (a
        # warm run gets here within it, and then finds nothing stuck yet).
        while time.time() <= since + 0.01:
            time.sleep(0.002)
        result = invoke_health(**{health.FILE_ENV: str(path), health.STALE_ENV: "0.001"})
        assert result.exit_code == 1 and "while its pool runs nothing" in result.stderr
        # The pool starts something: no longer stuck.
        state.active_requests.add(running)
        state.reserved_requests.add(running)
        consumer.connection.drain_events(timeout=2.0)
        assert "stuck_since" not in json.loads(path.read_text())
        assert health.check(path, 30).healthy
    finally:
        state.reserved_requests.clear()
        state.active_requests.clear()
