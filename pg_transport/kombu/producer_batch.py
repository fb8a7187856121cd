"""kombu's ``Producer.batch()`` on pgq: the transport side (``create_publish_batch``).

kombu (5.7 and later) groups a producer's publishes in ``with producer.batch():`` and
hands each one to the channel's publish batch; the block's end flushes it, an exception
discards it, and a batch reaching ``max_size`` operations flushes on its own. On pgq a
flush is one commit: the publishes go into a :class:`~pg_transport.publish.batching.Batch`
(the machinery of ``pg_transport.batch()``: one transaction per database, pipelined,
sent again once after a lost connection), committed by the flush. Consumers see nothing
of it before. Inside an application's transaction (``pg_transport.transaction()``) the
publishes go there instead, and commit with it.
"""

from __future__ import annotations

from typing import Any

from pg_transport.publish.batching import Batch

__all__ = ["PublishBatch"]


class PublishBatch:
    """One producer's publish batch on one channel, as kombu drives it."""

    def __init__(self, channel: Any, max_size: int) -> None:
        self.channel = channel
        self.max_size = max_size
        self._batch = Batch()
        self._aborted = False
        self._closed = False

    def publish(self, message: Any, **kwargs: Any) -> Any:
        """Route and write one message in the batch's transaction."""
        self._check_usable()
        with self._batch.open():
            result = self.channel.basic_publish(message, **kwargs)
        if self._batch.statements >= self.max_size:
            self.flush()
        return result

    def flush(self) -> None:
        """Commit what the batch holds (one transaction per database)."""
        self._check_usable()
        self._batch.commit()

    def discard(self) -> None:
        """Roll back what has not been flushed."""
        self._aborted = True
        self._batch.abandon()

    def close(self) -> None:
        """Let go of the batch's connections (anything not flushed is rolled back)."""
        if not self._closed:
            self._closed = True
            self._batch.abandon()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this pgq publish batch is closed")
        if self._aborted:
            raise RuntimeError("this pgq publish batch was discarded")
