"""The physical limit of one connection: pgbench inserting single rows, one at a time.

pgq's publish is one INSERT (and its commit) per message on one connection, so a
single-client pgbench running a one-row INSERT on the same server says how close
pgq's publishing comes to what the connection itself allows. The table is a scratch
one (an identity key and a short text), created and dropped around the run.

:func:`run_pgq_insert` runs pgq's own INSERT (the ``enqueue`` query, as a publish
sends it, with a message's payload) the same way: what that statement costs with
no Python client around it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pg_transport.sql import load_queries, substitute_parameters

__all__ = ["pgbench_script", "run_pgbench", "run_pgq_insert", "seconds"]

_TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)
# Largest value of pgbench's random(): a fresh publish key at every INSERT.
_KEYS = 2**62


def seconds(text: str) -> float:
    """A pgbench run's length on the command line: seconds, at least 0 (0 skips it)."""
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


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
        return _no_pgbench()
    table = sql.Identifier(f"pgq_pgbench_{uuid.uuid4().hex[:10]}")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload text)"
            ).format(table)
        )
        statement = sql.SQL("INSERT INTO {} (payload) VALUES ('x');").format(table).as_string(conn)
        try:
            return _run(pgbench, pg_url, statement + "\n", seconds, statement=statement.strip())
        finally:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


def pgbench_script(query: str, nulls: Collection[str] = ()) -> str:
    """A pgbench script running ``query`` (psycopg's ``%(name)s`` parameters) once per
    transaction, its ``publish_key`` a new random number each time, the parameters
    named in ``nulls`` NULL (a ``-D`` define cannot say it) and its other parameters
    pgbench variables of the same names (``-D name=value``)."""
    names: set[str] = set()

    def variable(name: str) -> str:
        if name in nulls:
            return "NULL"
        names.add(name)
        return f":{name}"

    text = substitute_parameters(query, variable)
    draws = f"\\set publish_key random(1, {_KEYS})\n" if "publish_key" in names else ""
    return draws + text.rstrip().rstrip(";") + ";\n"


def run_pgq_insert(
    pg_url: str, schema: str, queue: str, payload: str, *, seconds: float, durable: bool
) -> dict[str, Any]:
    """pgq's INSERT of a message (``enqueue``) into ``schema`` through pgbench, one client,
    prepared: {"status": "ok", "tps", "latency_us", ...} or a skip with its reason.
    ``durable``: each commit waits for its WAL flush, as a publish of ``durable_publish``
    on does; else ``synchronous_commit`` is off, as for ``durable_publish`` off. The
    rows it inserts stay in ``schema``'s message table."""
    pgbench = find_pgbench()
    if pgbench is None:
        return _no_pgbench()
    # No expiry, no ordering key or follows link: an ordinary message.
    unordered = ("ttl", "okey", "task_id", "follows", "follow_wait")
    script = pgbench_script(load_queries(schema)["enqueue"], nulls=unordered)
    defines = {
        "queue": queue,
        "priority": "0",
        "delay": "0",
        "payload": payload,
        "followable": "false",
    }
    env = None if durable else {"PGOPTIONS": "-c synchronous_commit=off"}
    found = _run(
        pgbench,
        pg_url,
        script,
        seconds,
        defines=defines,
        env=env,
        statement="enqueue",
        durable=durable,
    )
    if found["status"] == "ok":
        found["latency_us"] = 1e6 / found["tps"]
    return found


def _run(
    pgbench: str,
    pg_url: str,
    script: str,
    seconds: float,
    *,
    defines: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    **described: Any,
) -> dict[str, Any]:
    length = max(1, round(seconds))
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as file:
        file.write(script)
        file.flush()
        command = [pgbench, "-n", "-c", "1", "-j", "1", "-M", "prepared", "-T", str(length)]
        for name, value in (defines or {}).items():
            command += ["-D", f"{name}={value}"]
        proc = subprocess.run(
            [*command, "-f", file.name, pg_url],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=False,
            env={**os.environ, **(env or {})},
        )
    found = _TPS.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        # The server's first error says what went wrong; what pgbench says after it
        # (a prepared statement missing, the run aborted) follows from it.
        errors = [line for line in said if "ERROR:" in line]
        why = errors[:1] + said[-1:] if errors else said[-3:]
        return {"status": "failed", "reason": f"pgbench exit {proc.returncode}: {' | '.join(why)}"}
    return {
        "status": "ok",
        "tps": float(found.group(1)),
        **described,
        "seconds": length,
        "clients": 1,
    }


def _no_pgbench() -> dict[str, Any]:
    return {"status": "skipped", "reason": "pgbench not found (install postgresql-client)"}
