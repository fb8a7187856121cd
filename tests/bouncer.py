"""A throwaway PgBouncer in front of a Postgres the tests use, on a free port.

    with pgbouncer(pg_url, pool_mode="transaction") as bouncer:
        url = bouncer.url()          # postgresql://postgres@127.0.0.1:<port>/<dbname>

Its pool is named after the upstream database, trust authentication, and it runs as the
unprivileged account the throwaway clusters use when we are root (PgBouncer refuses
root). Raises :class:`BouncerUnavailable` when no ``pgbouncer`` binary is installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.acceptance.cluster import free_port, run_as

__all__ = ["Bouncer", "BouncerUnavailable", "pgbouncer"]


class BouncerUnavailable(RuntimeError):
    """No pgbouncer binary here: skip."""


@dataclass
class Bouncer:
    port: int
    dbname: str
    user: str

    def url(self, scheme: str = "postgresql", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"sslmode": "disable", **params}.items())
        return f"{scheme}://{self.user}@127.0.0.1:{self.port}/{self.dbname}?{query}"


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited: {log.read_text(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen: {log.read_text(errors='replace')}")


@contextmanager
def pgbouncer(
    upstream: str,
    *,
    pool_mode: str = "transaction",
    ignore_startup_parameters: str = "extra_float_digits",
    pool_size: int = 4,
) -> Iterator[Bouncer]:
    """PgBouncer forwarding to ``upstream`` (a libpq URL with trust authentication)."""
    binary = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )
    if binary is None:
        raise BouncerUnavailable("pgbouncer is not installed (apt-get install pgbouncer)")
    parts = urlsplit(upstream)
    dbname = parts.path.lstrip("/") or "postgres"
    user = parts.username or "postgres"
    root = Path(tempfile.mkdtemp(prefix="pgq-bouncer-"))
    port = free_port()
    log = root / "log"
    (root / "users").write_text(f'"{user}" ""\n')
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"{dbname} = host={parts.hostname or '127.0.0.1'} port={parts.port or 5432} "
        f"dbname={dbname} user={user}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        f"unix_socket_dir = {root}\n"
        "auth_type = trust\n"
        f"auth_file = {root / 'users'}\n"
        f"pool_mode = {pool_mode}\n"
        f"default_pool_size = {pool_size}\n"
        "max_client_conn = 200\n"
        f"ignore_startup_parameters = {ignore_startup_parameters}\n"
        f"logfile = {log}\n"
        f"pidfile = {root / 'pid'}\n"
    )
    account = run_as()
    kwargs: dict[str, object] = {}
    if account is not None:
        for path in [root, *root.iterdir()]:
            os.chown(path, account.pw_uid, account.pw_gid)
        kwargs = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    process = subprocess.Popen(
        [binary, str(root / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **kwargs,  # type: ignore[call-overload]
    )
    try:
        _wait_listening(port, process, log)
        yield Bouncer(port=port, dbname=dbname, user=user)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)
