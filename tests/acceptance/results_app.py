"""A Celery app with pgq as broker and result backend, for the result backend's tests.

Configured by environment: PGQ_BROKER_URL, PGQ_SCHEMA (read by the transport and the
backend), TEST_PG_URL (where tasks record that they ran), TEST_RESULT_SERIALIZER, and
TEST_RESULT_BACKEND (another result backend than pgq's).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery
from celery.exceptions import Reject
from psycopg import sql

URL = os.environ.get("PGQ_BROKER_URL", "pgq://")
SERIALIZER = os.environ.get("TEST_RESULT_SERIALIZER", "json")

app = Celery("results", broker=URL, backend=os.environ.get("TEST_RESULT_BACKEND") or URL)
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_serializer=SERIALIZER,
    task_serializer=SERIALIZER,
    accept_content=sorted({SERIALIZER, "json"}),
    result_extended=True,
)


def record(task_id: str, label: str) -> None:
    with psycopg.connect(os.environ["TEST_PG_URL"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {}.task_runs (task_id, label, pid) VALUES (%s, %s, %s)").format(
                sql.Identifier(os.environ["PGQ_SCHEMA"])
            ),
            [task_id, label, os.getpid()],
        )


@app.task(bind=True)
def echo(self: Any, value: Any) -> Any:
    record(self.request.id, "echo")
    return value


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def fail(message: str) -> None:
    raise ValueError(message)


@app.task
def sleep(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


@app.task
def wait_inside(task_id: str) -> Any:
    # disable_sync_subtasks (the default) refuses this.
    return app.AsyncResult(task_id).get(timeout=5)


@app.task(bind=True)
def reject(self: Any) -> None:
    record(self.request.id, "reject")
    raise Reject("refused", requeue=False)


@app.task(bind=True)
def die(self: Any) -> None:
    record(self.request.id, "die")
    os._exit(1)


@app.task(bind=True)
def part(self: Any, index: int, seconds: float = 0.0) -> int:
    record(self.request.id, f"part:{index}")
    if seconds:
        time.sleep(seconds)
    return index


@app.task(bind=True)
def die_once(self: Any, index: int, marker: str) -> int:
    # The first run of the marked part kills its worker (after the part finished its work
    # but before anything is stored); the redelivery completes it.
    record(self.request.id, f"part:{index}")
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os._exit(1)
    return index


@app.task(bind=True)
def failing_part(self: Any, index: int) -> None:
    record(self.request.id, f"failing:{index}")
    raise ValueError(f"part {index} fails")


@app.task(bind=True)
def collect(self: Any, results: list[Any], label: str = "") -> int:
    record(self.request.id, f"callback:{label}")
    return sum(results)


@app.task(bind=True)
def on_error(self: Any, *args: Any, label: str = "", **kwargs: Any) -> None:
    record(self.request.id, f"errback:{label}")


@app.task(bind=True)
def note(self: Any, label: str) -> str:
    # No *args: an immutable signature of it (.si()) must get nothing more.
    record(self.request.id, f"note:{label}")
    return label


@app.task(bind=True)
def adder(self: Any, index: int, extra: int) -> int:
    # Adds a part to the chord it is a part of (Task.add_to_chord).
    record(self.request.id, f"part:{index}")
    self.add_to_chord(part.s(extra))
    return index
