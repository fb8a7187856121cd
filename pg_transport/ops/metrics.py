"""``pgq metrics``: the figures of ``pgq status`` in Prometheus' text exposition format.

One scrape is one :func:`pg_transport.ops.status.collect` call, so the numbers are
exactly those of ``pgq status`` at that moment. :func:`serve` answers scrapes over
HTTP with the standard library only; every ``GET /metrics`` computes fresh figures.

The server is the standard library's, made safe for a port others can reach rather than
prometheus_client's: that would be a new dependency, and its exporter starts a thread
per connection without bound and waits for a request as long as bytes keep trickling
in. Here each connection gets a thread from a fixed number of slots and must deliver its
whole request within a deadline, so one slow (or hostile) client holds one slot for a
bounded time and scrapes keep being answered. Error bodies name nothing of the
request or the database: the reason a scrape failed goes to the log.

Format: https://prometheus.io/docs/instrumenting/exposition_formats/ (version 0.0.4).
"""

from __future__ import annotations

import io
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import FrameType
from typing import Any

from pg_transport.ops.status import Status, celery_own

__all__ = [
    "CONTENT_TYPE",
    "Family",
    "MetricsServer",
    "escape_help",
    "escape_label_value",
    "make_server",
    "render",
    "serve",
]

logger = logging.getLogger("pg_transport.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds a client has to send its whole request (request line and headers), however
#: it spaces its bytes: a per-read timeout would let a byte every few seconds hold a
#: connection for good.
REQUEST_DEADLINE = 10.0
#: Seconds to write an answer to a client that does not read it.
WRITE_TIMEOUT = 10.0
#: Connections served at once, each from its first byte (a thread waits for the request
#: too). Prometheus scrapes a target from one connection at a time; the rest is room for
#: dozens of clients that connect and say nothing (20 of them reconnecting the moment
#: they are dropped held 8 slots for good, and scrapes missed). A flood beyond it waits
#: in the listen backlog instead of becoming a flood of threads.
MAX_HANDLERS = 64
#: Connections the kernel holds for us while every handler is busy (the standard
#: library's 5 drops the rest, so a scraper's connection could wait for seconds).
LISTEN_BACKLOG = 128
#: Name of the threads that serve one connection each.
HANDLER_THREAD = "pgq-metrics-request"
#: What a failed scrape answers: not the error, which may name the database.
UNAVAILABLE = "pgq metrics: database unavailable\n"


def escape_label_value(value: str) -> str:
    """A label value between double quotes: backslash, quote and line feed escaped.

    Queue names may hold any character; these three are the ones the format
    reserves inside a label value, everything else is taken literally as UTF-8.
    """
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text: only backslash and line feed are escaped there."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


@dataclass(frozen=True)
class Family:
    """One metric: its name, help, type and samples (labels, value)."""

    name: str
    help: str
    type: str
    samples: list[tuple[dict[str, str], float]]

    def lines(self) -> Iterable[str]:
        yield f"# HELP {self.name} {escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.type}"
        for labels, value in self.samples:
            text = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
            selector = f"{self.name}{{{text}}}" if text else self.name
            yield f"{selector} {_number(value)}"


def families(report: Status, collect_seconds: float | None = None) -> list[Family]:
    """The metric families of one status report, in a fixed order."""
    # Celery's own queues (pidbox mailboxes and replies, event receivers') are no queue
    # of tasks, and reply and event queues are named after a new id by each client that
    # makes one: as labels they would add series without bound. Their waiting messages
    # are summed by kind instead (a growing mailbox still shows: a worker not reading it).
    queues = [q for q in report.queues if celery_own(q.queue) is None]
    own: dict[str, float] = {"control": 0.0, "reply": 0.0, "events": 0.0}
    for q in report.queues:
        kind = celery_own(q.queue)
        if kind is not None:
            own[kind] += q.ready + q.in_flight + q.delayed

    def per_queue(name: str, help: str, value: Callable[[Any], float]) -> Family:
        return Family(name, help, "gauge", [({"queue": q.queue}, value(q)) for q in queues])

    found = [
        per_queue(
            "pgq_queue_ready_messages",
            "Messages visible now: the next claim may take them.",
            lambda q: q.ready,
        ),
        per_queue(
            "pgq_queue_in_flight_messages",
            "Messages claimed by a consumer whose lease has not run out.",
            lambda q: q.in_flight,
        ),
        per_queue(
            "pgq_queue_delayed_messages",
            "Messages waiting for their ETA, never delivered yet.",
            lambda q: q.delayed,
        ),
        per_queue(
            "pgq_queue_dead_messages",
            "Rows of this queue in the dead-letter table.",
            lambda q: q.dead,
        ),
        per_queue(
            "pgq_queue_oldest_ready_age_seconds",
            "Seconds the longest-waiting ready message has been deliverable; 0 when none is.",
            lambda q: q.oldest_ready_age_s or 0.0,
        ),
        per_queue(
            "pgq_queue_blocked_keys",
            "Ordering keys with messages parked behind an earlier message of the key.",
            lambda q: q.blocked_keys,
        ),
        per_queue(
            "pgq_queue_blocked_messages",
            "Messages parked behind an earlier message of their ordering key.",
            lambda q: q.blocked,
        ),
        per_queue(
            "pgq_queue_oldest_blocked_age_seconds",
            "Seconds since the oldest message parked behind its ordering key was published;"
            " 0 when none is parked.",
            lambda q: q.oldest_blocked_age_s or 0.0,
        ),
        per_queue(
            "pgq_queue_following_messages",
            "Followers parked until the task they follow finishes or their wait runs out.",
            lambda q: q.following,
        ),
        Family(
            "pgq_queue_unique_queued_messages",
            "Messages holding a unique key while queued (not leased); no series where the"
            " role may not count them.",
            "gauge",
            [({"queue": q.queue}, q.unique_queued) for q in queues if q.unique_queued is not None],
        ),
        Family(
            "pgq_queue_unique_running_messages",
            "Messages holding a unique key while running (leased, unique_while"
            ' "queued_or_running"); no series where the role may not count them.',
            "gauge",
            [
                ({"queue": q.queue}, q.unique_running)
                for q in queues
                if q.unique_running is not None
            ],
        ),
        per_queue(
            "pgq_queue_fair",
            "1 for a queue claimed in fair shares over its messages' fair keys, else 0.",
            lambda q: 1 if q.fair else 0,
        ),
        Family(
            "pgq_celery_queue_messages",
            "Messages waiting in Celery's own queues (not per-queue series), by kind:"
            " control (workers' remote-control mailboxes), reply (replies to inspect and"
            " control calls), events (event receivers' queues).",
            "gauge",
            [({"kind": kind}, value) for kind, value in own.items()],
        ),
        Family(
            "pgq_client_processes",
            "pgq client processes (workers and publishers) connected to the database.",
            "gauge",
            [({}, report.clients.processes)],
        ),
        Family(
            "pgq_client_sessions",
            "Sessions of the pgq client processes.",
            "gauge",
            [({}, report.clients.sessions)],
        ),
        Family(
            "pgq_barriers",
            "Fan-in barriers by status.",
            "gauge",
            [({"status": b.status}, b.count) for b in report.barriers],
        ),
    ]
    found += limit_families(report)
    if collect_seconds is not None:
        found.append(
            Family(
                "pgq_collect_duration_seconds",
                "Seconds the queries behind these figures took.",
                "gauge",
                [({}, collect_seconds)],
            )
        )
    return found


def limit_families(report: Status) -> list[Family]:
    """The flow limits (docs/flow-control.md), one series per limit: its definition, the
    messages holding its slots and those parked waiting for one. Counted per limit, never
    per key: keys are the application's values (and unbounded as labels), and the
    monitor role may not read them (``pgq limit show --keys`` does, as the workers' role)."""
    limits = report.limits
    return [
        Family(
            "pgq_limit_in_flight_messages",
            "Messages holding one of the limit's concurrency slots (claimed, lease running).",
            "gauge",
            [({"limit": lim.name}, lim.in_flight) for lim in limits],
        ),
        Family(
            "pgq_limit_waiting_messages",
            "Messages parked until a concurrency slot of their key frees.",
            "gauge",
            [({"limit": lim.name}, lim.waiting) for lim in limits],
        ),
        Family(
            "pgq_limit_concurrency",
            "Slots per key of a limit with a concurrency (limits without one have no series).",
            "gauge",
            [({"limit": lim.name}, lim.concurrency) for lim in limits if lim.concurrency],
        ),
        Family(
            "pgq_limit_rate_per_second",
            "Starts per second a limit with a rate allows (limits without one have no series).",
            "gauge",
            [({"limit": lim.name}, lim.per_second) for lim in limits if lim.per_second],
        ),
        Family(
            "pgq_limit_burst",
            "Starts a limit with a rate allows at once after an idle spell.",
            "gauge",
            [({"limit": lim.name}, lim.burst) for lim in limits if lim.per_second],
        ),
    ]


def render(report: Status, collect_seconds: float | None = None) -> str:
    """The exposition text of one status report, ending in a line feed."""
    return "".join(
        line + "\n" for family in families(report, collect_seconds) for line in family.lines()
    )


class MetricsServer(HTTPServer):
    """Answers ``GET /metrics`` with freshly computed figures.

    Each connection is served in a thread of its own, at most ``max_handlers`` at once;
    while all are busy the next connection waits in the listen backlog, and each busy
    one is done within ``request_deadline`` plus one scrape. Scrapes themselves run one
    at a time, so a burst of scrapers never runs the (whole-table) status queries
    concurrently.
    """

    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        scrape: Callable[[], str],
        describe_error: Callable[[BaseException], str],
        errors: tuple[type[BaseException], ...],
        *,
        max_handlers: int = MAX_HANDLERS,
        request_deadline: float = REQUEST_DEADLINE,
    ) -> None:
        self.scrape = scrape
        self.describe_error = describe_error
        self.errors = errors
        self.request_deadline = request_deadline
        self.scraping = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_handlers)
        super().__init__(address, _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        # In the accepting thread: it accepts nothing more until a slot is free.
        self._slots.acquire()
        try:
            threading.Thread(
                target=self._serve_one,
                args=(request, client_address),
                name=HANDLER_THREAD,
                daemon=True,  # a client still sending must not keep the process alive
            ).start()
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away or ran out of time is not news; anything else is a bug.
        logger.debug("request from %s failed", client_address, exc_info=True)


class _UntilDeadline(io.RawIOBase):
    """A socket's incoming bytes, readable until a deadline for all of them together:
    every read may wait only for what is left of it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    server_version = "pgq-metrics"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        deadline = time.monotonic() + self.server.request_deadline
        self.rfile = io.BufferedReader(_UntilDeadline(self.connection, deadline))

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(HTTPStatus.OK, "pgq metrics: scrape /metrics\n", "text/plain; charset=utf-8")
            return
        if path != "/metrics":
            self._send(
                HTTPStatus.NOT_FOUND, "not found: scrape /metrics\n", "text/plain; charset=utf-8"
            )
            return
        try:
            with self.server.scraping:
                body = self.server.scrape()
        except self.server.errors as exc:
            # The target shows as down (Prometheus' `up` is 0); why is logged here, not
            # told to whoever asked: the reason may name the database and its host.
            logger.warning("scrape failed: %s", self.server.describe_error(exc))
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, UNAVAILABLE, "text/plain; charset=utf-8")
            return
        self._send(HTTPStatus.OK, body, CONTENT_TYPE)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The standard page quotes the request back (a bad request line, a method): say
        # only the status.
        status = HTTPStatus(code)
        self.close_connection = True
        self._send(status, f"{status.value} {status.phrase}\n", "text/plain; charset=utf-8")

    def _send(self, status: HTTPStatus, body: str, content_type: str) -> None:
        data = body.encode("utf-8")
        self.connection.settimeout(WRITE_TIMEOUT)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # One line per scrape every few seconds is noise; failures are logged above.
        return


def make_server(
    host: str,
    port: int,
    collect: Callable[[], Status],
    *,
    describe_error: Callable[[BaseException], str] = str,
    errors: tuple[type[BaseException], ...] = (Exception,),
    max_handlers: int = MAX_HANDLERS,
    request_deadline: float = REQUEST_DEADLINE,
) -> MetricsServer:
    """A server on ``host:port`` (0 picks a free port) that calls ``collect`` per scrape.

    ``errors`` are the exceptions a scrape answers with 503 (:data:`UNAVAILABLE`) and
    logs as their one-line ``describe_error``; anything else is a bug and propagates.
    """

    def scrape() -> str:
        started = time.perf_counter()
        report = collect()
        return render(report, time.perf_counter() - started)

    return MetricsServer(
        (host, port),
        scrape,
        describe_error,
        errors,
        max_handlers=max_handlers,
        request_deadline=request_deadline,
    )


class _Stopped(BaseException):
    """SIGTERM, raised wherever the main thread is (a BaseException, as
    KeyboardInterrupt is, so the server's per-request error handling lets it through)."""


def serve(server: MetricsServer) -> None:
    """Serve until SIGINT or SIGTERM, then close the socket and return.

    As a container's PID 1, a process that leaves SIGTERM to its default action
    ignores it, and ``docker stop`` waits out its timeout to kill it.
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stopped()

    handled = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if handled else None
    try:
        server.serve_forever()
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        server.server_close()
