"""A throwaway Patroni cluster: one etcd and two or three Patroni members, from Debian's
``etcd-server`` and ``patroni`` packages, running as the unprivileged account the
throwaway clusters use when we are root.

    with patroni_cluster(members=2, timing=SHORT) as cluster:  # raises PatroniUnavailable
        cluster.url()              # postgresql://postgres@m1,m2/postgres?target_session_attrs=read-write
        leader = cluster.leader()  # the member whose REST API answers /leader with 200
        died_at = cluster.kill(leader)  # SIGKILL of its patroni and its postmaster
        cluster.wait_leader(other_than=leader)  # Patroni promoted a standby

The cluster runs in ``synchronous_mode``: the leader names one standby in
``synchronous_standby_names`` and Patroni fails over only to a standby that was
synchronous, so a commit the leader returned is on the member that takes over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from tests.acceptance.cluster import ClusterUnavailable, find_bindir, free_port, run_as

__all__ = [
    "DEFAULTS",
    "SHORT",
    "Member",
    "PatroniCluster",
    "PatroniUnavailable",
    "Timing",
    "patroni_cluster",
]


class PatroniUnavailable(RuntimeError):
    """No patroni, etcd or Postgres binaries here: skip."""


@dataclass(frozen=True)
class Timing:
    """Patroni's failure detection: the leader key lives ``ttl`` seconds unless renewed;
    members look every ``loop_wait`` seconds; a DCS or Postgres call is retried for
    ``retry_timeout``. A member takes over at most about ``ttl + loop_wait`` after the
    leader died."""

    ttl: int
    loop_wait: int
    retry_timeout: int


#: Patroni's own defaults: a takeover up to ~40 s after the leader died.
DEFAULTS = Timing(ttl=30, loop_wait=10, retry_timeout=10)
#: A faster detection that keeps Patroni's rule loop_wait + 2 * retry_timeout <= ttl.
SHORT = Timing(ttl=10, loop_wait=2, retry_timeout=4)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise PatroniUnavailable(f"no {name} binary (Debian: apt-get install patroni etcd-server)")
    return path


@dataclass
class Member:
    name: str
    root: Path
    port: int
    api_port: int
    process: subprocess.Popen[bytes] | None = None
    killed: bool = False

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logfile(self) -> Path:
        return self.root / "patroni.log"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}?connect_timeout=2"

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def api(self, path: str) -> tuple[int, dict[str, Any]]:
        """Patroni's REST API: (status, JSON body); (0, {}) when it does not answer."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.api_port}{path}", timeout=1
            ) as answer:
                return int(answer.status), json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return int(exc.code), json.loads(exc.read() or b"{}")
        except (OSError, ValueError):
            return 0, {}

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


@dataclass
class PatroniCluster:
    members: list[Member]
    etcd_port: int
    timing: Timing
    _etcd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def url(self, scheme: str = "postgresql", dbname: str = "postgres") -> str:
        """Every member, libpq picks the writable one."""
        hosts = ",".join(f"127.0.0.1:{m.port}" for m in self.members)
        return (
            f"{scheme}://postgres@{hosts}/{dbname}"
            "?target_session_attrs=read-write&connect_timeout=2"
        )

    def leader(self) -> Member | None:
        for member in self.members:
            if not member.killed and member.api("/leader")[0] == 200:
                return member
        return None

    def synchronous_standby(self) -> Member | None:
        """A standby the leader waits for (Patroni's /sync answers 200 there)."""
        for member in self.members:
            if not member.killed and member.api("/sync")[0] == 200:
                return member
        return None

    def wait_ready(self, timeout: float = 120) -> Member:
        """A leader that accepts writes and a synchronous standby streaming from it."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            if leader is not None and self.synchronous_standby() is not None:
                with psycopg.connect(leader.url(), autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                    ).fetchone()
                if row and row[0] >= 1:
                    return leader
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {m.name} ---\n{m.log()[-3000:]}" for m in self.members)
                raise RuntimeError(f"no leader with a synchronous standby:\n{logs}")
            time.sleep(0.2)

    def wait_leader(self, *, other_than: Member, timeout: float) -> tuple[Member, float]:
        """The member Patroni promoted after ``other_than`` and when it was seen leading."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            if leader is not None and leader is not other_than:
                return leader, time.time()
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {m.name} ---\n{m.log()[-3000:]}" for m in self.members)
                raise AssertionError(f"no member took over within {timeout}s:\n{logs}")
            time.sleep(0.05)

    def kill(self, member: Member) -> float:
        """The member dies at once: SIGKILL to its patroni and to its postmaster (its
        backends exit when they see the postmaster gone). When it happened."""
        postmaster = member.postmaster_pid()
        assert member.process is not None
        member.process.send_signal(signal.SIGKILL)
        if postmaster is not None:
            os.kill(postmaster, signal.SIGKILL)
        died_at = time.time()
        member.killed = True
        member.process.wait(10)
        return died_at


