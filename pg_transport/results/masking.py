"""The result backend's URL in an app's settings: sealed, so that no surface shows it.

Celery shows ``result_backend`` through a pattern of its own (``celery inspect conf``
and ``report``, ``celery report``, Flower's Config tab), which misses a raw ``#`` or
``?`` in a password and ``?password=``/``?sslpassword=``. A pgq URL there is replaced
by a :class:`~pg_transport.db.url.SealedURL`: its text is the masked URL, and the
backend reads the URL itself from it. pgq seals it when the app imports its modules
(a worker, beat, ``celery report``; connected by ``_pgq_kombu_alias``) and whenever
a pgq backend is built for the app.
"""

from __future__ import annotations

from typing import Any

from pg_transport.db.url import SealedURL, seal_text

__all__ = ["seal_result_backend", "url_of"]


def seal_result_backend(app: Any) -> None:
    """Seal ``app``'s ``result_backend`` setting if it is a pgq URL with a secret."""
    value = app.conf.get("result_backend")
    if isinstance(value, str):
        sealed = seal_text(value)
        if sealed is not value:
            app.conf.result_backend = sealed


def url_of(value: str) -> str:
    """The URL to connect with, from a setting sealed or not."""
    return value.url if isinstance(value, SealedURL) else value
