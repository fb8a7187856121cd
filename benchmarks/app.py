"""The Celery app every broker benchmark runs: one no-op task that reports to a Redis sink.

The worker subprocess is ``celery -A benchmarks.app worker``, configured by environment
(``BENCH_*``, see :func:`app_from_env`); the harness builds the same app in-process with
:func:`make_app` to publish.

Why a Redis sink: the harness must learn when tasks start and finish without a result
backend, and without adding load to the broker being measured. Recording into Postgres
would tax pgq's own server; a Redis RPUSH is one cheap round trip and Redis is present
wherever this benchmark runs. The sink lives in its own Redis database (the Redis broker
gets another), yet on the same server: for the Redis broker the sink's few thousand
RPUSH/s share one Redis process with the broker, a small handicap documented in README.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, signals

TASK_NAME = "benchmarks.noop"
# Task kinds: a drained task records when it finished, a latency probe when it started.
DRAIN = "drain"
LATENCY = "latency"

ENV_BROKER_URL = "BENCH_BROKER_URL"
ENV_QUEUE = "BENCH_QUEUE"
ENV_TRANSPORT_OPTIONS = "BENCH_TRANSPORT_OPTIONS"
ENV_PREFETCH = "BENCH_PREFETCH_MULTIPLIER"
ENV_SINK_URL = "BENCH_SINK_URL"
ENV_SINK_PREFIX = "BENCH_SINK_PREFIX"


class Sink:
    """Redis keys one benchmark run writes to, with a client per process.

    Prefork children inherit the module from the parent; a client opened before the
    fork would share its socket, so each process opens its own on first use.
    """

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._client: redis.Redis | None = None
        self._pid = 0

    @property
    def done_key(self) -> str:
        return f"{self.prefix}:done"

    @property
    def latency_key(self) -> str:
        return f"{self.prefix}:latency"

    @property
    def ready_key(self) -> str:
        return f"{self.prefix}:ready"

    @property
    def engine_key(self) -> str:
        return f"{self.prefix}:engine"

    def keys(self) -> list[str]:
        return [self.done_key, self.latency_key, self.ready_key, self.engine_key]

    def client(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(
                self.url, socket_timeout=10, socket_connect_timeout=5
            )
            self._pid = os.getpid()
        return self._client


_worker_sink: Sink | None = None


def worker_sink() -> Sink:
    """The sink named by the worker's environment."""
    global _worker_sink
    if _worker_sink is None:
        _worker_sink = Sink(os.environ[ENV_SINK_URL], os.environ[ENV_SINK_PREFIX])
    return _worker_sink


def noop(kind: str = DRAIN, seq: int = 0, published_at: float = 0.0) -> None:
    """The measured task: no work beyond telling the sink it ran."""
    started = time.time()
    sink = worker_sink()
    if kind == LATENCY:
        # seq lets the harness discard a late answer to an earlier, timed-out probe.
        sink.client().rpush(sink.latency_key, f"{seq} {published_at!r} {started!r}")
    else:
        sink.client().rpush(sink.done_key, repr(time.time()))


def make_app(
    broker_url: str,
    queue: str,
    transport_options: Mapping[str, Any] | None = None,
    prefetch_multiplier: int = 4,
) -> Celery:
    """The benchmark app; identical configuration in the worker and in the publisher."""
    app = Celery("benchmarks", broker=broker_url, set_as_current=False)
    app.conf.update(
        broker_transport_options=dict(transport_options or {}),
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        task_acks_late=True,
        worker_prefetch_multiplier=prefetch_multiplier,
        # No result backend: completion is observed through the sink.
        task_ignore_result=True,
    )
    app.task(name=TASK_NAME, ignore_result=True)(noop)
    return app


def app_from_env(environ: Mapping[str, str] = os.environ) -> Celery:
    """The worker's app; ``memory://`` when imported outside a worker (by the harness)."""
    return make_app(
        environ.get(ENV_BROKER_URL, "memory://"),
        environ.get(ENV_QUEUE, "benchmarks"),
        json.loads(environ.get(ENV_TRANSPORT_OPTIONS, "{}")),
        int(environ.get(ENV_PREFETCH, "4")),
    )


app = app_from_env()


# The pgq consumer engine of this worker (None on other brokers), for its statement counts.
_engine: Any = None


def _report_ready(sender: Any = None, **_: Any) -> None:
    # Lets the harness report start-up time and notice a worker that never came up.
    global _engine
    transport = getattr(getattr(sender, "connection", None), "transport", None)
    _engine = getattr(transport, "engine", None)
    if ENV_SINK_URL in os.environ:
        sink = worker_sink()
        sink.client().rpush(sink.ready_key, repr(time.time()))


def _report_statements(**_: Any) -> None:
    # pgq only: how many statements of each kind the consumer sent (claims, acks riding
    # on them, acks alone...), so the harness can give them per task.
    statements = getattr(_engine, "statements", None)
    if statements is not None and ENV_SINK_URL in os.environ:
        sink = worker_sink()
        sink.client().rpush(sink.engine_key, json.dumps(vars(statements)))


signals.worker_ready.connect(_report_ready)
signals.worker_shutdown.connect(_report_statements)
