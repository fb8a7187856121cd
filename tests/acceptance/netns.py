"""A throwaway Postgres behind a network path that can die silently.

A network namespace joined to ours by a veth pair on a private /30; the cluster
(:mod:`tests.acceptance.cluster`) runs inside the namespace, as its unprivileged account,
listening on the namespace side's address only. Connections from this process cross
the veth pair, a real link, unlike loopback: when the namespace side's link is set
down, every packet is dropped — no RST, no FIN, no ICMP — the way a powered-off host
or a partition looks to a client.

    with cut_off_cluster() as net:      # raises ClusterUnavailable if it cannot
        url = net.url()                 # postgresql://postgres@10.x.y.2:<port>/postgres
        net.cut()                       # the link goes dark
        net.restore()                   # and comes back
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.acceptance.cluster import (
    DEFAULT_SETTINGS,
    Cluster,
    ClusterUnavailable,
    find_bindir,
    run_as,
    started,
)

__all__ = ["NetnsCluster", "cut_off_cluster"]


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")


def _check_capable() -> None:
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise ClusterUnavailable("no `ip` command (iproute2)")
    if shutil.which("setpriv") is None:
        raise ClusterUnavailable("no `setpriv` command (util-linux)")


@dataclass
class NetnsCluster(Cluster):
    """A cluster run inside network namespace ``netns``, reached at ``address``."""

    netns: str = ""
    address: str = ""
    subnet: str = ""
    #: The namespace side of the veth pair: the link that :meth:`cut` sets down.
    link: str = ""

    def url(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@{self.address}:{self.port}/{dbname}"

    def _command(self, args: list[str]) -> tuple[list[str], dict[str, Any]]:
        # As root: enter the namespace, then become the cluster's account.
        wrapped = ["ip", "netns", "exec", self.netns]
        if self.account is not None:
            wrapped += [
                "setpriv",
                f"--reuid={self.account.pw_uid}",
                f"--regid={self.account.pw_gid}",
                "--clear-groups",
            ]
        return wrapped + args, {}

    def init(self) -> None:
        super().init()
        # initdb trusts loopback only; the client comes from the other end of the pair.
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.subnet} trust\n")

    def cut(self) -> None:
        """Drop every packet on the path, silently."""
        _ip("link", "set", self.link, "down", netns=self.netns)

    def restore(self) -> None:
        _ip("link", "set", self.link, "up", netns=self.netns)


@contextmanager
def cut_off_cluster() -> Iterator[NetnsCluster]:
    """A started cluster in a namespace of its own, behind a veth pair; the namespace,
    the pair and the cluster are removed afterwards."""
    _check_capable()
    # Each raises ClusterUnavailable before a namespace exists (started() asks again).
    find_bindir()
    run_as()
    tag = f"{os.getpid() % 100000}"
    netns, host_if, ns_if = f"pgqnet{tag}", f"pgqh{tag}", f"pgqn{tag}"
    # A /30 of 10.213.0.0/16 picked by pid: two runs at once do not share one.
    block = (os.getpid() % 16384) * 4
    base = f"10.213.{block // 256}.{block % 256}"
    prefix = base.rsplit(".", 1)[0]
    host_addr, ns_addr = f"{prefix}.{block % 256 + 1}", f"{prefix}.{block % 256 + 2}"
    try:
        _ip("netns", "add", netns)
    except RuntimeError as exc:
        raise ClusterUnavailable(f"cannot create a network namespace: {exc}") from exc
    try:
        try:
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        except RuntimeError as exc:
            raise ClusterUnavailable(f"cannot create a veth pair: {exc}") from exc
        _ip("link", "set", ns_if, "netns", netns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{ns_addr}/30", "dev", ns_if, netns=netns)
        _ip("link", "set", ns_if, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        with started(
            NetnsCluster,
            prefix="pgq-netns-",
            settings={**DEFAULT_SETTINGS, "listen_addresses": ns_addr},
            netns=netns,
            address=ns_addr,
            subnet=f"{base}/30",
            link=ns_if,
        ) as cluster:
            yield cluster
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
