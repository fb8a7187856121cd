"""pgq next to kombu's own Postgres transports, pgmq and SQLAlchemy, at the kombu level.

``python -m benchmarks.compare`` runs each transport on the Postgres of ``--pg-url``,
each in a database of its own (created here, dropped at the end), with kombu's
defaults for that transport (durable publishes, each transport's own wake-up or poll):

- ``pgq``: ``pgq://`` (LISTEN/NOTIFY wake-ups, durable commits);
- ``sqlalchemy``: ``sqla+postgresql+psycopg://`` (kombu's virtual transport: a poll
  every ``polling_interval``, 1 s by default);
- ``pgmq``: ``pgmq://`` (kombu's transport over the ``pgmq`` Python client: a
  long-poll read on the server, every 100 ms by default). It needs the ``pgmq``
  package (``pip install pgmq``) and pgmq's SQL in the database: ``CREATE EXTENSION
  pgmq`` where the server has the extension, else the plain-SQL install the client
  ships (``pgmq.install``). Without them it is skipped and the reason reported;
- ``pgmq-notify``: the same with its ``use_notify`` option (off by default) and
  ``wait_time_seconds`` 0: LISTEN/NOTIFY wake-ups (at most one a queue every 250 ms
  by default) instead of the long poll. With the default ``wait_time_seconds`` (10)
  the transport long-polls first and waits for a notification only after a poll
  came back empty, so ``use_notify`` alone changes no latency.

None of these is a dependency of pgq. Every round runs three phases, and in each
phase every transport in turn (reversed every other round, so no transport always
goes first):

- publish: ``--messages`` messages from one kombu ``Producer`` (persistent delivery
  mode, the default), one at a time: messages a second;
- consume: the same messages from one kombu ``Consumer`` (prefetch ``--prefetch``),
  each acked in its callback: messages a second, from the first ``drain_events`` to
  the last ack;
- idle latency: ``--samples`` messages, each published once the last one was received,
  to a consumer waiting in ``drain_events`` in another thread: milliseconds from the
  publish call to the consumer's callback (the first ``WARMUP`` of each round left out).

Reported: each transport's median rates over the rounds, its latency p50/p99 over every
sample of every round, each as a ratio to pgq's, and what each database held at the end
(a check that consume drained what publish stored).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue as queues
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import psycopg
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message

from benchmarks.batch_peers import as_pgq, scratch_database
from benchmarks.brokers import default_pg_url
from benchmarks.phases import in_turn, percentile

__all__ = ["TRANSPORTS", "main", "measure"]

TRANSPORTS = ("pgq", "sqlalchemy", "pgmq", "pgmq-notify")
QUEUE = "compare"
#: Latency samples of each round left out: the consumer's first wait after connecting.
WARMUP = 2
#: The gap before each latency sample, drawn uniformly over one second, the longest
#: poll interval here (kombu's virtual transports poll every second when idle; each
#: transport's consumer polls at once after a delivery): the message comes at a phase
#: of the consumer's poll drawn uniformly.
GAP_SECONDS = (0.02, 1.02)
#: A bound on one phase's wait for a message that was published (no transport here
#: takes more than its poll interval, 1 s, on an idle machine).
RECEIVE_TIMEOUT = 30.0


@dataclass
class Setup:
    """One transport's broker URL and options in its own database, or why it cannot run."""

    url: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


def pgq_setup(db_url: str) -> Setup:
    return Setup(as_pgq(db_url), {"auto_migrate": True})


def sqlalchemy_setup(db_url: str) -> Setup:
    if importlib.util.find_spec("sqlalchemy") is None:
        return Setup(skipped="sqlalchemy is not installed (pip install sqlalchemy)")
    params = psycopg.conninfo.conninfo_to_dict(db_url)
    user = params.get("user") or "postgres"
    host = params.get("host") or "127.0.0.1"
    port = params.get("port") or 5432
    # Plain sqla+postgresql:// means SQLAlchemy's default driver, psycopg2; pgq uses psycopg 3.
    return Setup(f"sqla+postgresql+psycopg://{user}@{host}:{port}/{params['dbname']}")


