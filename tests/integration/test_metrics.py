"""`pgq metrics` against a real Postgres: the figures of `pgq status` in Prometheus format.

The output is read back with a small, strict parser of the text exposition format
(prometheus_client is not a dependency), so a malformed line or a badly escaped
label fails here the way it would fail a Prometheus scrape.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from pg_transport.db.pool import Connector, describe, mask_url, url_to_conninfo
from pg_transport.errors import PgqError
from pg_transport.ops import metrics
from pg_transport.ops import status as status_report
from pg_transport.ops.status import Clients, QueueStatus, Status
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.integration.test_cli import clean_env, invoke, pgq_command

# -- a strict reader of the text exposition format (version 0.0.4) ----------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass
class Parsed:
    type: str
    help: str
    samples: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    labels: list[tuple[str, str]] = []
    i = 0
    while i < len(text):
        match = _LABEL_NAME.match(text, i)
        assert match and text[match.end() : match.end() + 2] == '="', f"bad labels {text!r}"
        name, i = match.group(), match.end() + 2
        value = ""
        while text[i] != '"':
            if text[i] == "\\":
                assert text[i + 1] in _UNESCAPE, f"bad escape in {text!r}"
                value += _UNESCAPE[text[i + 1]]
                i += 2
            else:
                value += text[i]
                i += 1
        labels.append((name, value))
        i += 1
        if i < len(text):
            assert text[i] == ",", f"bad labels {text!r}"
            i += 1
    return tuple(labels)


def parse_exposition(text: str) -> dict[str, Parsed]:
    assert text.endswith("\n"), "the exposition ends with a line feed"
    families: dict[str, Parsed] = {}
    helps: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert name not in helps, f"second HELP for {name}"
            helps[name] = doc.replace("\\n", "\n").replace("\\\\", "\\")
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in {"gauge", "counter", "untyped", "summary", "histogram"}, line
            assert name in helps and name not in families, f"TYPE of {name} out of place"
            families[name] = Parsed(kind, helps[name])
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            assert name in families, f"sample of {name} before its TYPE"
            key = _labels(labels or "")
            assert key not in families[name].samples, f"duplicate sample {line!r}"
            families[name].samples[key] = float(value)
    return families


def by_queue(parsed: dict[str, Parsed], name: str) -> dict[str, float]:
    return {dict(k)["queue"]: v for k, v in parsed[name].samples.items()}


# -- rendering --------------------------------------------------------------------------

ODD_NAMES = ['say "hi"', "back\\slash", "two\nlines", 'all \\" of\n them', "ünï cödé,{x}=1"]


def test_label_values_are_escaped_and_read_back_exactly() -> None:
    report = Status(
        "pgq",
        [QueueStatus(name, n, 0, 0, 0, None) for n, name in enumerate(ODD_NAMES)],
        Clients(0, 0),
    )
    text = metrics.render(report)
    assert 'queue="say \\"hi\\""' in text
    assert 'queue="back\\\\slash"' in text
    assert 'queue="two\\nlines"' in text
    parsed = parse_exposition(text)
    assert by_queue(parsed, "pgq_queue_ready_messages") == {
        name: n for n, name in enumerate(ODD_NAMES)
    }


def test_every_family_has_help_and_type_even_without_samples() -> None:
    parsed = parse_exposition(metrics.render(Status("pgq", [], Clients(0, 0)), 0.25))
    assert parsed["pgq_queue_ready_messages"].samples == {}
    assert parsed["pgq_barriers"].type == "gauge"
    assert parsed["pgq_client_processes"].samples == {(): 0.0}
    assert parsed["pgq_collect_duration_seconds"].samples == {(): 0.25}
    assert all(p.help and p.type == "gauge" for p in parsed.values())


def test_celery_own_queues_are_summed_by_kind_not_labelled() -> None:
    names = {
        "celery": 1,
        "w1@host.celery.pidbox": 2,
        "w2@host.celery.pidbox": 3,
        "3f2a.reply.celery.pidbox": 4,
        "celeryev.5c1e": 5,
    }
    report = Status(
        "pgq", [QueueStatus(q, n, 1, 0, 0, None) for q, n in names.items()], Clients(0, 0)
    )
    parsed = parse_exposition(metrics.render(report))
    assert by_queue(parsed, "pgq_queue_ready_messages") == {"celery": 1}
    assert {dict(k)["kind"]: v for k, v in parsed["pgq_celery_queue_messages"].samples.items()} == {
        "control": 2 + 1 + 3 + 1,
        "reply": 4 + 1,
        "events": 5 + 1,
    }


# -- against Postgres -----------------------------------------------------------------


def message(n: int) -> dict[str, Any]:
    return {"body": f"m{n}", "properties": {}, "headers": {}}


def known_state(store: Store, peek: Peek) -> None:
    """jobs: 2 ready (the oldest for 2 minutes), 1 in flight, 1 delayed, 1 dead; idle: empty."""
    store.publisher.publish("jobs", message(0))
    [doomed] = store.claim(["jobs"], [30.0], 1)
    assert store.dead_letter(doomed.token, "rejected") is not None
    store.publisher.publish("jobs", message(1))
    store.claim(["jobs"], [300.0], 1)
    store.publisher.publish("jobs", message(2), delay=3600)
    store.publisher.publish("jobs", message(3))
    store.publisher.publish("jobs", message(4))
    peek(
        "UPDATE {schema}.message SET visible_at = now() - interval '120 seconds'"
        " WHERE payload->>'body' = 'm3'"
    )
    store.declare_queue("idle")


def test_metrics_match_a_known_queue_state_and_pgq_status(
    broker_url: str, schema: str, store: Store, peek: Peek
) -> None:
    known_state(store, peek)
    result = invoke("metrics", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    parsed = parse_exposition(result.stdout)
    assert by_queue(parsed, "pgq_queue_ready_messages") == {"idle": 0, "jobs": 2}
    assert by_queue(parsed, "pgq_queue_in_flight_messages") == {"idle": 0, "jobs": 1}
    assert by_queue(parsed, "pgq_queue_delayed_messages") == {"idle": 0, "jobs": 1}
    assert by_queue(parsed, "pgq_queue_dead_messages") == {"idle": 0, "jobs": 1}
    ages = by_queue(parsed, "pgq_queue_oldest_ready_age_seconds")
    assert ages["idle"] == 0
    assert 120 <= ages["jobs"] < 180
    assert parsed["pgq_collect_duration_seconds"].samples[()] > 0

    status = invoke("status", "--json", "--url", broker_url, "--schema", schema)
    report = json.loads(status.stdout)
    for queue in report["queues"]:
        for figure in ("ready", "in_flight", "delayed", "dead"):
            family = parsed[f"pgq_queue_{figure}_messages"]
            assert family.samples[(("queue", queue["queue"]),)] == queue[figure]
    assert parsed["pgq_client_processes"].samples[()] == report["clients"]["processes"]


def test_fair_queues_are_told_apart_as_pgq_status_tells_them(
    broker_url: str, schema: str, store: Store
) -> None:
    store.declare_queue("shared", fair=True)
    store.declare_queue("plain")
    store.publisher.publish("shared", message(0))
    result = invoke("metrics", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    assert by_queue(parse_exposition(result.stdout), "pgq_queue_fair") == {
        "plain": 0,
        "shared": 1,
    }
    status = invoke("status", "--json", "--url", broker_url, "--schema", schema)
    assert {q["queue"]: q["fair"] for q in json.loads(status.stdout)["queues"]} == {
        "plain": False,
        "shared": True,
    }
    # Declared fair again without saying: still fair (None keeps what is recorded).
    store.declare_queue("shared")
    again = invoke("metrics", "--url", broker_url, "--schema", schema)
    assert by_queue(parse_exposition(again.stdout), "pgq_queue_fair")["shared"] == 1


def test_odd_queue_names_round_trip_through_postgres(
    broker_url: str, schema: str, store: Store
) -> None:
    for n, name in enumerate(ODD_NAMES):
        for i in range(n + 1):
            store.publisher.publish(name, message(i))
    result = invoke("metrics", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 0, result.output
    ready = by_queue(parse_exposition(result.stdout), "pgq_queue_ready_messages")
    assert ready == {name: n + 1 for n, name in enumerate(ODD_NAMES)}


def test_host_without_serve_is_a_usage_error(broker_url: str, schema: str) -> None:
    result = invoke("metrics", "--url", broker_url, "--schema", schema, "--host", "0.0.0.0")
    assert result.exit_code == 2
    assert "--host goes with --serve" in result.stderr


def test_missing_schema_is_one_line(broker_url: str, schema: str) -> None:
    result = invoke("metrics", "--serve", "0", "--url", broker_url, "--schema", schema)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: pgq schema {schema!r} at {broker_url} does not exist: run `pgq migrate` first"
    ]


# -- --serve ---------------------------------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str

    def get(self, path: str = "/metrics") -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.headers["Content-Type"], response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The server's first stdout line, or a failure after ``timeout`` seconds."""
    lines: list[str] = []
    stdout = proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0]:
        proc.kill()
        raise AssertionError(f"pgq metrics --serve printed nothing: {proc.communicate()[1]}")
    return lines[0]


