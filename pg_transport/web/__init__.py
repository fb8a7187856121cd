"""``pgq web``: a browser console for a pgq schema.

Server-rendered pages (Tornado's templates, every value escaped) of the queues, dead
letters, barriers, schedules and connected processes, readable without JavaScript.
Read-only unless started with a token; then dead letters can be requeued, rehooked and
purged through POSTed forms that carry Tornado's XSRF token, each action logged.
"""

from __future__ import annotations

from pg_transport.web.app import Console, make_app

__all__ = ["Console", "make_app"]
