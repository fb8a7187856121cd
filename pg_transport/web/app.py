"""The console's Tornado application: its pages, its actions and the rules all follow.

Every answer carries a strict Content-Security-Policy (no script at all, styles from the
console's own file), is never cached, and escapes every value it shows (Tornado's
templates escape by default; no template marks a value raw). Reads run in a small pool
of threads, so the event loop never waits for Postgres.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import tornado.web

from pg_transport.web import actions, pages
from pg_transport.web.base import Console

__all__ = ["Console", "make_app"]


def make_app(console: Console, *, debug: bool = False) -> tornado.web.Application:
    here = resources.files("pg_transport.web")
    args: dict[str, Any] = {"console": console}
    routes: list[Any] = [*pages.routes(args), *actions.routes(args)]
    return tornado.web.Application(
        routes,
        template_path=str(here.joinpath("templates")),
        static_path=str(here.joinpath("static")),
        default_handler_class=pages.NotFound,
        default_handler_args=args,
        xsrf_cookies=True,
        xsrf_cookie_kwargs={"httponly": True, "samesite": "Strict"},
        cookie_secret=console.cookie_secret(),
        autoescape="xhtml_escape",
        compiled_template_cache=not debug,
        debug=debug,
    )
