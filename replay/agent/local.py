"""Several ``swiftlog agent`` hosts on this machine: each its own 127.0.0.x address and store root.

:class:`LocalCluster` starts one agent process per node (each in a session of its own, so that
:meth:`LocalCluster.lose_node` kills the agent with everything it started, as a machine's loss
does) and waits for node 0's verdict. Tests, the bench and the demo use it; on a real cluster each
node runs the ``swiftlog agent`` command line itself (docs/deployment.md).

Never: shares a store root between nodes, or binds anything but loopback addresses.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from replay.agent.hosts import NODE_DIR, NamespaceHosts
from trainer_client.recovery_keys import RecoveryKeys

__all__ = ["LocalCluster", "NodeProcess", "torchrun_command"]


def torchrun_command(
    base: Path, run_id: str, args: Sequence[str], *, nproc: int = 4, max_restarts: int = 1
) -> list[str]:
    """Plain torchrun on this host (``--standalone``) running the example pipeline
    (``trainer_client.examples.torchrun_resilient``) under ``base`` (store root ``node``, results
    ``out``, checkpoints ``ckpt``); ``args`` go to the script."""
    return [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.1",
        "-m",
        "trainer_client.examples.torchrun_resilient",
        "--run-id",
        run_id,
        "--store-root",
        str(base / "node"),
        "--out",
        str(base / "out"),
        "--checkpoint-url",
        f"file://{base / 'ckpt'}",
        *args,
    ]


@dataclass
class NodeProcess:
    """One agent process: its node (``None`` for a spare), address, store root and log file."""

    node: int | None
    host: str
    root: Path
    log: Path
    proc: subprocess.Popen[bytes]
    index: int = 0  # its host's index

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """``nnodes`` regular nodes of ``nproc_per_node`` ranks plus ``spares`` spare nodes under ``base``.

    Node n binds ``127.0.0.{n + 2}``, the spares the next ones; node 0 hosts the job's store on
    ``port`` (0: a free one). With ``hosts`` (entered, ``nnodes + spares`` of them), node i runs
    on namespaced host i instead, its directory ``base/<name>`` bound at its :data:`NODE_DIR`. ``agent_args``
    go to every agent (e.g. ``--dp-replicate 2``, ``--cold-start``), ``node0_args`` to node 0
    (``--inject-kill``), ``script_args`` to the training script.
    """

    base: Path
    module: str
    script_args: Sequence[str]
    nnodes: int = 2
    nproc_per_node: int = 2
    spares: int = 1
    port: int = 0  # 0: a free one
    run_id: str = "rec"
    agent_args: Sequence[str] = ()
    node0_args: Sequence[str] = ()
    hosts: NamespaceHosts | None = None
    nodes: list[NodeProcess] = field(default_factory=list)

    @property
    def checkpoint_url(self) -> str:
        return f"file://{self.base / 'ckpt'}"

    @property
    def out(self) -> Path:
        return self.base / "out"

    def start(self) -> LocalCluster:
        self.base.mkdir(parents=True, exist_ok=True)
        if not self.port and self.hosts is not None:  # nothing else listens in a fresh namespace
            self.port = 20000 + os.getpid() % 20000
        elif not self.port:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.2", 0))
                self.port = int(s.getsockname()[1])
        order = [*range(1, self.nnodes), *[None] * self.spares, 0]  # node 0 last: it waits for nobody
        for i, n in enumerate(order):
            index = n if n is not None else self.nnodes + i - (self.nnodes - 1)
            host = self.address(index)
            root = self.base / (f"node{n}" if n is not None else f"spare{i}")
            log = self.base / f"agent-{root.name}.log"
            cmd = [
                sys.executable,
                "-m",
                "server.cli",
                "agent",
                "--nnodes",
                str(self.nnodes),
                "--nproc-per-node",
                str(self.nproc_per_node),
                "--rdzv-endpoint",
                f"{self.address(0)}:{self.port}",
                "--run-id",
                self.run_id,
                "--checkpoint-url",
                self.checkpoint_url,
                "--out",
                str(self.out),
                "--host",
                host,
                "--store-root",
                str(root) if self.hosts is None else NODE_DIR,
                "-m",
                self.module,
                "-v",
                *(["--node-rank", str(n)] if n is not None else ["--spare"]),
                *self.agent_args,
                *(self.node0_args if n == 0 else ()),
                "--",
                *self.script_args,
            ]
            if self.hosts is not None:
                cmd = self.hosts.wrap(index, cmd, root)
            with open(log, "wb") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            self.nodes.append(NodeProcess(n, host, root, log, proc, index))
        return self

    def address(self, index: int) -> str:
        """Host ``index``'s address (node n is host n; the spares follow the regular nodes)."""
        return f"127.0.0.{index + 2}" if self.hosts is None else self.hosts.address(index)

    def node(self, n: int) -> NodeProcess:
        return next(p for p in self.nodes if p.node == n)

    def store(self) -> dist.TCPStore:
        """A client of the job's store (node 0's)."""
        return dist.TCPStore(self.address(0), self.port, is_master=False, timeout=datetime.timedelta(seconds=60))

    def wait_for_iteration(self, iteration: int, timeout_s: float = 120.0) -> int:
        """Until the last stage applied ``iteration`` (the job's progress key); the newest applied."""
        keys, deadline = RecoveryKeys(self.run_id), time.monotonic() + timeout_s
        store = self.store()
        while time.monotonic() < deadline:
            if store.check([keys.progress()]):
                done = [int(e.split(":")[0]) for e in store.get(keys.progress()).decode().split(";") if e]
                if done and max(done) >= iteration:
                    return max(done)
            time.sleep(0.05)
        raise TimeoutError(f"iteration {iteration} not applied within {timeout_s} s")

    def lose_node(self, n: int, *, delete_root: bool = True) -> float:
        """SIGKILL node ``n``'s agent and everything it started; delete its store root (its hot tier)
        when ``delete_root``. Returns the wall time of the kill."""
        return self._lose(self.node(n), delete_root)

    def lose_spare(self, p: NodeProcess, *, delete_root: bool = True) -> float:
        """:meth:`lose_node` for a spare node (which has no node rank of its own)."""
        return self._lose(p, delete_root)

    def _lose(self, p: NodeProcess, delete_root: bool) -> float:
        n = p.node if p.node is not None else -1
        store, keys = self.store(), RecoveryKeys(self.run_id)
        t = time.time()
        os.killpg(p.proc.pid, signal.SIGKILL)
        if self.hosts is not None:
            self.hosts.kill_host(p.index)
        if n > 0:  # node 0's loss takes the store with it; a spare held no first ranks
            for rank in range(n * self.nproc_per_node, (n + 1) * self.nproc_per_node):  # its first ranks
                store.set(keys.kill_time(rank), repr(t))  # as a --kill-at does: the recovery timings start here
        p.proc.wait()
        if delete_root:
            shutil.rmtree(p.root, ignore_errors=True)
        return t

    def wait(self, timeout_s: float = 300.0) -> int:
        """Node 0's exit code once the job is over; every agent is stopped on return."""
        try:
            return self.node(0).proc.wait(timeout=timeout_s)
        finally:
            self.stop()

    def stop(self) -> None:
        for p in self.nodes:
            if p.proc.poll() is None:
                try:
                    p.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                    p.proc.wait()