@pytest.fixture
def served(broker_url: str, schema: str, store: Store) -> Iterator[Served]:
    proc = subprocess.Popen(
        [*pgq_command(), "metrics", "--serve", "0", "--url", broker_url, "--schema", schema],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        line = _first_line(proc, 30)
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/metrics$", line.strip())
        assert match, line
        yield Served(proc, match.group(1))
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_serve_stops_cleanly_on_sigterm(served: Served) -> None:
    # As a container's PID 1 the default action of SIGTERM would be to ignore it.
    assert served.get()[0] == 200
    served.proc.terminate()
    _, stderr = served.proc.communicate(timeout=10)
    assert served.proc.returncode == 0, stderr
    assert "Traceback" not in stderr


def test_serve_answers_each_scrape_with_fresh_figures(
    served: Served, store: Store, peek: Peek
) -> None:
    known_state(store, peek)
    status, content_type, body = served.get()
    assert status == 200
    assert content_type == metrics.CONTENT_TYPE
    assert by_queue(parse_exposition(body), "pgq_queue_ready_messages") == {"idle": 0, "jobs": 2}

    store.publisher.publish("jobs", message(9))
    store.publisher.publish("later", message(10))
    _, _, body = served.get()
    assert by_queue(parse_exposition(body), "pgq_queue_ready_messages") == {
        "idle": 0,
        "jobs": 3,
        "later": 1,
    }
    assert served.get("/nope")[0] == 404
    assert served.get("/")[0] == 200


def test_serve_answers_503_while_the_figures_cannot_be_read(
    served: Served, pg_url: str, schema: str
) -> None:
    from tests.pg import drop_schema

    assert served.get()[0] == 200
    drop_schema(pg_url, schema)
    status, _, body = served.get()
    assert status == 503
    assert body == metrics.UNAVAILABLE
    assert served.proc.poll() is None  # still serving: the next scrape tries again
    served.proc.terminate()
    _, stderr = served.proc.communicate(timeout=10)
    assert "scrape failed: Postgres error: relation" in stderr  # the reason is logged


def test_serve_on_a_port_in_use_is_one_line(broker_url: str, schema: str, store: Store) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                *pgq_command(),
                "metrics",
                "--serve",
                str(port),
                "--url",
                broker_url,
                "--schema",
                schema,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


# -- clients that are slow, hostile, or both ---------------------------------------------


class Trickler:
    """A client that sends a request one byte at a time, ``every`` seconds apart, and
    keeps going (the request never ends) until stopped or cut off."""

    REQUEST = b"GET /metrics HTTP/1.1\r\nHost: pgq\r\nX-Slow: " + b"y" * 100_000

    def __init__(self, port: int, every: float) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(self.REQUEST[:1])  # the request has begun before we return
        self.every = every
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        for byte in self.REQUEST[1:]:
            if self.stopped.wait(self.every):  # the pace of a slow client, not an ordering
                return
            try:
                self.sock.sendall(bytes([byte]))
            except OSError:
                return  # cut off by the server

    def answer(self) -> bytes:
        """Everything the server sends before it closes the connection."""
        received = b""
        try:
            while chunk := self.sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass  # closed while our bytes were still arriving: a reset, not a FIN
        return received

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.sock.close()


def scrape(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_trickling_client_does_not_hold_up_scrapes(served: Served) -> None:
    port = int(served.url.rsplit(":", 1)[1])
    trickler = Trickler(port, every=0.5)  # each byte well within any per-read timeout
    try:
        started = time.monotonic()
        status, body = scrape(served.url, timeout=5)
        assert status == 200 and "pgq_queue_ready_messages" in body
        assert time.monotonic() - started < 5
        assert trickler.thread.is_alive()  # still trickling all along
    finally:
        trickler.close()


@contextmanager
def running(server: metrics.MetricsServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


def handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == metrics.HANDLER_THREAD)


def test_a_request_not_complete_by_the_deadline_is_cut_off_unanswered(store: Store) -> None:
    server = metrics.make_server(
        "127.0.0.1", 0, lambda: status_report.collect(store), request_deadline=0.5
    )
    with running(server):
        trickler = Trickler(server.port, every=0.05)
        started = time.monotonic()
        try:
            assert trickler.answer() == b""
            elapsed = time.monotonic() - started
        finally:
            trickler.close()
    assert 0.4 <= elapsed < 3, elapsed


def test_connections_beyond_the_bound_wait_for_a_free_handler(store: Store) -> None:
    server = metrics.make_server(
        "127.0.0.1", 0, lambda: status_report.collect(store), max_handlers=2, request_deadline=1.0
    )
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            seen.append(handler_threads())

    sampler = threading.Thread(target=sample)
    with running(server) as url:
        sampler.start()
        tricklers = [Trickler(server.port, every=0.05) for _ in range(3)]
        try:
            deadline = time.monotonic() + 5
            while handler_threads() < 2:
                assert time.monotonic() < deadline, "the first two were never served"
            # The third trickler, then this scrape, wait for a trickler's deadline.
            status, _ = scrape(url)
            assert status == 200
        finally:
            done.set()
            sampler.join(10)
            for t in tricklers:
                t.close()
    assert max(seen) == 2


def test_a_failed_scrape_names_no_url_and_logs_why_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "pgq://scraper:s3cret-pw@127.0.0.1:1/metricsdb"
    connector = Connector(url_to_conninfo(url), display_url=mask_url(url))
    down = Store(connector, "pgq")
    server = metrics.make_server(
        "127.0.0.1",
        0,
        lambda: status_report.collect(down),
        describe_error=describe,
        errors=(PgqError, psycopg.Error),
    )
    try:
        with running(server) as served_at, caplog.at_level(logging.WARNING):
            status, body = scrape(served_at)
    finally:
        connector.close()
    assert (status, body) == (503, metrics.UNAVAILABLE)
    [logged] = [r.getMessage() for r in caplog.records if r.name == "pg_transport.metrics"]
    assert logged.startswith("scrape failed: cannot connect to Postgres at ")
    assert "127.0.0.1" in logged and "s3cret-pw" not in logged


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /secret-path?token=abc HTTP/9.9\r\n\r\n",
        b"POST /secret-path?token=abc HTTP/1.0\r\n\r\n",
        b"GET /secret path?token=abc junk HTTP/1.0\r\n\r\n",
    ],
)
def test_error_answers_do_not_quote_the_request(store: Store, request_bytes: bytes) -> None:
    server = metrics.make_server("127.0.0.1", 0, lambda: status_report.collect(store))
    with running(server), socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:
        c.sendall(request_bytes)
        answer = b""
        while chunk := c.recv(4096):
            answer += chunk
    assert b"secret" not in answer and b"token" not in answer
    # A request in no HTTP version it knows gets an HTTP/0.9 answer: the body alone.
    head, _, body = answer.rpartition(b"\r\n\r\n")
    assert re.fullmatch(rb"(400|501|505) [A-Za-z ]+\n", body), answer
    assert not head or head.split()[1] == body[:3]


class Reconnector:
    """A client that connects, sends nothing, and connects again as soon as the server
    drops it, until stopped: what holds connections open without ever asking."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stopped = threading.Event()
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
                    self.connected.set()
                    sock.recv(1)  # until the server drops us (or the test ends)
            except OSError:
                pass

    def stop(self) -> None:
        self.stopped.set()


def test_scrapes_are_answered_while_20_clients_reconnect_as_soon_as_they_are_dropped(
    store: Store,
) -> None:
    deadline = 3.0  # how long each of them holds its connection before it is dropped
    server = metrics.make_server(
        "127.0.0.1", 0, lambda: status_report.collect(store), request_deadline=deadline
    )
    with running(server) as url:
        clients = [Reconnector(server.port) for _ in range(20)]
        try:
            for client in clients:
                assert client.connected.wait(30), "a client could not connect at all"
            for _ in range(3):
                started = time.monotonic()
                status, body = scrape(url, timeout=30)
                elapsed = time.monotonic() - started
                assert status == 200 and "pgq_queue_ready_messages" in body
                # Not behind them: answered before any of them was dropped to make room.
                assert elapsed < deadline, elapsed
        finally:
            for client in clients:
                client.stop()
            server.shutdown()
            for client in clients:
                client.thread.join(30)
