"""``AtomicTask``: a task whose database writes, the end of its delivery, its result and
its follow-up tasks commit in one transaction (docs/exactly-once.md).

Celery's trace runs ``__call__`` (the body), then stores the result, counts the chord
part and sends callbacks, then sends ``task_postrun``: the run's transaction is begun in
:meth:`AtomicTask.__call__`, and committed (or rolled back) by the ``task_postrun``
receiver, the last thing of every run whatever its state. The fence that ends the
delivery under its token travels with that COMMIT, in one round trip: a stale
delivery's whole run, success path included, rolls back there.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from celery import Task, signals
from celery.exceptions import Ignore, Reject, Retry

from pg_transport.atomic.checks import check_or_stop
from pg_transport.atomic.run import (
    Completion,
    ConnectionLost,
    Run,
    current,
    open_run,
    refuse,
)
from pg_transport.db.retry import is_dead_connection
from pg_transport.errors import ConfigurationError, NotPermitted, TransactionRefused

__all__ = ["AtomicTask"]

logger = logging.getLogger("pg_transport.atomic")

#: States whose run commits (if it ends its delivery): what Celery recorded then is
#: the delivery's one outcome. Any other (IGNORED, REJECTED, an internal error) rolls back.
COMMITTED_STATES = frozenset({"SUCCESS", "FAILURE", "RETRY"})


class AtomicTask(Task):  # type: ignore[misc]  # Celery is untyped
    """Base class of an atomic task: ``@app.task(bind=True, base=AtomicTask)``.

    The body runs in a transaction on :attr:`transaction`'s connection; at its commit,
    the task's message is deleted under its fencing token, its result stored, its chord
    part counted and the tasks it publishes enqueued. A stale delivery's commit is
    refused (:class:`~pg_transport.LeaseLost`, logged) and commits nothing.
    """

    #: The message is acknowledged by the run's own commit, after the body: never before.
    acks_late = True
    #: A killed child committed nothing (or its commit ended the delivery): the message
    #: is released, not failed (Celery would store FAILURE for a run that never counted).
    reject_on_worker_lost = True
    #: Read by the worker's delivery guard (kombu/guard.py): its ack becomes a settle.
    pgq_completes_delivery = True
    #: Where the run's transaction comes from (None: the app's ``pgq_atomic_connection``).
    atomic_connection: Any = None

    @property
    def transaction(self) -> Completion:
        """The running body's transaction (its ``connection``, ``session``,
        ``on_commit``); an error outside an atomic run."""
        run = current()
        if run is None:
            raise RuntimeError(
                f"task {self.name}: self.transaction exists only while its body runs in "
                "a worker (an atomic run)"
            )
        return Completion(run)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        try:
            run = open_run(self)
        except ConnectionLost as exc:
            logger.error(
                "pgq: atomic task %s[%s]: its connection was lost as its run opened (%s); "
                "its message is delivered again",
                self.name,
                request.id,
                exc,
            )
            raise Reject(str(exc), requeue=True) from exc
        except (TransactionRefused, ConfigurationError, NotPermitted) as exc:
            # A connection pgq cannot run on does not get better by redelivery: the
            # message is dead-lettered now, with the refusal as its reason (the worker's
            # own dead-lettering of the Reject then finds it gone).
            logger.error("pgq: atomic task %s[%s] refused: %s", self.name, request.id, exc)
            refuse(self, f"atomic task refused: {exc}")
            raise Reject(str(exc), requeue=False) from exc
        try:
            try:
                result = self.run(*args, **kwargs)
            except (Ignore, Reject):
                raise  # rolled back at the end of the run
            except Retry:
                raise  # retry() completes it; a Retry raised by hand is rolled back
            except Exception as exc:
                if is_dead_connection(exc, run.conn):
                    raise
                run.rollback_body()
                if self._acks_failures():
                    run.complete()  # a stale run's failure is refused at its commit
                raise
            run.complete()
        except psycopg.Error as exc:
            if not is_dead_connection(exc, run.conn):
                raise
            # The run's transaction is gone with its session: nothing of it committed.
            # Requeued (released), not failed: the next delivery may well commit.
            logger.error(
                "pgq: atomic task %s[%s]: its transaction's connection was lost (%s); nothing "
                "of its run is kept and its message is delivered again",
                self.name,
                request.id,
                exc,
            )
            run.report_lost = False  # (said here, with the error)
            raise Reject(str(exc), requeue=True) from exc
        return result

    def _acks_failures(self) -> bool:
        value = getattr(self, "acks_on_failure_or_timeout", None)
        if value is None:
            value = self.app.conf.get("task_acks_on_failure_or_timeout", True)
        return bool(value)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry()``: the body's writes are rolled back first, and the run
        ends its delivery, so the retry message, the RETRY state and the end of this
        delivery commit together (under the fence), without the body's writes."""
        run = current()
        if run is not None and run.task is self and not run.completes:
            run.rollback_body()
            run.complete()
        return super().retry(*args, **kwargs)


def _finish(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
    """``task_postrun``: commit the run whose state Celery recorded, roll back any other."""
    run: Run | None = current()
    if run is None or run.task_id != task_id:
        return
    run.finish(commit=state in COMMITTED_STATES and run.completes)


def _check_worker(sender: Any = None, instance: Any = None, **_: Any) -> None:
    if instance is not None:
        check_or_stop(instance.app)


signals.task_postrun.connect(_finish, weak=False, dispatch_uid="pgq-atomic-finish")
# A worker whose atomic tasks cannot keep their promise stops at start-up.
signals.celeryd_init.connect(_check_worker, weak=False, dispatch_uid="pgq-atomic-check")
