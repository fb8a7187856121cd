"""The broker benchmark's per-task figures and its background load (benchmarks.procstat)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import procstat
from benchmarks.brokers import parse_args

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_per_task_figures_are_the_difference_of_two_samples_over_the_tasks() -> None:
    # This process as the worker, a child that sleeps as its pool.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first = procstat.sample(os.getpid(), [os.getpid()])
        assert first is not None
        _spin(0.2)
        last = procstat.sample(os.getpid(), [os.getpid()])
        assert last is not None
    finally:
        child.kill()
        child.wait()
    assert last["children"]["processes"] >= 1
    assert last["main"]["threads"] >= 1
    found = procstat.per_task(first, last, 100)
    # 0.2 s of CPU over 100 tasks: about 2,000 us each, in the worker and in the
    # "server" (the same process here); the sleeping child spent next to nothing.
    assert 1_500 <= found["main"]["cpu_us"] <= 20_000
    # Read from /proc one after the other: this process's other threads may have run a
    # clock tick in between (a tick over 100 tasks is 100 us each at 100 Hz).
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / 100
    assert abs(found["server"]["cpu_us"] - found["main"]["cpu_us"]) <= 2 * tick_us
    assert found["children"]["cpu_us"] < 500
    assert found["tasks"] == 100


def test_busy_loops_run_for_the_block_and_are_gone_after() -> None:
    with procstat.busy_loops(2) as pids:
        assert len(pids) == 2
        # Spinning: each accrues CPU time of its own.
        deadline = time.monotonic() + 30
        while not all(_cpu(pid) > 0.05 for pid in pids):
            assert time.monotonic() < deadline, "the busy loops never ran"
            time.sleep(0.05)
        # Nice 0, or this process's own where it may not lower it.
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(os.getpriority(os.PRIO_PROCESS, pid) in (0, mine) for pid in pids)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def _cpu(pid: int) -> float:
    found = procstat.sample(pid)
    return found["main"]["cpu_s"] if found is not None else 0.0


def test_background_load_is_an_option_of_the_broker_benchmark() -> None:
    assert parse_args([]).background_load == 0
    assert parse_args(["--background-load", "2"]).background_load == 2
    with pytest.raises(SystemExit):
        parse_args(["--background-load", "-1"])
