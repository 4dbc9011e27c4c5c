"""What a simulated job is: its layout, its costs, its failures, and where each figure came from.

:class:`Layout` is the parallelism (tensor x pipeline x sharded x replicated data parallel) and how
ranks sit on nodes. :class:`ScaleInputs` holds every input of the simulation as a plain number,
with ``sources`` saying for each one whether it was measured here (which file, which key) or
assumed (and the rule). :func:`measured_inputs` reads the project's bench results and keeps
the defaults for what they do not measure.

Placement: a node holds ``gpus_per_node`` consecutive ranks, tensor parallel innermost, then the
pipeline stage, then the data-parallel shard, then the replica. With TP8 on 8-GPU nodes a node is
one (replica, shard, stage); a failure domain (a rack or a switch) is ``domain_nodes`` consecutive
nodes, so it holds consecutive stages of one pipeline.

Never: reads anything but the bench results it is pointed at; no default hides its origin.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["Layout", "ScaleInputs", "measured_inputs", "LLAMA3_405B", "REPLICATED_405B"]

HOUR = 3600.0
# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days of a 16,384-GPU job
_LLAMA3_INTERRUPTIONS, _LLAMA3_DAYS, _LLAMA3_GPUS = 419, 54, 16384


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism and the node size; ``gpus`` is their product."""

    tp: int = 8
    pp: int = 16
    dp_shard: int = 128
    dp_replicate: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"layout {f.name} must be a positive int, got {v!r}")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"layout of {self.gpus} GPUs does not fill nodes of {self.gpus_per_node}")
        if self.tp > self.gpus_per_node and self.tp % self.gpus_per_node:
            raise ValueError(f"tp {self.tp} must divide or be a multiple of gpus_per_node {self.gpus_per_node}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp_shard * self.dp_replicate

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def units_of_node(self, node: int) -> set[tuple[int, int, int]]:
        """The (replica, shard, stage) units whose ranks the node holds (all or part of them)."""
        tp, pp, ds = self.tp, self.pp, self.dp_shard
        first, last = node * self.gpus_per_node, (node + 1) * self.gpus_per_node
        out = set()
        for g in range(first, last, min(tp, self.gpus_per_node)):
            cell = g // tp
            out.add((cell // (pp * ds), (cell // pp) % ds, cell % pp))
        return out

    def describe(self) -> str:
        rep = f" x DDP{self.dp_replicate}" if self.dp_replicate > 1 else ""
        return f"TP{self.tp} x PP{self.pp} x FSDP{self.dp_shard}{rep} ({self.gpus} GPUs, {self.nodes} nodes)"

    def with_gpus(self, gpus: int) -> Layout:
        """The same layout grown or shrunk in its data-parallel shard degree to ``gpus`` GPUs."""
        per_shard = self.tp * self.pp * self.dp_replicate
        if gpus % per_shard:
            raise ValueError(f"{gpus} GPUs is not a multiple of TP x PP x replicas = {per_shard}")
        return replace(self, dp_shard=gpus // per_shard)


@dataclass(frozen=True)
class ScaleInputs:
    """Every number the simulation uses. Times in seconds, sizes in bytes, rates in bytes/s.

    Model and step: ``params``, ``bytes_per_param`` (state per parameter: weights, master copy,
    optimizer moments), ``iteration_s`` (a training step), ``n_microbatches`` per pipeline per
    step, ``activation_bytes`` (one micro-batch's activation at a stage boundary).
    Failures: ``failures_per_node_hour`` (incidents starting at a node), ``correlated_fraction``
    of incidents that take the node's whole domain of ``domain_nodes`` nodes.
    Recovery costs: ``detect_s``, ``restart_job_s`` (every process restarts and re-forms the job),
    ``replace_node_s`` (a spare replaces lost nodes while the survivors keep their processes),
    ``ckpt_sync_s`` (a persistent checkpoint's planning and barrier, on top of its snapshot),
    ``ckpt_write_bps`` / ``ckpt_read_bps`` (persistent checkpoint, per node), ``snapshot_bps``
    (device to host copy, the stall of an asynchronous checkpoint), ``net_bps`` (per node, replica
    copies and in-memory checkpoints), ``cold_fetch_bps`` (per node, logs from the object store).
    Logging: ``logging_overhead`` (training step with logging over without), ``compression``,
    ``commit_requests`` per committing node per step and ``store_requests_per_s`` (the commit
    store's rate), ``replay_efficiency`` (a replayed stage iteration over its bubble-free live
    compute), ``parallel_serial_fraction`` (Amdahl's serial part of a K-way replay),
    ``replay_workers``, ``disk_bytes`` and ``disk_fraction`` (per node, for logs),
    ``cold_tier`` (logs also reach the object store: a lost sender's logs survive it).
    In-memory checkpoints: ``memory_peer_other_domain`` (the peer copy lives in another domain).
    ``work_s``: failure-free training time to simulate. ``sources``: input -> where it came from.
    """

    params: float = 405e9
    bytes_per_param: float = 16.0
    iteration_s: float = 6.3
    n_microbatches: int = 16
    activation_bytes: float = 8192 * 16384 * 2.0
    failures_per_node_hour: float = 8 * _LLAMA3_INTERRUPTIONS / (_LLAMA3_DAYS * 24 * _LLAMA3_GPUS)
    correlated_fraction: float = 0.05
    domain_nodes: int = 4
    detect_s: float = 30.0
    restart_job_s: float = 600.0
    replace_node_s: float = 120.0
    ckpt_sync_s: float = 5.0
    ckpt_write_bps: float = 1e9
    ckpt_read_bps: float = 2e9
    snapshot_bps: float = 25e9
    net_bps: float = 25e9
    cold_fetch_bps: float = 1e9
    logging_overhead: float = 1.03
    compression: float = 1.5
    commit_requests: float = 3.0
    store_requests_per_s: float = 50e3
    replay_efficiency: float = 1.0
    parallel_serial_fraction: float = 0.18
    replay_workers: int = 2
    disk_bytes: float = 30e12
    disk_fraction: float = 0.25
    cold_tier: bool = True
    memory_peer_other_domain: bool = False
    work_s: float = 30 * 24 * HOUR
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "sources" or isinstance(v, bool):
                continue
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"input {f.name} must be a finite number >= 0, got {v!r}")
        if not 0 <= self.correlated_fraction <= 1 or not 0 < self.disk_fraction <= 1:
            raise ValueError("correlated_fraction must be in [0, 1] and disk_fraction in (0, 1]")
        if self.iteration_s <= 0 or self.work_s <= 0 or self.n_microbatches < 1 or self.replay_workers < 1:
            raise ValueError("iteration_s and work_s must be > 0, n_microbatches and replay_workers >= 1")
        if self.domain_nodes < 1 or self.logging_overhead < 1:
            raise ValueError("domain_nodes must be >= 1 and logging_overhead >= 1")

    def with_(self, **changes: Any) -> ScaleInputs:
        """A copy with ``changes``; each changed input's source says it was given."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown input(s): {sorted(unknown)}")
        src = dict(self.sources) | {k: "given" for k in changes if k != "sources"}
        return replace(self, **changes, sources=src)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- derived figures: one rule each, named in the output's assumptions -------------------
    def node_state_bytes(self, layout: Layout) -> float:
        """Model state one node holds: every copy counted once per replica."""
        return self.params * self.bytes_per_param / (layout.nodes / layout.dp_replicate)

    def logged_bytes_per_node_iteration(self) -> float:
        """A stage's node sends one activation forward and one gradient back per micro-batch."""
        return 2 * self.activation_bytes * self.n_microbatches / self.compression

    def replay_ratio(self, layout: Layout) -> float:
        """A lost stage's replay of one iteration over the live iteration: its compute without
        the pipeline's bubble (1F1B: m / (m + S - 1)), over ``replay_efficiency``."""
        m, S = self.n_microbatches, layout.pp
        return m / (m + S - 1) / max(self.replay_efficiency, 1e-9)

    def parallel_speedup(self, k: int) -> float:
        """Amdahl: a K-way replay's speedup with serial part ``parallel_serial_fraction``."""
        f = min(max(self.parallel_serial_fraction, 0.0), 1.0)
        return 1.0 / (f + (1.0 - f) / max(k, 1))

    def commit_s(self, layout: Layout) -> float:
        """The commit step's stall per iteration: every node's requests served by one store."""
        return layout.nodes * self.commit_requests / max(self.store_requests_per_s, 1e-9)

    def incidents_per_s(self, layout: Layout) -> float:
        return layout.nodes * self.failures_per_node_hour / HOUR


LLAMA3_405B = Layout(tp=8, pp=16, dp_shard=128, dp_replicate=1)
REPLICATED_405B = Layout(tp=8, pp=16, dp_shard=64, dp_replicate=2)

_ASSUMED = {
    "params": "assumed: a Llama-3-405B-like model",
    "bytes_per_param": "assumed: bf16 weights and gradients, fp32 master weights and two Adam moments",
    "iteration_s": "assumed: 6 x params x 16M tokens / (16,384 H100 x 989 TFLOP/s x 40 % MFU), per-GPU work kept "
    "as the job grows (weak scaling)",
    "n_microbatches": "assumed: 16 sequences per pipeline per step",
    "activation_bytes": "assumed: sequence 8192 x hidden 16384 x bf16",
    "failures_per_node_hour": "Llama 3: 419 interruptions in 54 days on 16,384 GPUs, per 8-GPU node",
    "correlated_fraction": "assumed: 5 % of incidents take a whole rack or switch",
    "domain_nodes": "assumed: 4 nodes per rack or leaf switch",
    "detect_s": "assumed: a collective timeout or a heartbeat at scale",
    "restart_job_s": "assumed: rescheduling, process start, communicator set-up of the whole job",
    "replace_node_s": "assumed: a warm spare joins, the survivors re-form their groups",
    "ckpt_sync_s": "assumed: DCP's save plan and barrier at scale",
    "ckpt_write_bps": "assumed: a node's share of the checkpoint storage's bandwidth",
    "ckpt_read_bps": "assumed",
    "snapshot_bps": "assumed: pinned device-to-host copy",
    "net_bps": "assumed: 200 Gb/s per node",
    "cold_fetch_bps": "assumed: a node's share of the object store",
    "logging_overhead": "assumed",
    "compression": "assumed",
    "commit_requests": "swiftlog's commit: done mark with META, counter, decision",
    "store_requests_per_s": "assumed",
    "replay_efficiency": "assumed: a replay computes as fast as the live stage",
    "parallel_serial_fraction": "assumed",
    "replay_workers": "assumed: each lost stage replays with one surviving helper",
    "disk_bytes": "assumed: 8 x 3.84 TB NVMe per node",
    "disk_fraction": "assumed: a quarter of the node's disk for logs",
    "cold_tier": "assumed: logs are uploaded to the object store",
    "memory_peer_other_domain": "assumed: an in-memory checkpoint's copy lives in a neighbour node of the same rack",
    "work_s": "assumed: 30 days of failure-free training",
}


def measured_inputs(results_dir: str | Path | None = None, base: ScaleInputs | None = None) -> ScaleInputs:
    """``base`` (default: :class:`ScaleInputs`) with the figures the project's benches measured
    (``bench/results/*.json``): the logging overhead and the device-to-host copy rate (on a GPU
    where ``cuda.json`` has them), the compression ratio of bf16 logs, the K = 2 replay's speedup
    (as an Amdahl serial fraction) and the commit store's request rate.
    A missing file leaves the default and its source says so."""
    base = base or ScaleInputs()
    src = {k: v for k, v in _ASSUMED.items()} | dict(base.sources)
    root = Path(results_dir) if results_dir is not None else Path(__file__).resolve().parents[2] / "bench" / "results"
    got: dict[str, Any] = {}

    def take(file: str, key: str, name: str, convert: Any = float, rule: str = "") -> None:
        try:
            value = json.loads((root / file).read_text())
            for part in key.split("."):
                value = value[part]
            if not isinstance(value, int | float):
                return
            got[name] = convert(value)
            src[name] = f"measured: bench/results/{file} {key}" + (f" ({rule})" if rule else "")
        except (OSError, KeyError, TypeError, ValueError):
            pass

    take("client.json", "overhead_ratio", "logging_overhead", rule="a CPU pipeline; cuda.json overrides it")
    take("cuda.json", "overhead_ratio", "logging_overhead", rule="a logging stage on an H200")
    take("cuda.json", "d2h_pinned_gbps", "snapshot_bps", lambda g: g * 1e9, "H200, pinned, side stream")
    take("store.json", "codec_ratio_bf16", "compression")
    take(
        "replay.json",
        "parallel_speedup_k2",
        "parallel_serial_fraction",
        lambda s2: min(max(2.0 / s2 - 1.0, 0.0), 1.0),
        "the serial fraction f with 1 / (f + (1 - f) / 2) equal to it",
    )
    take("sim.json", "store_requests_per_s", "store_requests_per_s", rule="one TCPStore, 4 clients, loopback")
    return replace(base, **got, sources=src)
