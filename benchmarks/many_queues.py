"""Consuming many queues at once: one consumer's drain rate over N queues ÷ over one.

``python -m benchmarks.many_queues`` fills a scratch schema with ``--messages`` messages
(Celery-shaped, in bulk), spread evenly over each count of ``--queues`` in turn, and
drains them with one consumer acking every message, at two depths:

- ``store``: the claim statement alone, as a worker sends it (a prefetch window a
  claim, the previous window's acks riding on it), asking every queue of the set for
  up to a window each (``store``) or for a share of the window each (``shared``:
  ``per_queue`` = window ÷ queues, rounded up);
- ``kombu``: a kombu ``Consumer`` of every queue (``drain_events``, ``ack``): the engine
  choosing which queues to claim, and the statements it sends.

Reported per queue count: messages a second at each depth (the best of ``--rounds``),
also as a ratio to the one-queue rate, and for the kombu consumer the statements it sent
and the queues its claims named (a per-claim cost that must not grow with the number of
queues).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kombu import Connection, Consumer, Queue

from benchmarks.brokers import default_pg_url
from benchmarks.scratch import Scratch, scratch
from pg_transport.store import Claimed, Lease

__all__ = ["drain_kombu", "drain_store", "main", "measure"]


def _fill(s: Scratch, queues: list[str], messages: int) -> None:
    """``messages`` messages over ``queues``, round robin by id (the order a claim over
    all of them takes), each queue declared as a consumer would."""
    for q in queues:
        s.store.declare_queue(q)
    per = -(-messages // len(queues))
    for n, q in enumerate(queues):
        s.fill(q, min(per, messages - n * per) if n * per < messages else 0)


def drain_store(
    s: Scratch, queues: list[str], messages: int, window: int, per_queue: int | None = None
) -> float:
    """Claim and ack every message over all of ``queues`` (``per_queue`` candidates of
    each a claim); seconds taken."""
    vts, attempts = [30.0] * len(queues), [5] * len(queues)
    done, acks = 0, list[Lease]()
    start = time.perf_counter()
    while done < messages:
        shares = {} if per_queue is None else {"per_queue": per_queue}
        batch: list[Claimed] = s.store.claim(queues, vts, window, attempts, acks=acks, **shares)
        if not batch:
            break
        acks = [c.token for c in batch]
        done += len(batch)
    s.store.ack(acks)
    elapsed = time.perf_counter() - start
    if done != messages:
        raise RuntimeError(f"store drained {done} of {messages}")
    return elapsed


def drain_kombu(
    url: str, schema: str, queues: list[str], messages: int, window: int
) -> dict[str, Any]:
    """A kombu consumer of every queue drains ``messages``, acking each: seconds taken,
    statements sent, queue names its claims carried."""
    got = 0

    def on_message(body: Any, message: Any) -> None:
        nonlocal got
        message.ack()
        got += 1

    with Connection(url, transport_options={"schema": schema}) as conn:
        conn.connect()
        channel = conn.channel()
        consumer = Consumer(
            channel, [Queue(q, routing_key=q) for q in queues], callbacks=[on_message]
        )
        consumer.qos(prefetch_count=window)
        engine = conn.transport.engine
        named = 0
        send = engine.session.send

        def counting(name: str, params: dict[str, Any]) -> Any:
            nonlocal named
            if name in ("claim", "lean_claim"):
                named += len(params["queues"])
            return send(name, params)

        engine.session.send = counting
        with consumer:
            start = time.perf_counter()
            while got < messages:
                conn.drain_events(timeout=30)
            elapsed = time.perf_counter() - start
        st = engine.statements
        return {
            "seconds": elapsed,
            "claims": st.claim,
            "acks_alone": st.ack,
            "queues_named": named,
        }


def measure(
    url: str,
    counts: list[int],
    messages: int,
    window: int,
    *,
    shared: bool = True,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Each depth's best of ``rounds`` drains (the machine's other load only slows)."""
    rows = []
    for count in counts:
        queues = [f"mq{n:04d}" for n in range(count)]
        store_s = shared_s = float("inf")
        kombu: dict[str, Any] = {"seconds": float("inf")}
        with scratch(url) as s:
            for _ in range(rounds):
                _fill(s, queues, messages)
                store_s = min(store_s, drain_store(s, queues, messages, window))
                if shared:
                    _fill(s, queues, messages)
                    share = -(-window // count)
                    shared_s = min(
                        shared_s, drain_store(s, queues, messages, window, per_queue=share)
                    )
                _fill(s, queues, messages)
                kombu = min(
                    kombu,
                    drain_kombu(
                        url.replace("postgresql://", "pgq://", 1),
                        s.schema,
                        queues,
                        messages,
                        window,
                    ),
                    key=lambda k: float(k["seconds"]),
                )
        rows.append(
            {
                "queues": count,
                "store_rate": messages / store_s,
                "store_shared_rate": messages / shared_s,
                "kombu_rate": messages / kombu["seconds"],
                "claims": kombu["claims"],
                "acks_alone": kombu["acks_alone"],
                "queues_named_per_claim": kombu["queues_named"] / max(kombu["claims"], 1),
            }
        )
    base = rows[0]
    for row in rows:
        row["store_ratio"] = row["store_rate"] / base["store_rate"]
        row["store_shared_ratio"] = row["store_shared_rate"] / base["store_rate"]
        row["kombu_ratio"] = row["kombu_rate"] / base["kombu_rate"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.many_queues", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pg-url", default=default_pg_url(), help="libpq URL of the server")
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--queues", default="1,100", help="queue counts (first: the base)")
    parser.add_argument("--prefetch", type=int, default=40, help="prefetch window")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many drains")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    parser.add_argument(
        "--no-shared",
        action="store_true",
        help="skip the shared store column (to run against a commit before per_queue)",
    )
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.queues.split(",")]
    rows = measure(
        args.pg_url,
        counts,
        args.messages,
        args.prefetch,
        shared=not args.no_shared,
        rounds=args.rounds,
    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.messages} messages, prefetch {args.prefetch}, best of {args.rounds}")
    print(
        "queues  store msg/s  ratio  shared msg/s  ratio  kombu msg/s  ratio  claims"
        "  acks alone  queues/claim"
    )
    for r in rows:
        print(
            f"{r['queues']:>6}  {r['store_rate']:>11.0f}  {r['store_ratio']:>5.2f}"
            f"  {r['store_shared_rate']:>12.0f}  {r['store_shared_ratio']:>5.2f}"
            f"  {r['kombu_rate']:>11.0f}  {r['kombu_ratio']:>5.2f}  {r['claims']:>6}"
            f"  {r['acks_alone']:>10}  {r['queues_named_per_claim']:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
