"""The worker's settles of atomic deliveries, gathered: one statement for many.

An atomic task's run ends its delivery in its own commit (docs/design/exactly-once.md);
the worker's ack of it is a *settle* (store.py ``settle``), which releases the message
if that commit did not happen (the run rolled back, its commit failed, its child was
killed) and finds nothing if it did, the usual case. Sent one by one, a settle is a
round trip a task that nothing waits for: a statement's fixed cost (the thread's wake-up,
psycopg's send and wait, the server's parse and plan) is most of what an atomic task
costs the worker over a plain one, whose ack rides on the next claim.

So the settles handed here wait at most :data:`GATHER` seconds (or until
:data:`MOST` are pending) and go as one ``settle`` of all their tokens, on a thread of
this module's own. Why the wait changes no guarantee:

* a settle only releases early what would come back anyway: a delivery not completed
  by its commit, once forgotten by the worker (no longer renewed), lapses after its
  visibility timeout; gathered, it comes back at most :data:`GATHER` later than alone,
  still long before that;
* each token is fenced by its lease in the statement, whenever it is sent (a row
  released, claimed again or completed meanwhile is left alone), and a row being
  committed right now is skipped (``SKIP LOCKED``), as before;
* the delivery's prefetch slot is free at the ack, not at its settle: throughput does
  not wait on the window;
* :meth:`Settles.close` (the consumer stopping) sends what is pending at once; a process
  killed with settles pending loses only their early release (the leases lapse).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from time import monotonic

import psycopg

from pg_transport.errors import BrokerUnavailable
from pg_transport.message.rows import Lease

__all__ = ["GATHER", "MOST", "Settles"]

logger = logging.getLogger("pg_transport.settles")

#: Longest a settle waits for others to go with (seconds).
GATHER = 0.05
#: Settles that go at once, without waiting for the rest of the window.
MOST = 500
# Longest a closing consumer waits for the pending settles to be sent (seconds).
CLOSE_TIMEOUT = 5.0


class Settles:
    """Gathers tokens and hands them to ``send`` (``Store.settle``), a batch at a time."""

    def __init__(
        self,
        send: Callable[[list[Lease]], object],
        *,
        gather: float = GATHER,
        most: int = MOST,
    ) -> None:
        self._send = send
        self._gather = gather
        self._most = most
        self._pending: list[Lease] = []
        self._since = 0.0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, token: Lease) -> bool:
        """Settle ``token`` soon (with whatever else is pending). False once closed: the
        caller settles it itself."""
        with self._cond:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pgq-settles", daemon=True)
                self._thread.start()
            self._pending.append(token)
            # Woken only to start a window or to cut it short: not once per token.
            if len(self._pending) == 1:
                self._since = monotonic()
                self._cond.notify()
            elif len(self._pending) == self._most:
                self._cond.notify()
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Send what is pending now, then stop the thread (waiting up to ``timeout``)."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed, nothing left
                deadline = self._since + self._gather
                while not self._closed and len(self._pending) < self._most:
                    left = deadline - monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                tokens, self._pending = self._pending, []
            self._land(tokens)

    def _land(self, tokens: list[Lease]) -> None:
        # A settle that fails releases nothing early: the leases lapse, the messages
        # not completed come back then (a settle is an optimisation of that).
        try:
            self._send(tokens)
        except (psycopg.OperationalError, psycopg.InterfaceError, BrokerUnavailable) as exc:
            logger.warning(
                "pgq: settle of %d atomic deliveries failed (%s); any not completed by "
                "their commit are delivered again when their visibility timeout lapses",
                len(tokens),
                exc,
            )
        except Exception:  # a bug: the same outcome, go on
            logger.exception("pgq: settle of %d atomic deliveries failed", len(tokens))
