"""The console's sign-in against a real server on a real socket: sessions end at sign-out,
failed attempts are limited per address, the cookie is Secure behind TLS, a connection
that never finishes its headers is closed, and requests to a name not allowed get
nothing (DNS rebinding), on any address the console listens on.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import pytest

pytest.importorskip("tornado")

from pg_transport.store import Store
from pg_transport.web.auth import SIGN_IN_ATTEMPTS
from pg_transport.web.base import Console
from pg_transport.web.server import start

TOKEN = "a-console-token-of-some-length"
SIGNED_IN = re.compile(r'signed in as <strong id="user">([^<]*)</strong>')


@contextmanager
def serving(console: Console, **options: Any) -> Iterator[int]:
    """The console on 127.0.0.1, in a thread with its own event loop; its port."""
    ready, held = threading.Event(), {}

    async def main() -> None:
        server, port = start(console, "127.0.0.1", 0, **options)
        stop = asyncio.Event()
        held.update(port=port, loop=asyncio.get_running_loop(), stop=stop)
        ready.set()
        await stop.wait()
        server.stop()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the console did not start"
    try:
        yield int(held["port"])
    finally:
        held["loop"].call_soon_threadsafe(held["stop"].set)
        thread.join(30)


@dataclass
class Browser:
    """One client address's requests, with its cookies."""

    port: int
    source: str = "127.0.0.1"
    cookies: dict[str, str] = field(default_factory=dict)

    def request(
        self, method: str, path: str, body: dict[str, str] | None = None, **headers: str
    ) -> tuple[int, http.client.HTTPMessage, str]:
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.port, timeout=30, source_address=(self.source, 0)
        )
        try:
            sent = {"Host": headers.pop("Host", f"127.0.0.1:{self.port}"), **headers}
            if self.cookies:
                sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
            data = None
            if body is not None:
                data = urlencode(body)
                sent["Content-Type"] = "application/x-www-form-urlencoded"
            conn.request(method, path, body=data, headers=sent)
            response = conn.getresponse()
            text = response.read().decode()
            for value in response.headers.get_all("Set-Cookie") or []:
                name, _, rest = value.partition("=")
                self.cookies[name] = rest.split(";", 1)[0].strip('"')
            return response.status, response.headers, text
        finally:
            conn.close()

    def user(self) -> str | None:
        status, _, page = self.request("GET", "/login")
        assert status == 200, page
        found = SIGNED_IN.search(page)
        return found.group(1) if found else None

    def sign_in(self, name: str, token: str, **headers: str) -> tuple[int, Any]:
        if "_xsrf" not in self.cookies:
            self.request("GET", "/login")
        form = {"name": name, "token": token, "_xsrf": self.cookies["_xsrf"]}
        status, got, _ = self.request("POST", "/login", form, **headers)
        return status, got

    def sign_out(self) -> None:
        status, _, _ = self.request("POST", "/logout", {"_xsrf": self.cookies["_xsrf"]})
        assert status == 302


@pytest.fixture
def console(store: Store) -> Iterator[Console]:
    made = Console(store.connector, store.schema, token=TOKEN)
    yield made
    made.executor.shutdown(wait=False)


def test_signing_out_ends_the_session_for_every_copy_of_the_cookie(console: Console) -> None:
    with serving(console) as port:
        alice = Browser(port)
        assert alice.sign_in("alice", TOKEN)[0] == 302
        assert alice.user() == "alice"
        copy = Browser(port, cookies=dict(alice.cookies))  # kept elsewhere, say stolen
        assert copy.user() == "alice"
        alice.sign_out()
        assert alice.user() is None
        assert copy.user() is None  # the console ended it: the old cookie signs in no more


def test_failed_sign_ins_are_limited_per_address(console: Console) -> None:
    with serving(console) as port:
        guesser = Browser(port)
        for n in range(SIGN_IN_ATTEMPTS):
            assert guesser.sign_in("mallory", f"wrong-guess-{n:02d}-xxxxxx")[0] == 403
        # The right token now is refused too, without being compared.
        status, headers = guesser.sign_in("mallory", TOKEN)
        assert status == 429
        assert 0 < int(headers["Retry-After"]) <= 300
        assert guesser.user() is None
        # Another address is not held up by this one's failures.
        other = Browser(port, source="127.0.0.2")
        assert other.sign_in("alice", TOKEN)[0] == 302
        assert other.user() == "alice"


def test_the_cookie_is_secure_behind_tls(console: Console) -> None:
    with serving(console) as port:
        status, headers = Browser(port).sign_in("alice", TOKEN, **{"X-Forwarded-Proto": "https"})
        assert status == 302
        (session,) = [c for c in headers.get_all("Set-Cookie") or [] if "pgq_web_user" in c]
        assert "Secure" in session and "HttpOnly" in session
        status, headers = Browser(port).sign_in("bob", TOKEN)
        (session,) = [c for c in headers.get_all("Set-Cookie") or [] if "pgq_web_user" in c]
        assert "Secure" not in session  # plain HTTP on loopback: it would never come back


def test_a_connection_that_never_finishes_its_headers_is_closed(console: Console) -> None:
    timeout = 0.5
    with (
        serving(console, header_timeout=timeout) as port,
        socket.create_connection(("127.0.0.1", port), timeout=30) as sock,
    ):
        sock.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        started = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server, nothing answered
        elapsed = time.monotonic() - started
    assert timeout * 0.8 <= elapsed < timeout + 10, elapsed


def test_requests_to_a_name_not_allowed_get_nothing(store: Store) -> None:
    console = Console(
        store.connector, store.schema, token=TOKEN, allowed_hosts=frozenset({"Console.Example"})
    )
    try:
        with serving(console) as port:
            browser = Browser(port)
            for host in ("console.example", f"console.example:{port}", "127.0.0.1", "localhost"):
                status, _, page = browser.request("GET", "/login", Host=host)
                assert status == 200, (host, page)
            for host in ("rebound.example", f"rebound.example:{port}", "console.example.evil"):
                status, _, page = browser.request("GET", "/login", Host=host)
                assert status == 400, (host, page)
                assert "--allowed-host" in page
    finally:
        console.executor.shutdown(wait=False)
