"""What one ``swiftlog agent`` is told: the job's shape, its rendezvous, this node's place in it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from replay.launcher import KillSpec
from trainer_client.config import logging_group_sizes
from trainer_client.mesh import MeshLayout
from trainer_client.progress import SECTIONS

__all__ = ["AgentConfig"]


@dataclass(frozen=True)
class AgentConfig:
    """One node agent's configuration (torchrun's flags where torchrun has one).

    nnodes / nproc_per_node: the job's regular nodes and processes (ranks) per node; the world is
        their product, a ``pp`` x ``dp_replicate`` x ``dp_shard`` mesh (rank = (stage *
        dp_replicate + replica) * dp_shard + shard; ``dp_shard`` > 1: FSDP2-sharded stages).
    node_rank: this node's rank (0..nnodes-1; node 0 hosts the job's store at ``rdzv_endpoint``
        and leads), or None for a spare node, which takes the ranks of a lost node.
    rdzv_endpoint: ``HOST:PORT`` of the job's store (a TCPStore, outside the training ranks).
    host: the address this node's servers bind (its node servers, and for node 0 the store).
    module: the training script, a module with ``main(argv)`` that takes the arguments of the
        script contract (``docs/recovery.md``); ``args``: the user's arguments to it.
    store_root: this node's log store root (each process gets ``{store_root}/{name}``).
    checkpoint_url / out: durable checkpoints, and where the processes write their results.
    warm: start processes from a fork server that imported torch and ``module`` once (a warm
        spare: milliseconds instead of an interpreter and its imports).
    serve_logs: run a node server (``swiftlog serve``) over each process's store root, so that a
        replacement on another node reads its hot tier over HTTP (needs the server extra).
    node_timeout_s: a node whose heartbeat has not moved for this long is lost, with its ranks.
    mode: "swift" (replace what was lost, survivors keep their state) or "rollback" (restart every
        rank from the newest common checkpoint on any failure: what a job without swiftlog does).
    hang_timeouts: ``(section, seconds)`` pairs (sections: step, checkpoint, recovery): a rank whose
        progress (published with its heartbeat) stays still that long in that section is hung; the
        leader kills the culprit (the stalled rank that is busy, not those waiting on it) and it is
        replaced like a dead one. Empty (default): no hang detection.
    resume: start every rank from the newest checkpoint they all have (``--resume-from C``): a
        job restarted after a global failure, e.g. the loss of node 0 with the job's store.
    attempt: the job's restart count (names this attempt's processes and store roots apart).
    kills: fault injection (tests, bench): each :class:`~replay.launcher.KillSpec` goes to its rank's
        first process (``--kill-at``).
    groups: the script's logging-group sizes (its ``ClientConfig.logging_groups``), so that a failure
        recovers its whole group; ``group_recovery``: "kill" (the group's members are replaced and
        each replays the group) or "in_place" (only the lost rank is replaced; the live members
        replay with it in their own processes, ``--group-in-place``). Not with ``dp_replicate`` or
        ``dp_shard`` > 1.
    """

    nnodes: int
    nproc_per_node: int
    node_rank: int | None
    rdzv_endpoint: str
    module: str
    run_id: str
    store_root: str
    checkpoint_url: str
    out: str
    args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    dp_replicate: int = 1
    dp_shard: int = 1
    replay_workers: int = 1
    max_restarts: int = 4
    grace_s: float = 3.0
    heartbeat_s: float = 0.2
    node_timeout_s: float = 3.0
    rdzv_timeout_s: float = 120.0
    job_timeout_s: float = 24 * 3600.0
    warm: bool = True
    mode: str = "swift"
    serve_logs: bool = True
    hang_timeouts: tuple[tuple[str, float], ...] = ()
    resume: bool = False
    attempt: int = 0
    kills: tuple[KillSpec, ...] = field(default_factory=tuple)
    groups: tuple[int, ...] | None = None
    group_recovery: str = "kill"

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node", "dp_replicate", "dp_shard", "replay_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1} (or None for a spare), got {self.node_rank!r}")
        dp = self.dp_replicate * self.dp_shard
        if self.world_size % dp or self.world_size // dp < 2:
            raise ValueError(
                f"{self.nnodes} node(s) x {self.nproc_per_node} process(es) = {self.world_size} ranks do not make "
                f"a pipeline of >= 2 stages x {self.dp_replicate} replica(s) x {self.dp_shard} shard(s)"
            )
        if self.dp_shard > 1 and self.replay_workers > 1:
            raise ValueError("replay helpers with dp_shard > 1 are not supported: a shard group replays together")
        if self.mode not in ("swift", "rollback"):
            raise ValueError(f"mode must be 'swift' or 'rollback', got {self.mode!r}")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rdzv_endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        for name in ("heartbeat_s", "node_timeout_s", "grace_s", "rdzv_timeout_s", "job_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.node_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError("node_timeout_s must exceed two heartbeats")
        for section, seconds in self.hang_timeouts:
            if section not in SECTIONS or not seconds > 0:
                raise ValueError(f"hang timeout {section}={seconds}: a section of {SECTIONS} and seconds > 0")
        layout = self.layout
        if self.group_recovery not in ("kill", "in_place"):
            raise ValueError(f"group_recovery must be 'kill' or 'in_place', got {self.group_recovery!r}")
        if self.groups is not None:
            if dp > 1:
                raise ValueError("logging groups with dp_replicate or dp_shard > 1 are not supported")
            logging_group_sizes(self.groups, layout.num_stages)
        elif self.group_recovery == "in_place":
            raise ValueError("group_recovery 'in_place' needs the logging groups (groups)")
        for ks in self.kills:
            if ks.stage >= layout.num_stages or ks.replica >= layout.dp_replicate or ks.shard >= layout.dp_shard:
                raise ValueError(f"kills: {ks} outside the mesh of {layout.shape()}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def layout(self) -> MeshLayout:
        dp = self.dp_replicate * self.dp_shard
        return MeshLayout(self.world_size // dp, self.dp_replicate, self.dp_shard)

    @property
    def store_address(self) -> tuple[str, int]:
        host, _, port = self.rdzv_endpoint.rpartition(":")
        return host.strip("[]"), int(port)

    def process_root(self, name: str) -> str:
        """Process ``name``'s log store root on this node."""
        return os.path.join(self.store_root, name)
