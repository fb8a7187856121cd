"""Batch publishing next to Postgres queues outside Celery and a bare multi-row INSERT.

``python -m benchmarks.batch_peers`` publishes ``--tasks`` messages a round, ``--batch-size``
to a transaction (one commit each, durable), through each way in turn (reversed every
other round, so a machine whose speed drifts meets every way alike):

- ``pgq apply_async``: Celery's ``apply_async`` inside ``pg_transport.batch()``;
- ``Celery alone``: the same ``apply_async`` calls with pgq's ``Channel._put`` (the
  broker's part: building the row, the batch, the statement) doing nothing: what Celery
  and kombu cost above any broker, the floor of every ``apply_async`` way;
- ``pgq kombu``: kombu's ``Producer.publish`` inside ``pg_transport.batch()``;
- ``pgqueuer``: pgqueuer's ``enqueue`` given lists (its batch insert), when pgqueuer is
  installed (``pip install pgqueuer``; it is not a dependency of pgq);
- ``INSERT floor``: psycopg sending one ``INSERT ... SELECT unnest(...)`` of the batch's
  rows (a payload of the size of pgq's Celery message) into a table with one index and
  committing: what a batch costs with no queue semantics and no Python above psycopg.

Reported: each way's messages a second (median over the rounds) and its rate ÷
pgqueuer's (÷ the floor's without pgqueuer), all measured in this run, and the rows each
way's database holds at the end (what it stored: its publishes, or none for Celery
alone). Each way has a database of its own on the server of ``--pg-url``, dropped at
the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from statistics import median
from typing import Any

import psycopg
from celery import Celery
from kombu import Connection, Producer
from psycopg import sql

import pg_transport
from benchmarks.brokers import default_pg_url
from benchmarks.phases import in_turn

__all__ = ["main", "measure"]

#: Publishes ``count`` messages (sequence numbers from ``start``), one batch.
Way = Callable[[int, int], None]


@contextlib.contextmanager
def scratch_database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh database on ``admin_url``'s server; its libpq URL; dropped after."""
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(admin_url, dbname=name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def as_pgq(url: str) -> str:
    """``url`` (libpq keywords or URL) as a ``pgq://`` broker URL."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    user = params.get("user") or "postgres"
    host = params.get("host") or "127.0.0.1"
    return f"pgq://{user}@{host}:{params.get('port') or 5432}/{params['dbname']}"


def pgq_apply_async(url: str, stack: contextlib.ExitStack) -> Way:
    app = Celery("batch_peers", broker=as_pgq(url), set_as_current=False)
    app.conf.broker_transport_options = {"auto_migrate": True}

    @app.task(name="batch_peers.noop")
    def noop(n: int) -> None:
        return None

    noop.apply_async((0,))  # connects, migrates and declares: once, outside the rate
    stack.callback(app.close)

    def publish(start: int, count: int) -> None:
        with pg_transport.batch():
            for n in range(start, start + count):
                noop.apply_async((n,))

    return publish


def celery_alone(url: str, stack: contextlib.ExitStack) -> Way:
    from pg_transport.kombu.channel import Channel

    publish = pgq_apply_async(url, stack)

    def skipped(start: int, count: int) -> None:
        real = Channel._put
        Channel._put = lambda self, queue, message, **kwargs: None  # type: ignore[method-assign]
        try:
            publish(start, count)
        finally:
            Channel._put = real  # type: ignore[method-assign]

    return skipped


def pgq_kombu(url: str, stack: contextlib.ExitStack) -> Way:
    conn = stack.enter_context(Connection(as_pgq(url), transport_options={"auto_migrate": True}))
    producer = Producer(conn.default_channel)
    producer.publish({"n": 0}, routing_key="batched", declare=[conn.SimpleQueue("batched").queue])

    def publish(start: int, count: int) -> None:
        with pg_transport.batch():
            for n in range(start, start + count):
                producer.publish({"n": n}, routing_key="batched")

    return publish


def pgqueuer(url: str, stack: contextlib.ExitStack) -> Way | None:
    try:
        from pgqueuer.db import PsycopgDriver, SyncPsycopgDriver
        from pgqueuer.queries import Queries, SyncQueries
    except ImportError:
        return None

    async def install() -> None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as aconn:
            await Queries(PsycopgDriver(aconn)).install()

    asyncio.run(install())
    conn = stack.enter_context(psycopg.connect(url, autocommit=True))
    queries = SyncQueries(SyncPsycopgDriver(conn))

    def publish(start: int, count: int) -> None:
        numbers = range(start, start + count)
        queries.enqueue(
            ["noop"] * count, [json.dumps({"n": n}).encode() for n in numbers], [0] * count
        )

    return publish


def insert_floor(url: str, stack: contextlib.ExitStack) -> Way:
    conn = stack.enter_context(psycopg.connect(url))
    conn.execute(
        "CREATE TABLE floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " queue text NOT NULL, payload json NOT NULL)"
    )
    conn.commit()
    body = json.dumps({"pad": "x" * 900})  # about a Celery message's size

    def publish(start: int, count: int) -> None:
        payloads = [body] * count
        conn.execute(
            "INSERT INTO floor (queue, payload) SELECT 'q', p::json FROM unnest(%s::text[]) AS p",
            (payloads,),
        )
        conn.commit()

    return publish


WAYS: dict[str, Callable[[str, contextlib.ExitStack], Way | None]] = {
    "pgq apply_async": pgq_apply_async,
    "Celery alone": celery_alone,
    "pgq kombu": pgq_kombu,
    "pgqueuer": pgqueuer,
    "INSERT floor": insert_floor,
}


def measure(pg_url: str, tasks: int, rounds: int, size: int) -> dict[str, Any]:
    """Each way's rates, a round each; the ways that could not run are left out."""
    rates: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        ways: dict[str, Way] = {}
        urls: dict[str, str] = {}
        for name, make in WAYS.items():
            db = f"pgq_bench_way{len(ways)}_{uuid.uuid4().hex[:8]}"
            url = stack.enter_context(scratch_database(pg_url, db))
            way = make(url, stack)
            if way is not None:
                ways[name] = way
                urls[name] = url
                rates[name] = []
        for turn in range(rounds):
            for name in in_turn(list(ways), turn):
                began = time.perf_counter()
                for start in range(1, tasks + 1, size):
                    ways[name](start, min(size, tasks + 1 - start))
                rates[name].append(tasks / (time.perf_counter() - began))
        stored = {name: stored_rows(url) for name, url in urls.items()}
    rate = {name: median(each) for name, each in rates.items()}
    base = "pgqueuer" if "pgqueuer" in rate else "INSERT floor"
    return {
        "tasks": tasks,
        "rounds": rounds,
        "batch_size": size,
        "rate": rate,
        "ratio_to": base,
        "ratio": {name: value / rate[base] for name, value in rate.items()},
        "stored": stored,
    }


def stored_rows(url: str) -> int:
    """The rows of every table a way publishes to in its database: pgq's messages,
    pgqueuer's jobs, the floor's table (whichever it has)."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class AS c"
            " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE (n.nspname, c.relname) IN (('pgq', 'message'), ('public', 'pgqueuer'),"
            " ('public', 'floor'))"
        ).fetchall()
        return sum(
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.SQL(t))).fetchone()[0]  # type: ignore[index]
            for (t,) in tables
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_peers", description=__doc__)
    parser.add_argument("--pg-url", default=default_pg_url(), help="a superuser's libpq URL")
    parser.add_argument("--tasks", type=int, default=3000, help="messages a round, each way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=100, help="messages a commit")
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    args = parser.parse_args(argv)
    result = measure(args.pg_url, args.tasks, args.rounds, args.batch_size)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.tasks} messages a round, {args.batch_size} a commit, {args.rounds} rounds")
    print(f"{'way':<18}{'msg/s':>10}{'÷ ' + result['ratio_to']:>16}")
    for name, value in result["rate"].items():
        print(f"{name:<18}{value:>10.0f}{result['ratio'][name]:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
