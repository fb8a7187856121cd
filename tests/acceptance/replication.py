"""A throwaway primary and a streaming standby (pg_basebackup), to crash and fail over.

    with replicated_pair(synchronous=True) as pair:
        pair.url()                 # postgresql://…@primary,standby/postgres?target_session_attrs=read-write
        pair.link.pause()          # the standby stops receiving (a network partition)
        pair.crash_primary()       # pg_ctl stop -m immediate
        pair.promote()             # pg_ctl promote: the standby takes writes

The standby streams through a :class:`~tests.proxy.CuttingProxy` (``pair.link``), so a
test can stall replication for a while before the crash: what the standby has not
received then is gone with the primary, as when a real standby lags. With
``synchronous=True`` the primary names the standby in ``synchronous_standby_names``: a
commit that waits for it (``synchronous_commit`` on) returns once the standby has it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from tests.acceptance.cluster import (
    DEFAULT_SETTINGS,
    Cluster,
    find_bindir,
    free_port,
    run_as,
)
from tests.proxy import CuttingProxy

__all__ = ["STANDBY_NAME", "Pair", "replicated_pair"]

STANDBY_NAME = "pgq_standby"


@dataclass
class Pair:
    primary: Cluster
    standby: Cluster
    link: CuttingProxy

    def url(self, scheme: str = "postgresql", dbname: str = "postgres") -> str:
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return (
            f"{scheme}://postgres@{hosts}/{dbname}"
            "?target_session_attrs=read-write&connect_timeout=2"
        )

    def replication_state(self) -> str | None:
        """The standby's ``sync_state`` as the primary sees it (None: not streaming)."""
        with psycopg.connect(self.primary.url(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT sync_state FROM pg_stat_replication"
                " WHERE application_name = %s AND state = 'streaming'",
                [STANDBY_NAME],
            ).fetchone()
        return str(row[0]) if row else None

    def crash_primary(self) -> None:
        self.primary.stop("immediate")

    def promote(self) -> None:
        self.standby._pg_ctl("-w", "-t", "60", "promote")


def _wait_streaming(pair: Pair, expected: str) -> None:
    deadline = time.monotonic() + 30
    while pair.replication_state() != expected:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the standby is not streaming ({pair.replication_state()!r}):\n"
                f"{pair.standby.log()[-3000:]}"
            )
        time.sleep(0.1)


@contextmanager
def replicated_pair(*, synchronous: bool) -> Iterator[Pair]:
    bindir = find_bindir()
    account = run_as()
    roots = [Path(tempfile.mkdtemp(prefix=f"pgq-{role}-")) for role in ("primary", "standby")]
    for root in roots:
        if account is not None:
            os.chown(root, account.pw_uid, account.pw_gid)
    primary_settings = {**DEFAULT_SETTINGS, "wal_level": "replica", "max_wal_senders": "4"}
    if synchronous:
        primary_settings["synchronous_standby_names"] = STANDBY_NAME
    primary = Cluster(bindir, roots[0], free_port(), account, primary_settings)
    # Not synchronous itself: once promoted, it has no standby to wait for.
    standby = Cluster(bindir, roots[1], free_port(), account, dict(DEFAULT_SETTINGS))
    link = CuttingProxy(("127.0.0.1", primary.port))
    pair = Pair(primary, standby, link)
    try:
        primary.init()
        primary.start()
        # The standby's copy and its stream both go through the link.
        conninfo = (
            f"host=127.0.0.1 port={link.port} user=postgres "
            f"application_name={STANDBY_NAME} sslmode=disable"
        )
        standby._run(
            [
                str(bindir / "pg_basebackup"),
                "-D",
                str(standby.data),
                "-d",
                conninfo,
                "-R",
                "-X",
                "stream",
                "--no-sync",
                "-c",
                "fast",
            ]
        )
        standby.start()
        _wait_streaming(pair, "sync" if synchronous else "async")
        yield pair
    finally:
        link.close()
        for cluster in (primary, standby):
            cluster.stop()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