def pgmq_setup(db_url: str, options: dict[str, Any]) -> Setup:
    """pgmq's SQL in the database: the server's extension where it has one, else the
    plain-SQL install the ``pgmq`` client ships (``pgmq.install``)."""
    if importlib.util.find_spec("pgmq") is None:
        return Setup(skipped="the pgmq client is not installed (pip install pgmq)")
    with psycopg.connect(db_url, autocommit=True) as conn:
        available = conn.execute(
            "SELECT 1 FROM pg_available_extensions WHERE name = 'pgmq'"
        ).fetchone()
        if available:
            conn.execute("CREATE EXTENSION pgmq")
    if not available:
        try:
            from pgmq.install import install_pgmq_from_sql
        except ImportError:
            return Setup(
                skipped="the server has no pgmq extension and this pgmq client ships no SQL"
                " install (pgmq.install: pgmq 1.1 or later)"
            )
        install_pgmq_from_sql(dsn=db_url)
    params = psycopg.conninfo.conninfo_to_dict(db_url)
    user = params.get("user") or "postgres"
    host = params.get("host") or "127.0.0.1"
    port = params.get("port") or 5432
    # init_extension off: kombu's default runs CREATE EXTENSION, which a plain-SQL
    # install (no extension on the server) cannot do; the SQL is in place either way.
    return Setup(
        f"pgmq://{user}@{host}:{port}/{params['dbname']}", {"init_extension": False, **options}
    )


@dataclass
class Transport:
    """One transport under test: its connection settings and what it measured."""

    name: str
    setup: Setup
    db_url: str
    publish: list[float] = field(default_factory=list)
    consume: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    published: int = 0
    consumed: int = 0

    def connect(self) -> Connection:
        return Connection(self.setup.url, transport_options=dict(self.setup.options))


def entities() -> tuple[Exchange, Queue]:
    exchange = Exchange(QUEUE, type="direct", durable=True)
    return exchange, Queue(QUEUE, exchange, routing_key=QUEUE, durable=True)


def publish_phase(transport: Transport, count: int) -> None:
    exchange, queue = entities()
    with transport.connect() as conn:
        producer = Producer(conn.default_channel, exchange=exchange)
        producer.publish({"n": -1}, routing_key=QUEUE, declare=[queue])  # connects, declares
        conn.default_channel.queue_purge(QUEUE)
        began = time.perf_counter()
        for n in range(count):
            producer.publish({"n": n}, routing_key=QUEUE)
        transport.publish.append(count / (time.perf_counter() - began))
    transport.published += count


def consume_phase(transport: Transport, count: int, prefetch: int) -> None:
    _, queue = entities()
    got = 0

    def on_message(body: Any, message: Message) -> None:
        nonlocal got
        message.ack()
        got += 1

    with transport.connect() as conn:
        channel = conn.default_channel
        channel.basic_qos(0, prefetch, False)
        with Consumer(channel, [queue], callbacks=[on_message], accept=["json"]):
            began = time.perf_counter()
            # Slower than 10 a second is no longer a measurement but a stuck consumer.
            deadline = time.monotonic() + RECEIVE_TIMEOUT + count * 0.1
            while got < count:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{transport.name}: consumed {got} of {count}")
                with contextlib.suppress(socket.timeout):
                    conn.drain_events(timeout=1.0)
            transport.consume.append(count / (time.perf_counter() - began))
    transport.consumed += got


