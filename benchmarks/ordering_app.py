"""The Celery app of the ordering benchmark (``python -m benchmarks.ordering``).

The benchmark app (:mod:`benchmarks.app`, configured by the same ``BENCH_*`` environment:
``task_acks_late``, which ordered tasks need) with one more task, :func:`step`: it sleeps
its task time and tells the sink when it started and ended, with its key and number, so
the harness can check each key ran in order. When the worker stops, its consumer
engine's statement counts (:class:`pg_transport.consume.source.Statements`) go to the
sink too: how many claims, acks and held rows the run took.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from celery import signals

from benchmarks.app import app, worker_sink

__all__ = ["STEP", "app", "statements_key", "step"]

STEP = "benchmarks.step"


def step(key: str, seq: int, sleep_ms: float) -> None:
    """``sleep_ms`` of work, then one line to the sink: start, end, key, number."""
    started = time.time()
    if sleep_ms > 0:
        time.sleep(sleep_ms / 1000.0)
    sink = worker_sink()
    sink.client().rpush(sink.done_key, f"{started!r} {time.time()!r} {key} {seq}")


app.task(name=STEP, ignore_result=True)(step)


def statements_key(prefix: str) -> str:
    return f"{prefix}:statements"


_engines: list[Any] = []


def _keep_engine(sender: Any = None, **_: Any) -> None:
    # The worker's consumer (prefork: in the main process) and its pgq engine.
    transport = getattr(getattr(sender, "connection", None), "transport", None)
    engine = getattr(transport, "engine", None)
    if engine is not None:
        _engines.append(engine)


def _report_statements(**_: Any) -> None:
    if not _engines:
        return
    sink = worker_sink()
    counts = dataclasses.asdict(_engines[-1].statements)
    sink.client().rpush(statements_key(sink.prefix), json.dumps(counts))


signals.worker_ready.connect(_keep_engine)
signals.worker_shutdown.connect(_report_statements)
