"""What every page and action of the console shares: its settings, headers, errors.

Every answer carries a strict Content-Security-Policy (no script at all, styles from the
console's own file), is never cached, and escapes every value it shows (Tornado's
templates escape by default; no template marks a value raw). Reads run in a small pool
of threads, so the event loop never waits for Postgres.

Actions exist only when the console was started with a token: the operator signs in with
their name and the token (compared in constant time), and every action is a POST that
carries Tornado's XSRF token, is logged with who did what, and for a purge is asked
again before it is done.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import psycopg
import tornado.web
from tornado.ioloop import IOLoop

from pg_transport.db.pool import Connector
from pg_transport.errors import PgqError
from pg_transport.ops.format import age, identity_text, one_line
from pg_transport.store import Store
from pg_transport.web.auth import Sessions, SignInLimit
from pg_transport.web.consumers import Consumers
from pg_transport.web.reads import Capabilities, Reads

__all__ = ["MAX_IDS", "USER_COOKIE", "Base", "Console", "audit", "checked_time", "until", "utc"]

logger = logging.getLogger("pg_transport.web")
audit = logging.getLogger("pg_transport.web.audit")

T = TypeVar("T")

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
USER_COOKIE = "pgq_web_user"
#: A sample older than this many intervals is called stale on the page.
STALE_INTERVALS = 3
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
#: Rows a form may name at once.
MAX_IDS = 1000


@dataclass
class Console:
    """What the pages work with: the schema's connections, the token, the sampling."""

    connector: Connector
    schema: str
    token: str | None = None
    interval: float = 10.0
    threads: int = 4
    #: Shown in the header: the URL with its password masked.
    where: str = ""
    #: Host names requests may be addressed to, besides an IP address and localhost: a
    #: page of another site whose name was made to resolve to the console's address (DNS
    #: rebinding) sends its own name as Host, and gets nothing.
    allowed_hosts: frozenset[str] = frozenset()
    #: The broker URL, to ask the workers which queues they consume (None: not asked).
    url: str | None = None
    executor: ThreadPoolExecutor = field(init=False)
    sessions: Sessions = field(init=False)
    sign_ins: SignInLimit = field(init=False)

    def __post_init__(self) -> None:
        self.executor = ThreadPoolExecutor(self.threads, thread_name_prefix="pgq-web")
        self.sessions = Sessions()
        self.sign_ins = SignInLimit()
        self.allowed_hosts = frozenset(h.lower() for h in self.allowed_hosts)
        self.reads = Reads(self.connector, self.schema)
        self.store = Store(self.connector, self.schema)
        self.consumers = (
            None
            if self.url is None
            else Consumers(self.url, self.schema, ttl=max(3 * self.interval, 5.0))
        )

    @property
    def actions(self) -> bool:
        return self.token is not None

    def token_matches(self, given: str) -> bool:
        if self.token is None:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def cookie_secret(self) -> str:
        # Derived from the token, so consoles started with one token accept each other's
        # sign-ins; without a token nobody signs in and the secret guards nothing.
        seed = (self.token or "").encode()
        return hmac.new(seed, b"pgq web console cookie", hashlib.sha256).hexdigest()


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def utc(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def until(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    seconds = (value - now).total_seconds()
    return ("in " + age(seconds)) if seconds >= 0 else (age(-seconds) + " ago")


class Problem(tornado.web.HTTPError):
    """An error page with a title; its detail is logged as it is (it may quote a row)."""

    def __init__(
        self, status: int, title: str, detail: str, *, retry_after: int | None = None
    ) -> None:
        super().__init__(status, "%s", detail)
        self.title = title
        self.detail = detail
        self.retry_after = retry_after


class Base(tornado.web.RequestHandler):
    console: Console

    def initialize(self, console: Console) -> None:
        self.console = console

    def set_default_headers(self) -> None:
        self.set_header("Content-Security-Policy", CSP)
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Referrer-Policy", "no-referrer")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Frame-Options", "DENY")

    def prepare(self) -> None:
        host = self.request.host_name.strip("[]").lower()
        if not (_is_address(host) or host in LOOPBACK_NAMES or host in self.console.allowed_hosts):
            raise tornado.web.HTTPError(
                400,
                "this console answers requests to an IP address, localhost or a name given "
                "with --allowed-host only",
            )

    @property
    def over_tls(self) -> bool:
        """Whether the browser reached us over TLS (directly, or through a proxy that
        says so: a cookie marked Secure on its word is at worst not sent back)."""
        forwarded = self.request.headers.get("X-Forwarded-Proto", "")
        return self.request.protocol == "https" or forwarded.split(",")[0].strip() == "https"

    def session(self) -> str | None:
        raw = self.get_signed_cookie(USER_COOKIE, max_age_days=1)
        return raw.decode() if raw else None

    def get_current_user(self) -> str | None:
        if not self.console.actions:
            return None
        session = self.session()
        return self.console.sessions.user(session) if session else None

    async def db(self, fn: Callable[[], T]) -> T:
        """``fn`` in the console's threads; a refused privilege is a page of its own."""
        try:
            return await IOLoop.current().run_in_executor(self.console.executor, fn)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise Problem(
                403,
                "Not allowed for this role",
                f"The console's database role may not read or do this: {one_line(exc)}. "
                "Grant it the privilege (docs/least-privilege.md), or use the console for "
                "what this role may see.",
            ) from None
        except (PgqError, psycopg.Error) as exc:
            raise Problem(503, "Database unavailable", one_line(exc)) from None

    def page(self, template: str, **values: Any) -> None:
        self.render(
            template,
            console=self.console,
            user=self.current_user,
            utc=utc,
            age=age,
            identity_text=identity_text,
            refresh=values.pop("refresh", None),
            **values,
        )

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        title, detail = "Error", self._reason
        if isinstance(exc, Problem):
            title, detail = exc.title, exc.detail
            if exc.retry_after is not None:
                self.set_header("Retry-After", str(exc.retry_after))
        elif isinstance(exc, tornado.web.HTTPError) and exc.log_message:
            detail = exc.log_message % exc.args if exc.args else exc.log_message
        self.render(
            "error.html",
            console=self.console,
            user=self.current_user,
            utc=utc,
            refresh=None,
            title=title,
            detail=detail,
            status=status_code,
        )

    def capabilities(self) -> Capabilities:
        return self.console.reads.capabilities()


def checked_time(text: str | None, name: str) -> datetime | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise tornado.web.HTTPError(
            400, "bad %s %r: expected a date and time, e.g. 2026-01-31T12:00", name, text
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