def latency_phase(
    transport: Transport,
    samples: int,
    prefetch: int,
    rng: random.Random,
    gap: tuple[float, float] = GAP_SECONDS,
) -> None:
    exchange, queue = entities()
    received: queues.Queue[tuple[int, float]] = queues.Queue()
    stop = threading.Event()
    consuming = threading.Event()
    failed: list[BaseException] = []

    def on_message(body: Any, message: Message) -> None:
        at = time.perf_counter()
        message.ack()
        received.put((int(body["n"]), at))

    def consume() -> None:
        try:
            with transport.connect() as conn:
                channel = conn.default_channel
                channel.basic_qos(0, prefetch, False)
                with Consumer(channel, [queue], callbacks=[on_message], accept=["json"]):
                    consuming.set()
                    while not stop.is_set():
                        with contextlib.suppress(socket.timeout):
                            conn.drain_events(timeout=1.0)
        except BaseException as exc:  # reported by the publishing side
            failed.append(exc)
            received.put((-1, 0.0))
            consuming.set()

    consumer = threading.Thread(target=consume, name=f"compare-{transport.name}", daemon=True)
    try:
        with transport.connect() as conn:
            producer = Producer(conn.default_channel, exchange=exchange)
            # Declared before the consumer starts, which declares too: kombu's pgmq
            # transport with use_notify re-creates the queue's trigger on each declare,
            # and two at once deadlock.
            queue(conn.default_channel).declare()  # exchange, queue and binding
            consumer.start()
            if not consuming.wait(RECEIVE_TIMEOUT) or failed:
                raise RuntimeError(f"{transport.name}: the consumer did not start") from (
                    failed[0] if failed else None
                )
            for n in range(samples + WARMUP):
                # Not ordering: the consumer is idle when each message comes, at a phase
                # of its poll drawn at random.
                time.sleep(rng.uniform(*gap))
                sent = time.perf_counter()
                producer.publish({"n": n}, routing_key=QUEUE)
                got, at = received.get(timeout=RECEIVE_TIMEOUT)
                if failed:
                    raise RuntimeError(f"{transport.name}: the consumer failed") from failed[0]
                if got != n:
                    raise RuntimeError(f"{transport.name}: sample {n} received as {got}")
                if n >= WARMUP:
                    transport.latency_ms.append((at - sent) * 1e3)
                transport.published += 1
                transport.consumed += 1
    finally:
        stop.set()
        if consumer.is_alive():
            consumer.join(timeout=RECEIVE_TIMEOUT)


def held(transport: Transport) -> int:
    """Messages still in the transport's database (none once consume drained them)."""
    with transport.connect() as conn:
        _, queue = entities()
        return int(queue(conn.default_channel).queue_declare(passive=True).message_count)


def dispose(transport: Transport) -> None:
    """kombu's SQLAlchemy transport caches an engine per URL: close its connections
    before the database is dropped."""
    if transport.name == "sqlalchemy":
        from kombu.transport.sqlalchemy import Channel

        cached = Channel._engines.pop(transport.setup.url.removeprefix("sqla+"), None)
        if cached is not None:
            cached[0].dispose()


@contextlib.contextmanager
def prepared(pg_url: str, names: list[str]) -> Iterator[tuple[list[Transport], dict[str, str]]]:
    """Each transport named in its own scratch database, and the reasons of those skipped."""
    makers: dict[str, Callable[[str], Setup]] = {
        "pgq": pgq_setup,
        "sqlalchemy": sqlalchemy_setup,
        "pgmq": lambda url: pgmq_setup(url, {}),
        "pgmq-notify": lambda url: pgmq_setup(url, {"use_notify": True, "wait_time_seconds": 0}),
    }
    ready: list[Transport] = []
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            db = f"pgq_bench_cmp_{name}_{uuid.uuid4().hex[:8]}"
            db_url = stack.enter_context(scratch_database(pg_url, db))
            setup = makers[name](db_url)
            if setup.skipped:
                skipped[name] = setup.skipped
                continue
            transport = Transport(name, setup, db_url)
            stack.callback(dispose, transport)
            ready.append(transport)
        yield ready, skipped


