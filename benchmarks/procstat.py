"""What a worker costs per task, read from ``/proc``, and a fixed background CPU load.

A drain's rate depends on whatever else the machine runs; the CPU time and context
switches a worker spends per task much less. :func:`sample` reads them for a worker's
main process (the consumer: with prefork, the parent that claims, acks and hands tasks
to the pool) and its pool children, summed over their threads; :func:`per_task` divides
the difference of two samples by the tasks run in between. The broker's own processes
are read too where they run on this host: a pgq worker's Postgres backends (its claims
run there), RabbitMQ's ``beam.smp`` (which serves whoever else uses it too).

:func:`busy_loops` starts a fixed CPU load (N processes spinning at nice 0) and stops it
again: the same load for every broker, so a loaded drain is compared under like terms.
Linux only (``/proc``); elsewhere :func:`sample` returns None and the figures are left out.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["busy_loops", "children_of", "cpu_of", "named", "per_task", "pgq_backends", "sample"]

PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A busy loop: nothing but CPU (no syscalls once started).
BUSY = "while True:\n    pass\n"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process or thread ended meanwhile
        return None


def _cpu_seconds(stat: str) -> float:
    # Fields after the command name (which may hold spaces) in parentheses.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def cpu_of(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds (utime + stime) of each of ``pids`` still running."""
    found: dict[int, float] = {}
    for pid in pids:
        stat = _read(PROC / str(pid) / "stat")
        if stat is not None:
            found[pid] = _cpu_seconds(stat)
    return found


def _switches(status: str) -> tuple[int, int]:
    found = dict(
        line.split(":", 1) for line in status.splitlines() if line.endswith(tuple("0123456789"))
    )
    return int(found.get("voluntary_ctxt_switches", 0)), int(
        found.get("nonvoluntary_ctxt_switches", 0)
    )


def _process(pid: int) -> dict[str, float] | None:
    """CPU seconds and context switches of one process, summed over its threads."""
    stat = _read(PROC / str(pid) / "stat")
    if stat is None:
        return None
    voluntary = involuntary = 0
    threads = 0
    for task in (PROC / str(pid) / "task").glob("*"):
        status = _read(task / "status")
        if status is None:
            continue
        v, i = _switches(status)
        voluntary, involuntary, threads = voluntary + v, involuntary + i, threads + 1
    return {
        "cpu_s": _cpu_seconds(stat),
        "voluntary_switches": voluntary,
        "involuntary_switches": involuntary,
        "threads": threads,
    }


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in (PROC / str(pid) / "task").glob("*"):
        text = _read(task / "children")
        if text:
            kids.extend(int(k) for k in text.split())
    return kids


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (its pool's, for a worker)."""
    return _children(pid)


def sample(pid: int, server: Sequence[int] = ()) -> dict[str, Any] | None:
    """The worker main process ``pid`` and its children (summed) now, and the broker's
    own processes ``server`` (summed, those on this host); None off Linux."""
    main = _process(pid)
    if main is None:
        return None
    serving = {"cpu_s": 0.0, "voluntary_switches": 0.0, "involuntary_switches": 0.0}
    for other in server:
        found = _process(other)
        if found is not None:
            for key in serving:
                serving[key] += found[key]
    total = {"cpu_s": 0.0, "voluntary_switches": 0.0, "involuntary_switches": 0.0}
    count = 0
    for kid in _children(pid):
        found = _process(kid)
        if found is not None:
            count += 1
            for key in total:
                total[key] += found[key]
    return {
        "main": main,
        "children": {**total, "processes": count},
        "server": {**serving, "processes": len(server)},
    }


def per_task(first: dict[str, Any], last: dict[str, Any], tasks: int) -> dict[str, Any]:
    """Per task between two samples: CPU microseconds and context switches of the main
    process and of the children (children that exited in between are not counted)."""
    out: dict[str, Any] = {"tasks": tasks}
    n = max(tasks, 1)
    for part in ("main", "children", "server"):
        a, b = first[part], last[part]
        out[part] = {
            "cpu_us": round((b["cpu_s"] - a["cpu_s"]) * 1e6 / n, 1),
            "voluntary_switches": round((b["voluntary_switches"] - a["voluntary_switches"]) / n, 3),
            "involuntary_switches": round(
                (b["involuntary_switches"] - a["involuntary_switches"]) / n, 3
            ),
        }
    out["main"]["threads"] = last["main"]["threads"]
    out["server"]["processes"] = last["server"]["processes"]
    return out


def pgq_backends(pg_url: str, worker_pid: int) -> list[int]:
    """The Postgres backends of a pgq worker's main process (its sessions name it in
    their application_name: ``pgq:<pid>...``), where Postgres runs on this host."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " OR application_name LIKE %s",
            (f"pgq:{worker_pid}", f"pgq:{worker_pid}:%"),
        ).fetchall()
    return [int(r[0]) for r in rows if (PROC / str(r[0])).exists()]


def named(command: str) -> list[int]:
    """Processes of this host whose command name is ``command`` (RabbitMQ: beam.smp)."""
    found = []
    for entry in PROC.glob("[0-9]*"):
        comm = _read(entry / "comm")
        if comm is not None and comm.strip() == command:
            found.append(int(entry.name))
    return found


def _nice_zero() -> None:
    # Nice 0 whatever this process runs at (a niced harness may not lower it: then the
    # loops run at its own nice, still the same for every broker).
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[int]]:
    """``count`` processes spinning on a core each, at nice 0, for the block: their pids."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_nice_zero,
        )
        for _ in range(count)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)
