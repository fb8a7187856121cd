"""The physical limit of one connection: pgbench inserting single rows, one at a time.

pgq's publish is one INSERT (and its commit) per message on one connection, so a
single-client pgbench running a one-row INSERT on the same server says how close
pgq's publishing comes to what the connection itself allows. The table is a scratch
one (an identity key and a short text), created and dropped around the run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["run_pgbench"]

_TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)


def find_pgbench() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    for bindir in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (bindir / "pgbench").exists():
            return str(bindir / "pgbench")
    return None


def run_pgbench(pg_url: str, seconds: float = 5.0) -> dict[str, Any]:
    """{"status": "ok", "tps", "statement", "seconds"} or a skip with its reason."""
    pgbench = find_pgbench()
    if pgbench is None:
        return {"status": "skipped", "reason": "pgbench not found (install postgresql-client)"}
    table = sql.Identifier(f"pgq_pgbench_{uuid.uuid4().hex[:10]}")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE TABLE {} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload text)"
        ).format(table))
        statement = sql.SQL("INSERT INTO {} (payload) VALUES ('x');").format(table).as_string(conn)
        try:
            with tempfile.NamedTemporaryFile("w", suffix=".sql") as script:
                script.write(statement + "\n")
                script.flush()
                proc = subprocess.run(
                    [pgbench, "-n", "-c", "1", "-j", "1", "-M", "prepared",
                     "-T", str(max(1, round(seconds))), "-f", script.name, pg_url],
                    capture_output=True, text=True, timeout=seconds + 60, check=False,
                )
        finally:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
    found = _TPS.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "failed", "reason": f"pgbench exit {proc.returncode}: {' | '.join(tail)}"}
    return {"status": "ok", "tps": float(found.group(1)), "statement": statement.strip(),
            "seconds": max(1, round(seconds)), "clients": 1}