def measure(
    pg_url: str,
    names: list[str],
    *,
    messages: int,
    samples: int,
    rounds: int,
    prefetch: int,
    seed: int = 0,
    gap: tuple[float, float] = GAP_SECONDS,
) -> dict[str, Any]:
    """Each transport's rates and latencies over ``rounds`` rounds, and what was skipped."""
    rng = random.Random(seed)
    with prepared(pg_url, names) as (ready, skipped):
        for turn in range(rounds):
            for transport in in_turn(ready, turn):
                publish_phase(transport, messages)
            for transport in in_turn(ready, turn):
                consume_phase(transport, messages, prefetch)
            for transport in in_turn(ready, turn):
                latency_phase(transport, samples, prefetch, rng, gap)
        left = {t.name: held(t) for t in ready}
    found: dict[str, dict[str, Any]] = {}
    for t in ready:
        found[t.name] = {
            "publish_per_s": median(t.publish),
            "consume_per_s": median(t.consume),
            "latency_p50_ms": percentile(t.latency_ms, 0.50),
            "latency_p99_ms": percentile(t.latency_ms, 0.99),
            "latency_samples": len(t.latency_ms),
            "published": t.published,
            "consumed": t.consumed,
            "left_in_queue": left[t.name],
        }
    if "pgq" in found:
        base = found["pgq"]
        for row in found.values():
            for key in ("publish_per_s", "consume_per_s", "latency_p50_ms", "latency_p99_ms"):
                row[f"{key}_vs_pgq"] = row[key] / base[key]
    return {
        "messages": messages,
        "samples": samples,
        "rounds": rounds,
        "prefetch": prefetch,
        "gap_seconds": list(gap),
        "load_average": list(os.getloadavg()),
        "transports": found,
        "skipped": skipped,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['messages']} messages a round, {result['samples']} latency samples a round,"
        f" {result['rounds']} rounds, prefetch {result['prefetch']},"
        f" load average {' '.join(f'{x:.2f}' for x in result['load_average'])}",
        f"{'transport':<12}{'publish/s':>11}{'consume/s':>11}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'publish ÷ pgq':>15}{'consume ÷ pgq':>15}",
    ]
    for name, row in result["transports"].items():
        lines.append(
            f"{name:<12}{row['publish_per_s']:>11.0f}{row['consume_per_s']:>11.0f}"
            f"{row['latency_p50_ms']:>9.1f}{row['latency_p99_ms']:>9.1f}"
            f"{row.get('publish_per_s_vs_pgq', float('nan')):>15.2f}"
            f"{row.get('consume_per_s_vs_pgq', float('nan')):>15.2f}"
        )
    for name, reason in result["skipped"].items():
        lines.append(f"{name:<12}skipped: {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__)
    parser.add_argument("--pg-url", default=default_pg_url(), help="a superuser's libpq URL")
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help="comma-separated, of " + ", ".join(TRANSPORTS),
    )
    parser.add_argument("--messages", type=int, default=2000, help="publish/consume, a round")
    parser.add_argument("--samples", type=int, default=80, help="latency samples, a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=10, help="the consumers' prefetch count")
    parser.add_argument("--seed", type=int, default=0, help="of the latency gaps")
    parser.add_argument(
        "--max-gap",
        type=float,
        default=GAP_SECONDS[1],
        help="longest gap before a latency sample, s (below 1 s, the SQLAlchemy transport's"
        " latency is biased up: it polls every second)",
    )
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.transports.split(",") if n.strip()]
    unknown = set(names) - set(TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports: {', '.join(sorted(unknown))}")
    result = measure(
        args.pg_url,
        names,
        messages=args.messages,
        samples=args.samples,
        rounds=args.rounds,
        prefetch=args.prefetch,
        seed=args.seed,
        gap=(min(GAP_SECONDS[0], args.max_gap), args.max_gap),
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