def _member_config(
    member: Member, scope: str, etcd_port: int, timing: Timing, bindir: Path
) -> dict[str, Any]:
    return {
        "scope": scope,
        "namespace": "/pgq-test/",
        "name": member.name,
        "restapi": {
            "listen": f"127.0.0.1:{member.api_port}",
            "connect_address": f"127.0.0.1:{member.api_port}",
        },
        "etcd3": {"hosts": f"127.0.0.1:{etcd_port}"},
        "bootstrap": {
            "dcs": {
                "ttl": timing.ttl,
                "loop_wait": timing.loop_wait,
                "retry_timeout": timing.retry_timeout,
                "synchronous_mode": True,
                "postgresql": {
                    "use_pg_rewind": False,
                    "parameters": {
                        # A throwaway cluster need not survive the machine crashing;
                        # a crash of the server still recovers from the WAL the OS holds.
                        "fsync": "off",
                        "wal_level": "replica",
                        "max_wal_senders": 5,
                        "max_replication_slots": 5,
                        "max_connections": 60,
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
            "pg_hba": [
                "local all all trust",
                "host all all 127.0.0.1/32 trust",
                "host replication all 127.0.0.1/32 trust",
            ],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{member.port}",
            "connect_address": f"127.0.0.1:{member.port}",
            "data_dir": str(member.data),
            "bin_dir": str(bindir),
            "pgpass": str(member.root / "pgpass"),
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "postgres"},
            },
            "parameters": {"unix_socket_directories": str(member.root)},
            "basebackup": [{"checkpoint": "fast"}],
        },
    }


def _spawn(args: list[str], log: Path, account: Any) -> subprocess.Popen[bytes]:
    kwargs: dict[str, Any] = {}
    if account is not None:
        kwargs.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
    with log.open("wb") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HOME": str(log.parent)},
            **kwargs,
        )


def _wait_etcd(port: int, etcd: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        if etcd.poll() is not None:
            raise RuntimeError(f"etcd exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if json.loads(answer.read()).get("health") == "true":
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"etcd not healthy: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


@contextmanager
def patroni_cluster(members: int = 2, timing: Timing = SHORT) -> Iterator[PatroniCluster]:
    patroni = _binary("patroni")
    etcd = _binary("etcd")
    try:
        bindir = find_bindir()
        account = run_as()
    except ClusterUnavailable as exc:
        raise PatroniUnavailable(str(exc)) from exc
    root = Path(tempfile.mkdtemp(prefix="pgq-patroni-"))
    cluster = PatroniCluster(
        members=[
            Member(f"m{n}", root / f"m{n}", free_port(), free_port()) for n in range(1, members + 1)
        ],
        etcd_port=free_port(),
        timing=timing,
    )
    try:
        for path in (root, root / "etcd", *(m.root for m in cluster.members)):
            path.mkdir(exist_ok=True)
            if account is not None:
                os.chown(path, account.pw_uid, account.pw_gid)
        peer = free_port()
        cluster._etcd = _spawn(
            [
                etcd,
                "--name=pgq",
                f"--data-dir={root / 'etcd' / 'data'}",
                f"--listen-client-urls=http://127.0.0.1:{cluster.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{cluster.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=pgq=http://127.0.0.1:{peer}",
            ],
            root / "etcd" / "log",
            account,
        )
        _wait_etcd(cluster.etcd_port, cluster._etcd, root / "etcd" / "log")
        scope = f"pgq-{os.getpid()}-{cluster.etcd_port}"
        for member in cluster.members:
            config = member.root / "patroni.yml"  # JSON is YAML
            config.write_text(
                json.dumps(_member_config(member, scope, cluster.etcd_port, timing, bindir))
            )
            member.process = _spawn([patroni, str(config)], member.logfile, account)
            # The first member bootstraps (initdb) before the others copy it.
            if member is cluster.members[0]:
                deadline = time.monotonic() + 60
                while cluster.leader() is None:
                    if member.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"patroni did not bootstrap:\n{member.log()[-4000:]}")
                    time.sleep(0.2)
        cluster.wait_ready()
        yield cluster
    finally:
        for member in cluster.members:
            if member.process is not None and member.process.poll() is None:
                member.process.terminate()  # patroni stops its postgres on SIGTERM
        for member in cluster.members:
            if member.process is not None:
                try:
                    member.process.wait(30)
                except subprocess.TimeoutExpired:
                    member.process.kill()
            pid = None if member.killed else member.postmaster_pid()
            if pid is not None:
                # A postmaster patroni did not stop in time.
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if cluster._etcd is not None:
            cluster._etcd.terminate()
            cluster._etcd.wait(10)
        shutil.rmtree(root, ignore_errors=True)
