"""Publishing: :mod:`~pg_transport.publish.publisher` (one message, or a batch's), and
:mod:`~pg_transport.publish.batching` (many publishes, one commit)."""
