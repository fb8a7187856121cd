"""The Celery app the demo's worker runs (``celery -A pg_transport.ops.demo_app
worker``, configured by ``PGQ_URL`` and ``PGQ_SCHEMA``): one task, which reports back
through pgq itself (a second queue the demo claims from), so the demo needs neither a
result backend nor SQL of its own for its results.
"""

from __future__ import annotations

import os
import threading
import time

from celery import Celery, Task

from pg_transport.config import Options
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.db.url import mask_url
from pg_transport.publish.publisher import Publisher

__all__ = ["ADD", "QUEUE", "RESULTS", "app"]

QUEUE = "pgq-demo"
RESULTS = "pgq-demo.results"
ADD = "pgq.demo.add"

app = Celery("pgq-demo", broker=os.environ.get("PGQ_URL") or "pgq://")
app.conf.update(
    task_default_queue=QUEUE,
    # Ack after the task ran: a worker that dies mid-task leaves the message to be
    # redelivered when its visibility timeout passes.
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_results: Publisher | None = None
_results_lock = threading.Lock()


def _results_publisher() -> Publisher:
    """One publisher per worker process for the reports, opened on first use."""
    global _results
    with _results_lock:
        if _results is None:
            url = str(app.conf.broker_url)
            options = Options.from_sources(app.conf.broker_transport_options, os.environ)
            connector = Connector(url_to_conninfo(url), display_url=mask_url(url))
            _results = Publisher(connector, options.schema)
        return _results


@app.task(name=ADD, bind=True)  # type: ignore[untyped-decorator]  # Celery is untyped
def add(self: Task, x: int, y: int) -> int:
    started = time.time()
    result = x + y
    request = self.request
    report = {
        "task_id": request.id,
        "result": result,
        "started": started,
        "priority": (request.delivery_info or {}).get("priority"),
        "pid": os.getpid(),
        "worker": request.hostname,
    }
    # Keyed by task id, so a retried publish cannot report the same run twice.
    _results_publisher().publish(RESULTS, report, publish_key=f"{RESULTS}:{request.id}")
    return result
