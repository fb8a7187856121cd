"""A steady stream: one producer publishing while one worker runs what it publishes.

``python -m benchmarks.stream`` takes the broker benchmark's options (``--brokers``,
``--tasks``, ``--rounds``, ``--pool``, ``--concurrency``, ...; the latency ones do not
apply). Each broker in turn (in reverse order every other round) gets a fresh worker
subprocess, started and idle (having run one untimed task, after which the producer
is connected); then this process publishes ``--tasks`` no-op tasks in an
``apply_async`` loop while that worker runs them. Per broker, medians over the rounds:

- ``publish``: the publish rate, the worker running alongside (on a small machine the
  two share the cores, unlike the broker benchmark's publish phase, which has no worker);
- ``through``: every task over the time from the first publish to the last task's end,
  what a steady stream gets through the broker;
- ``lag``: how long the worker ran on after the last publish returned (a broker whose
  worker falls behind its producer shows it here).

The sink and the worker are the broker benchmark's (``benchmarks.app``,
``benchmarks.worker``); the JSON is saved as the broker benchmark saves its own
(``benchmarks/results/<timestamp>-stream.json``, ``--output``, ``--no-save``).
"""

from __future__ import annotations

import sys
import time
from statistics import median
from typing import Any

from benchmarks.brokers import (
    RESULTS,
    SETTLE_SECONDS,
    Entry,
    Run,
    begin,
    fail,
    finish,
    in_rounds,
    launch,
    make_brokers,
    prepare,
    show,
)
from benchmarks.phases import drain, wait_ready
from benchmarks.targets import Broker

__all__ = ["main", "stream_one", "summarize"]

MEASURES = ("publish", "through", "lag")


def stream_one(run: Run, entry: Entry) -> dict[str, float]:
    """One broker's stream: a ready worker, then ``--tasks`` publishes from here."""
    args, sink = run.args, entry.sink
    # A first task, not counted: the producer connects and declares (pgq: migrates its
    # fresh schema), and the worker, once up, runs it.
    entry.publish(1)
    worker, spawned_at = launch(run, entry, "stream")
    try:
        wait_ready(worker, sink, 0, args.phase_timeout)
        drain(worker, sink, 1, args.phase_timeout, spawned_at)
        sink.client().delete(sink.done_key)
        time.sleep(SETTLE_SECONDS)  # (the worker waiting for work, as a stream finds it)
        began = time.time()
        entry.publish(args.tasks)
        published = time.time()
        # The worker's own clock stamps each task's end: time.time() on this host.
        done = drain(worker, sink, args.tasks, args.phase_timeout, spawned_at=began)
    finally:
        worker.stop()
    last = began + done["wall_seconds"]
    return {
        "tasks": float(done["tasks"]),
        "duplicates": float(done["duplicates"]),
        "publish": args.tasks / (published - began),
        "through": args.tasks / (last - began),
        "lag": last - published,
        # From the first publish to the first task's end.
        "first": last - done["seconds"] - began,
    }


def run_round(run: Run, brokers: list[Broker], number: int) -> dict[str, dict[str, Any]]:
    """Every broker once, one after another."""
    results: dict[str, dict[str, Any]] = {}
    for broker in brokers:
        results[broker.name], entry = prepare(run, broker, number)
        if entry is None:
            continue
        try:
            run.say(
                f"[{broker.name}] stream of {run.args.tasks} tasks "
                f"({run.args.pool} x{run.args.concurrency})"
            )
            entry.result["stream"] = stream_one(run, entry)
        except Exception as exc:  # any failure is reported, never fatal to others
            fail(run, broker.name, entry.result, exc)
        finally:
            finish(entry)
    return results


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per broker: the median of each measure over the rounds it ran in, and each
    round's; a broker that failed or was skipped in every round says why."""
    found: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(name for r in rounds for name in r):
        streams = [r[name]["stream"] for r in rounds if "stream" in r.get(name, {})]
        if not streams:
            last = next(r[name] for r in reversed(rounds) if name in r)
            found[name] = {"status": last["status"], "reason": last.get("reason", "")}
            continue
        found[name] = {
            "status": "ok",
            **{m: median(s[m] for s in streams) for m in MEASURES},
            "rounds": streams,
        }
    return found


def format_table(found: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'broker':<18}{'publish/s':>11}{'through/s':>11}{'lag s':>8}"]
    for name, result in found.items():
        if result["status"] != "ok":
            lines.append(f"{name:<18}{result['status']}: {result['reason']}")
            continue
        lines.append(
            f"{name:<18}{result['publish']:>11.0f}{result['through']:>11.0f}{result['lag']:>8.2f}"
        )
    ok = {name: r for name, r in found.items() if r["status"] == "ok"}
    for ours in ("pgq", "pgq-async"):
        if ours not in ok:
            continue
        others = [name for name in ("redis", "rabbitmq") if name in ok]
        if others:
            ratios = ", ".join(f"{ok[ours]['through'] / ok[o]['through']:.2f}x {o}" for o in others)
            lines.append(f"{ours} through: {ratios}")
    lines.append(
        "medians over the rounds; through: tasks from the first publish to the "
        "last task's end; lag: the worker's run after the last publish"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    run = begin(argv)
    if run is None:
        return 2
    found = summarize(in_rounds(run, make_brokers(run.args), run_round))
    show(run, found, format_table(found), RESULTS / f"{run.stamp}-stream.json")
    return 1 if any(r["status"] == "failed" for r in found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
