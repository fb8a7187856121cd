"""tests/acceptance/atomic_app.py's app with atomic tasks that hold a unique key or a
concurrency slot, for tests/acceptance/test_atomic_flow.py.

A run writes in its transaction (``counter``, ``audit``), says on a connection of its own
which delivery reached its body (``written:<attempt>``), and waits at a gate the test
opens: ``gate`` on the first delivery, ``again_gate`` on a redelivery or a retry.
"""

from __future__ import annotations

from typing import Any

import pg_transport
from tests.acceptance.atomic_app import app, execute, reached, wait_gate

__all__ = ["app", "held", "slotted"]


def _body(task: Any, label: str, gate: str | None, again_gate: str | None, retry: bool) -> str:
    request = task.request
    execute(task, "UPDATE {schema}.counter SET n = n + 1 WHERE id = 1", [])
    execute(
        task, "INSERT INTO {schema}.audit (task_id, label) VALUES (%s, %s)", [request.id, label]
    )
    again = bool(request.delivery_info.get("redelivered")) or request.retries > 0
    reached(request.id, f"written:{'again' if again else 'first'}")
    if not again and gate:
        wait_gate(gate)
    if again and again_gate:
        wait_gate(again_gate)
    if retry and request.retries == 0:
        raise task.retry(countdown=0)
    return label


@app.task(bind=True, base=pg_transport.AtomicTask, max_retries=3)
def held(
    self: Any,
    label: str,
    gate: str | None = None,
    again_gate: str | None = None,
    retry: bool = False,
) -> str:
    """Sent with a unique key (``unique_key=``, ``unique_while="queued_or_running"``)."""
    return _body(self, label, gate, again_gate, retry)


@app.task(
    bind=True,
    base=pg_transport.AtomicTask,
    max_retries=3,
    concurrency_key="tenant",
    concurrency_limit=1,
)
def slotted(
    self: Any,
    tenant: str,
    label: str,
    gate: str | None = None,
    again_gate: str | None = None,
    retry: bool = False,
) -> str:
    """At most one run of a tenant in flight across the fleet."""
    return _body(self, label, gate, again_gate, retry)
