"""What a claim costs the server, by claim size: its fixed part and its part per message.

    python -m benchmarks.claim_cost [--messages 3000] [--windows 1,2,4,8,16,32] [--rounds 2]

In a throwaway schema (``benchmarks.scratch``) each round drains ``--messages``
Celery-sized messages once per window size, by claims of that size with the previous
claim's acks riding on each (as a worker's engine sends them), and reads the CPU time of
the backend that ran them from ``/proc`` (Postgres on this host; Linux). Reported per
window: server CPU per message and per claim, and wall time per message. A claim's cost
that does not shrink per message as the window grows is its fixed part: what a worker
whose claims carry few messages (prefork x2, prefetch 4: claims of about 4) pays per
task beyond RabbitMQ. CPU figures are inflated on a loaded machine (cache, switches);
compare windows within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.brokers import default_pg_url
from benchmarks.procstat import sample
from benchmarks.scratch import Scratch, scratch
from pg_transport.store import Lease

__all__ = ["main", "measure"]


def _backend_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        found = sample(pid)
        if found is not None:
            total += float(found["main"]["cpu_s"])
    return total


def _drain(s: Scratch, queue: str, window: int) -> tuple[int, int, float, float]:
    """Claim ``queue`` empty by claims of ``window``: (messages, claims, CPU s, wall s)."""
    acks: list[Lease] = [c.token for c in s.store.claim([queue], [30.0], 1, [5])]
    # The session that ran it: its last statement names the scratch schema.
    pids = [
        int(row[0])
        for row in s.sql(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND query LIKE %s",
            f"%{s.schema}%",
        )
        if Path(f"/proc/{row[0]}").exists()
    ]
    cpu, wall = _backend_cpu(pids), time.perf_counter()
    done = claims = 0
    while True:
        batch = s.store.claim([queue], [30.0], window, [5], acks=acks)
        claims += 1
        if not batch:
            break
        acks = [c.token for c in batch]
        done += len(batch)
    return done, claims, _backend_cpu(pids) - cpu, time.perf_counter() - wall


def measure(pg_url: str, messages: int, windows: list[int], rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with scratch(pg_url) as s:
        for r in range(rounds):
            # Every other round the other way round: a drift weighs on all windows.
            for window in windows if r % 2 == 0 else windows[::-1]:
                queue = f"w{window}_{r}"
                s.fill(queue, messages)
                s.sql("ANALYZE {schema}.message")
                done, claims, cpu, wall = _drain(s, queue, window)
                rows.append(
                    {
                        "round": r + 1,
                        "window": window,
                        "messages": done,
                        "claims": claims,
                        "server_us_per_message": cpu * 1e6 / max(done, 1),
                        "server_us_per_claim": cpu * 1e6 / max(claims, 1),
                        "wall_us_per_message": wall * 1e6 / max(done, 1),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.claim_cost", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--pg-url", default=default_pg_url(), help="libpq URL of the server")
    parser.add_argument("--messages", type=int, default=3000, help="per drain (3000)")
    parser.add_argument("--windows", default="1,2,4,8,16,32", help="claim sizes")
    parser.add_argument("--rounds", type=int, default=2, help="drains per window (2)")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    rows = measure(args.pg_url, args.messages, windows, args.rounds)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"{args.messages} messages a drain, acks riding; load average {load}")
    print("round  window  claims  server us/msg  server us/claim  wall us/msg")
    for row in rows:
        print(
            f"{row['round']:>5}  {row['window']:>6}  {row['claims']:>6}"
            f"  {row['server_us_per_message']:>13.0f}  {row['server_us_per_claim']:>15.0f}"
            f"  {row['wall_us_per_message']:>11.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
