"""Messages a consumer cannot deliver: kept in dead_letter and told to the app, off the
consumer's thread (with the other statements a delivery's outcome may need there: a
requeue, a reject).

A claimed row may be poisoned (past max_attempts), oversized, not a kombu message, or
its delivery may raise. The consumer hands it here and goes on at once: a thread of
this module's own moves it to dead_letter under its lease (if the claim did not
already), records what the message was, and sends ``message_poisoned``, whose handlers
are the application's code and may be slow (a barrier's hook retries for up to 30 s
while Postgres is away) or raise. Neither may hold up the consumer, whose loop is
Celery's event loop.

The same thread lands what a task's outcome asks of the store when it is decided on the
driver's own thread (Celery's prefork and solo pools decide there): a requeue, a reject
to the dead letters (:meth:`Undeliverable.later`); the consumer's loop never waits for a
round trip of its own making.

A row handed here and not done when the process stops is not lost: its lease lapses
and it is claimed again (then dead-lettered by the claim), or it is in dead_letter
already and ``pgq dead rehook`` runs its handlers.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from pg_transport import poisoned
from pg_transport.errors import BrokerUnavailable

if TYPE_CHECKING:
    from pg_transport.message.rows import Claimed
    from pg_transport.store import Store

__all__ = ["Undeliverable"]

logger = logging.getLogger("pg_transport.undeliverable")

# Longest a closing consumer waits for the rows handed here to be done (seconds).
CLOSE_TIMEOUT = 5.0


class Undeliverable:
    """One thread per consumer, started on the first row handed over."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], object]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, claimed: Claimed, reason: str, *, held: bool = True) -> None:
        """Dead-letter ``claimed`` (unless the claim did) and send the signal, soon.
        ``held``: under its lease (claimed); otherwise popped, gone from the queue, and
        kept from its text."""
        self.later("dead-lettering", lambda: self.handle(claimed, reason, held))

    def later(self, what: str, work: Callable[[], object]) -> None:
        """Run ``work`` (a fenced statement: a requeue, a reject) on this thread, soon;
        a failure is logged (``what`` names it): the message's lease lapses and it is
        delivered again."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="pgq-undeliverable", daemon=True
                )
                self._thread.start()
        self._jobs.put((what, work))

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Finish what was handed over (up to ``timeout``), then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            what, work = job
            try:
                work()
            except (psycopg.OperationalError, psycopg.InterfaceError, BrokerUnavailable) as exc:
                logger.warning(
                    "pgq: %s failed (%s): the message is delivered again when its lease lapses",
                    what,
                    exc,
                )
            except Exception:  # a bug: the message's lease lapses, go on
                logger.exception("pgq: %s failed", what)

    def handle(self, claimed: Claimed, reason: str, held: bool = True) -> None:
        """Dead-letter ``claimed`` and tell the app; never raises for the message's sake."""
        try:
            dead_id = claimed.dead_letter_id
            if dead_id is None and not held:
                dead_id = self.store.keep_popped(claimed, reason)
            elif dead_id is None:
                dead_id = self.store.dead_letter(claimed.token, reason)
                if dead_id is None:
                    return  # no longer held: its lease lapsed, another consumer has it
            payload = claimed.payload
            if payload is None:
                # Dead-lettered unread (too large): what its envelope says is enough to
                # name the task.
                payload = self.store.dead_letter_envelope(dead_id)
            poisoned.handle_poisoned(
                self.store,
                dead_letter_id=dead_id,
                queue=claimed.queue,
                payload=payload,
                attempts=claimed.read_ct,
                reason=claimed.fault or reason,
            )
            poisoned.tell_dead_lettered(
                dead_letter_id=dead_id,
                queue=claimed.queue,
                payload=payload,
                reason=claimed.fault or reason,
                settled=False,
            )
        except (psycopg.OperationalError, psycopg.InterfaceError, BrokerUnavailable) as exc:
            logger.warning(
                "pgq: could not dead-letter message %d (%s): it is delivered "
                "again when its lease lapses",
                claimed.id,
                exc,
            )
        except Exception:  # a store call refused, or a bug: the row is kept, go on
            logger.exception("pgq: handling undeliverable message %d failed", claimed.id)
