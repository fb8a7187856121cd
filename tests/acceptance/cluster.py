"""A throwaway PostgreSQL cluster (initdb + pg_ctl on a free port) that a test may restart.

Tests that restart or crash the server must never touch a shared Postgres: they start
their own cluster here, in a temporary directory, and remove it afterwards. When we
are root, initdb refuses to run, so the cluster runs as an unprivileged account
(``postgres``, ``pgserver`` or ``nobody``).

    with throwaway_cluster() as cluster:        # raises ClusterUnavailable if it cannot
        url = cluster.url()                     # postgresql://postgres@127.0.0.1:<port>/postgres
        cluster.restart("fast")                 # or "immediate": a crash restart
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg

__all__ = [
    "Cluster",
    "ClusterUnavailable",
    "find_bindir",
    "free_port",
    "run_as",
    "started",
    "throwaway_cluster",
]

START_TIMEOUT = 60
# fsync off: a throwaway cluster need not survive the machine crashing, and a
# crash of the *server* (immediate stop) still recovers from the WAL the OS holds.
DEFAULT_SETTINGS: Mapping[str, str] = {"fsync": "off", "listen_addresses": "127.0.0.1"}


class ClusterUnavailable(RuntimeError):
    """No throwaway cluster can be started here (no binaries, no account): skip."""


def _bindirs() -> Iterator[str]:
    if os.environ.get("PGQ_PG_BINDIR"):
        yield os.environ["PGQ_PG_BINDIR"]
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        yield out.stdout.strip()
    yield from sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    try:
        from pgserver._commands import POSTGRES_BIN_PATH
    except ImportError:
        return
    yield str(POSTGRES_BIN_PATH)


def find_bindir() -> Path:
    """Directory with initdb and pg_ctl: PGQ_PG_BINDIR, pg_config, Debian's, or pgserver's."""
    for candidate in _bindirs():
        path = Path(candidate)
        if (path / "initdb").exists() and (path / "pg_ctl").exists():
            return path
    raise ClusterUnavailable("no initdb/pg_ctl found (set PGQ_PG_BINDIR to their directory)")


def run_as() -> pwd.struct_passwd | None:
    """initdb refuses to run as root: an unprivileged account when we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "pgserver", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise ClusterUnavailable("running as root without an unprivileged account for initdb")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    """One throwaway cluster: its directory, port, and the account it runs as."""

    bindir: Path
    root: Path
    port: int
    account: pwd.struct_passwd | None
    settings: dict[str, str] = field(default_factory=dict)
    #: When set, initdb gives ``postgres`` this password and every login must use it
    #: (scram-sha-256); when None, trust authentication.
    password: str | None = None
    restarts: int = 0

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logfile(self) -> Path:
        return self.root / "log"

    def url(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def _command(self, args: list[str]) -> tuple[list[str], dict[str, Any]]:
        """How ``args`` runs: the command line and subprocess.run's arguments (as the
        cluster's account)."""
        if self.account is None:
            return args, {}
        return args, {"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}

    def _run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        command, kwargs = self._command(args)
        try:
            return subprocess.run(command, check=check, capture_output=True, text=True, **kwargs)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                f"{' '.join(args[:1] + args[-1:])} failed ({exc.returncode}): "
                f"{exc.stdout}{exc.stderr}\n--- server log ---\n{self.log()[-4000:]}"
            ) from exc

    def _pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), *args], check=check)

    def _options(self) -> str:
        opts = [f"-p {self.port}", f"-k {self.root}"]
        opts += [f"-c {key}={value}" for key, value in self.settings.items()]
        return " ".join(opts)

    def init(self) -> None:
        auth = ["--auth=trust"]
        if self.password is not None:
            pwfile = self.root / "pw"
            pwfile.write_text(self.password + "\n")
            if self.account is not None:
                os.chown(pwfile, self.account.pw_uid, self.account.pw_gid)
            auth = ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
        self._run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                *auth,
                "--encoding=UTF8",
                "--no-sync",
            ]
        )

    def start(self) -> None:
        self._pg_ctl(
            "-w", "-t", str(START_TIMEOUT), "-l", str(self.logfile), "-o", self._options(), "start"
        )

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE``: every session is cut; "immediate" is a crash."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown shutdown mode {mode!r}")
        self._pg_ctl(
            "-w",
            "-t",
            str(START_TIMEOUT),
            "-m",
            mode,
            "-l",
            str(self.logfile),
            "-o",
            self._options(),
            "restart",
        )
        self.restarts += 1

    def stop(self, mode: str = "immediate") -> None:
        self._pg_ctl("-w", "-m", mode, "stop", check=False)

    def start_time(self) -> Any:
        """pg_postmaster_start_time(): changes with every restart."""
        with psycopg.connect(self.url(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
        return row[0] if row else None


C = TypeVar("C", bound=Cluster)


@contextmanager
def started(kind: type[C], *, prefix: str = "pgq-cluster-", **fields: Any) -> Iterator[C]:
    """A ``kind`` of cluster (``fields`` given to it) in a new temporary directory, on a
    free port, as :func:`run_as`'s account: initialised and started; stopped and removed
    afterwards."""
    bindir = find_bindir()
    account = run_as()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if account is not None:
        os.chown(root, account.pw_uid, account.pw_gid)
    cluster = kind(bindir=bindir, root=root, port=free_port(), account=account, **fields)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def throwaway_cluster(
    settings: Mapping[str, str] | None = None, *, password: str | None = None
) -> Iterator[Cluster]:
    """A started cluster on a free port (trust auth, or scram-sha-256 with ``password``);
    stopped and removed afterwards."""
    with started(
        Cluster, settings={**DEFAULT_SETTINGS, **(settings or {})}, password=password
    ) as cluster:
        yield cluster
