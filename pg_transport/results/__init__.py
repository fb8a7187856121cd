"""The pgq result backend: ``result_backend = "pgq://…"`` (see docs/results.md).

Celery finds it through the ``pgq`` backend alias, registered when Celery's backend
table is first imported (``_pgq_kombu_alias``); importing this package imports nothing
of Celery's. The backend class is :class:`pg_transport.results.backend.PgqBackend`.
"""

from __future__ import annotations

__all__ = ["BACKEND"]

#: What Celery's ``BACKEND_ALIASES["pgq"]`` names.
BACKEND = "pg_transport.results.backend:PgqBackend"
