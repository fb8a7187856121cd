"""Acks that wait for the consumer's next claim, so one round trip does both.

A task's ack comes from a pool thread; the consumer thread then claims a message for
the slot that ack freed. Instead of two statements from two threads, the ack is put
here and the consumer's claim deletes it in the same statement. Only acks of tasks
that ran are ever buffered, so at-least-once delivery is kept: a process that dies
with acks in the buffer has those messages delivered again, exactly as if it had died
just before acking.

Acks wait here only while a driver runs the consumer engine: always under Celery's
event loop (``hub.py``), and during a blocking ``drain_events`` call
(``blocking.py``: a gevent or eventlet pool's acks, made while the consumer waits). There
every ack wakes the driver, which lands it within a turn of its loop. Outside a blocking
call (a plain kombu consumer acking after ``drain_events`` returned), and once the
consumer stops (connection closed or lost), ``add`` refuses and the caller acks on its
own, so an ack has landed when ``message.ack()`` returns.
"""

from __future__ import annotations

import threading

from pg_transport.message.rows import Lease

__all__ = ["AckBuffer", "Token"]

Token = Lease  # the fencing token of the delivery acked


class AckBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: list[Token] = []
        self._open = False
        self._closed = False

    def start(self) -> None:
        """A consumer loop now takes buffered acks (no effect once closed)."""
        with self._lock:
            self._open = not self._closed

    def pause(self) -> None:
        """No loop takes buffered acks for now: ``add`` refuses until :meth:`start`."""
        with self._lock:
            self._open = False

    def add(self, token: Token) -> bool:
        """Buffer an ack; False when the buffer is closed and the caller must ack now."""
        with self._lock:
            if not self._open:
                return False
            self._tokens.append(token)
            return True

    def take(self) -> list[Token]:
        """Every buffered ack; the caller now owns landing them."""
        with self._lock:
            tokens, self._tokens = self._tokens, []
        return tokens

    def put_back(self, tokens: list[Token]) -> list[Token]:
        """Return acks a failed statement did not land; those the buffer refuses
        (it was closed meanwhile) come back to the caller to land itself."""
        with self._lock:
            if not self._open:
                return tokens
            self._tokens[:0] = tokens
            return []

    def close(self) -> list[Token]:
        """Stop buffering; the acks still buffered are the caller's to land."""
        with self._lock:
            self._open, self._closed = False, True
            tokens, self._tokens = self._tokens, []
        return tokens

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)
