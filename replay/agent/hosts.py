"""Hosts as separate as one machine allows: network, mount, IPC and UTS namespaces joined by veth.

:class:`NamespaceHosts` makes ``n`` network namespaces on a bridge (``ip netns``, veth pairs,
root only). Host i answers at ``127.77.{net}.{i + 2}``: loopback-range addresses routed over the
veth links (``route_localnet``), so the project's loopback-only rule holds while every byte
between hosts crosses a link of its own, which ``tc`` token buckets can shape (``rate``).
:meth:`NamespaceHosts.wrap` runs a command on host i in that namespace, with its own host name,
mount table (its store directory bound at :data:`NODE_DIR`, a private ``/dev/shm``) and IPC
namespace, and gloo on that host's link (``GLOO_SOCKET_IFNAME=eth0``): no same-host shortcut
(shared memory, a shared path, gloo over ``lo``) reaches another host.

Never: touches an interface, namespace or route it did not make; outlives its ``with`` block.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["NODE_DIR", "NamespaceHosts", "namespaces_available"]

#: where a namespaced host sees its own store directory (the same path on every host, other contents)
NODE_DIR = "/run/swiftlog-node"


def namespaces_available() -> str | None:
    """None when hosts can be made here, else why not (not root, no ``ip``/``unshare``/``tc``)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "unshare", "tc") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class NamespaceHosts:
    """``n`` hosts; ``rate`` (e.g. ``"200mbit"``) shapes every host's link both ways (None: unshaped)."""

    def __init__(self, n: int, *, rate: str | None = None, net: int | None = None) -> None:
        self.n, self.rate = n, rate
        self.net = net if net is not None else 20 + os.getpid() % 200
        self.tag = f"swl{self.net}"
        self.bridge = f"{self.tag}br"
        self._made: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def address(self, i: int) -> str:
        return f"127.77.{self.net}.{i + 2}"

    def __enter__(self) -> NamespaceHosts:
        why = namespaces_available()
        if why:
            raise RuntimeError(why)
        self._made = ["bridge", *(self.ns(i) for i in range(self.n))]
        self.close()  # what a killed run with the same tag left behind
        try:
            subnet = f"127.77.{self.net}.0/24"
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("sysctl", "-qw", f"net.ipv4.conf.{self.bridge}.route_localnet=1")
            _ip("ip", "addr", "add", f"127.77.{self.net}.1/32", "dev", self.bridge)
            _ip("ip", "link", "set", self.bridge, "up")
            _ip("ip", "route", "add", subnet, "dev", self.bridge)
            for i in range(self.n):
                ns, veth = self.ns(i), f"{self.tag}v{i}"
                _ip("ip", "netns", "add", ns)
                self._made.append(ns)
                _ip("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("ip", "link", "set", veth, "master", self.bridge)
                _ip("ip", "link", "set", veth, "up")
                _ip("ip", "link", "set", "lo", "up", ns=ns)
                _ip("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1", "net.ipv4.conf.eth0.route_localnet=1", ns=ns)
                _ip("ip", "addr", "add", f"{self.address(i)}/32", "dev", "eth0", ns=ns)
                _ip("ip", "link", "set", "eth0", "up", ns=ns)
                _ip("ip", "route", "add", subnet, "dev", "eth0", ns=ns)
                if self.rate:  # both ways: into the host (the bridge side) and out of it
                    tbf = ["rate", self.rate, "burst", "256kb", "latency", "100ms"]
                    _ip("tc", "qdisc", "add", "dev", veth, "root", "tbf", *tbf)
                    _ip("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf, ns=ns)
            os.makedirs(NODE_DIR, exist_ok=True)
        except BaseException:
            self.close()
            raise
        return self

    def wrap(self, i: int, cmd: Sequence[str], node_dir: str | os.PathLike[str]) -> list[str]:
        """``cmd`` run on host i: its namespaces, host name ``host{i}``, ``node_dir`` at :data:`NODE_DIR`."""
        Path(node_dir).mkdir(parents=True, exist_ok=True)
        script = (
            f'hostname host{i} && mount --bind "$1" {NODE_DIR} && mount -t tmpfs tmpfs /dev/shm && shift && '
            'GLOO_SOCKET_IFNAME=eth0 exec "$@"'
        )
        return [
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "unshare",
            "--mount",
            "--uts",
            "--ipc",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(node_dir),
            *cmd,
        ]

    def kill_host(self, i: int) -> None:
        """SIGKILL every process in host i's network namespace (the machine is gone)."""
        r = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass

    def link_bytes(self, i: int) -> dict[str, int]:
        """Bytes host i's link carried so far: ``{"out": sent by the host, "in": received}``."""
        stats = Path(f"/sys/class/net/{self.tag}v{i}/statistics")
        return {"out": int((stats / "rx_bytes").read_text()), "in": int((stats / "tx_bytes").read_text())}

    def close(self) -> None:
        for i in range(self.n):
            if self.ns(i) in self._made:
                self.kill_host(i)
                subprocess.run(["ip", "netns", "del", self.ns(i)], capture_output=True)
        if "bridge" in self._made:
            subprocess.run(["ip", "route", "del", f"127.77.{self.net}.0/24"], capture_output=True)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._made.clear()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
