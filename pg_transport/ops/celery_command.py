"""``celery pgq …``: pgq's commands as a ``celery`` subcommand.

Registered through Celery's ``celery.commands`` entry point, which Celery reads from the
installed distribution's metadata whenever the ``celery`` command starts. Loading it
imports :mod:`pg_transport`, which registers the ``pgq://`` scheme with kombu: so
``celery -A app worker`` finds the transport even where the ``.pth`` hook that normally
registers it is not processed (``pip install --target`` with ``PYTHONPATH``, zipapps,
``python -S``).
"""

from __future__ import annotations

import pg_transport  # noqa: F401 (registers the pgq:// scheme)
from pg_transport.ops.cli import main
from pg_transport.ops.plugins import PluginCommands

__all__ = ["pgq"]

pgq = PluginCommands(
    name="pgq",
    commands=dict(main.commands),
    help="pgq's commands, as the `pgq` command has them (`celery pgq status --url …`).",
)
