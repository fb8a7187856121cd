"""A worker the broker refuses: its heartbeat says so (``pgq health`` fails) until it
connects, the heartbeat watching the back-off (nothing below ops/ imports ops/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pg_transport import backoff
from pg_transport.ops import health


def test_a_refused_worker_fails_its_health_check_until_it_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beat = tmp_path / "worker.heartbeat"
    monkeypatch.setenv(health.FILE_ENV, str(beat))
    monkeypatch.setattr(health, "_current", [])
    refusals = backoff.Backoff(sleep=lambda seconds: None)
    monkeypatch.setattr(backoff, "BACKOFF", refusals)  # the process's, as the worker's
    step = health.HeartbeatStep(object())  # the worker's consumer step: it watches
    step.heartbeat.start()
    assert health.check(beat, 3600).healthy
    refusals.enable()  # this process is the worker
    refusals.refused(RuntimeError('password authentication failed for user "w"'))
    found = health.check(beat, 3600)
    assert not found.healthy, found
    assert "refused by the broker" in found.message
    assert "password authentication failed" in found.message
    refusals.refused(RuntimeError("password authentication failed again"))
    assert not health.check(beat, 3600).healthy
    refusals.connected()
    assert health.check(beat, 3600).healthy


def test_a_watcher_given_twice_is_told_once_and_only_in_the_worker() -> None:
    # (the worker builds its heartbeat step again at each reconnect)
    told: list[str | None] = []

    def watcher(since: float | None, why: str | None) -> None:
        assert (since is None) == (why is None)
        told.append(why)

    refusals = backoff.Backoff(sleep=lambda seconds: None)
    refusals.watch(watcher)
    refusals.watch(watcher)
    refusals.refused(RuntimeError("not a worker"))  # an application: refused at once
    assert told == []
    refusals.enable()
    refusals.refused(RuntimeError("no such database"))
    refusals.connected()
    assert told == ["no such database", None]
