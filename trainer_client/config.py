"""The trainer client's configuration: one dataclass per component, as plain values.

:class:`ClientConfig` holds a stage's identity, where its logs go and what it logs. The rest sits
in one nested config per component, each handed whole to the component that uses it:

- :class:`WriterConfig`: the asynchronous writer (``AsyncLogWriter(store, config.writer)``);
- :class:`CommitConfig`: the commit step and the shipping of a stage's own data before it;
- :class:`StorageConfig`: the node's log store beyond its location;
- :class:`CheckpointConfig`: where checkpoints go, how many are kept, GC after them;
- :class:`MetricsConfig`: the Prometheus exporter;
- :class:`RecoveryConfig`: how a stage takes part in in-place recovery (``ResilientLoop``).

The common case stays short::

    ClientConfig(run_id="gpt-7", stage=rank, num_stages=4, seed=1234,
                 store_root="/local/swiftlog", cold_url="s3://logs/swiftlog")

Runtime objects (the commit TCPStore, a data source, process groups) are never part of a config:
they are passed to :class:`trainer_client.SwiftlogClient` separately.

Sizes are bytes, durations are ``timedelta``. Each ``__post_init__`` rejects a value that cannot
work with a :class:`~logstore.ConfigError` naming the field, the bad value and the fix.

Environment: the client reads one variable, :data:`ENV_RESTART_COUNT`, once, when a
:class:`ClientConfig` is built. An explicit ``CommitConfig.prefix`` wins over it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from logstore import StoreConfig, validate_name, validate_run
from logstore.errors import ConfigError, InvalidNameError
from trainer_client.mesh import STAGE_STYLES, MeshLayout, exposed_stages, node_map, rank_stages, replica_run

__all__ = [
    "ClientConfig",
    "WriterConfig",
    "CommitConfig",
    "StorageConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "RecoveryConfig",
    "OVERFLOW_POLICIES",
    "ENV_RESTART_COUNT",
    "group_starts",
]

MiB = 1 << 20
#: "wait": block the training thread until the writer frees memory (counted and timed; at most
#: ``WriterConfig.overflow_wait``, then as "gap"); "gap": drop the record and mark the gap in the
#: store (counted).
OVERFLOW_POLICIES = ("wait", "gap")
_CODECS = ("auto", "planes", "zstd", "raw")
#: Set by torchrun to the number of times its agent restarted the workers. A restarted job
#: commits under its own prefix (``CommitConfig.prefix``).
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: set by ``swiftlog agent`` for its workers: the node they run on (a survivor's report names it) and
#: the node server that serves their log store root over HTTP (a replacement on another node reads it there)
ENV_NODE = "SWIFTLOG_NODE"
ENV_NODE_URL = "SWIFTLOG_NODE_URL"


def _group_sizes(groups: Any) -> Sequence[Any]:
    """The sizes in ``logging_groups``: the sizes themselves, a group plan (``.sizes``) or its
    JSON document (``{"sizes": [...]}``)."""
    if isinstance(groups, dict):
        if "sizes" not in groups:
            raise ConfigError(
                f"logging_groups as a document needs 'sizes', got the keys {sorted(groups)[:8]}",
                hint="pass the group planner's output (swiftlog plan-groups --json) or a list of sizes",
            )
        return groups["sizes"]
    sizes = getattr(groups, "sizes", groups)
    if isinstance(sizes, str | bytes) or not hasattr(sizes, "__iter__"):
        raise ConfigError(f"logging_groups must be group sizes or a group plan, got {groups!r}")
    return sizes


def logging_group_sizes(groups: Any, num_stages: int) -> tuple[int, ...]:
    """The group sizes of ``groups`` (sizes, a group plan or its JSON document), checked: positive
    ints adding up to ``num_stages``. Raises ConfigError naming what is wrong."""
    sizes = list(_group_sizes(groups))
    if not sizes or not all(_is_int(g) and g >= 1 for g in sizes) or sum(sizes) != num_stages:
        raise ConfigError(
            f"logging_groups must be positive group sizes adding up to {num_stages} stages, got {groups!r}",
            hint="e.g. [2, 2] for 4 stages, or None to log every boundary",
        )
    return tuple(sizes)


def group_of(logging_groups: Sequence[int] | None, stage: int, num_stages: int) -> list[int]:
    """The stages of ``stage``'s logging group (``[stage]`` without groups)."""
    starts = sorted(group_starts(logging_groups, num_stages) | {num_stages})
    first = max(s for s in starts if s <= stage)
    return list(range(first, min(s for s in starts if s > stage)))


def group_starts(logging_groups: Sequence[int] | None, num_stages: int) -> frozenset[int]:
    """First stage of every logging group (always contains 0).

    ``logging_groups`` are the sizes of consecutive groups (e.g. ``[2, 2]`` for 4 stages);
    None means every stage is its own group. A send between stages ``k`` and ``k + 1`` crosses a
    group boundary iff ``k + 1`` is in the returned set.
    """
    if logging_groups is None:
        return frozenset(range(num_stages))
    starts, at = set(), 0
    for size in logging_groups:
        starts.add(at)
        at += size
    return frozenset(starts)


@dataclass(kw_only=True, slots=True)
class WriterConfig:
    """The asynchronous writer (``trainer_client.writer``): memory bound, overflow policy, encoding.

    max_queue_bytes: bound on bytes held by queued, not yet written records (default 256 MiB;
        pinned host memory on GPU). A single record larger than the bound is admitted when the
        queue is empty. The received buffers held until hashed have a bound of their own of the
        same size. On a GPU, hold at least 4-8 micro-batches of the stage's sends and receives
        (``docs/gpu.md``).
    overflow: what happens when the bound is hit: "wait" (default) or "gap" (:data:`OVERFLOW_POLICIES`).
    overflow_wait: the longest one "wait" at the bound blocks the training thread (default 10 s).
        Then the record is dropped as a gap, an "overflow_timeout" fault says so, and records that
        do not fit are dropped without waiting until the writer moves again.
    codec: record codec, "auto" (default), "planes", "zstd" or "raw".
    encode_threads: background threads that encode records; 0 encodes on the writer thread.
        Encoding is extra CPU load on the node: size it to spare cores. None (default): chosen at
        the first record (``writer.auto_encode_threads``). That is 1 for a stage on CPU, whose own
        compute needs the cores. For a stage on a GPU it is the node's cores per GPU, at most 4
        (``docs/gpu.md``).
    batch_records: at most this many records per store transaction (default 64).
    batch_bytes: at most about this many encoded bytes per transaction (default 16 MiB).
    """

    max_queue_bytes: int = 256 * MiB
    overflow: str = "wait"
    overflow_wait: timedelta = timedelta(seconds=10)
    codec: str = "auto"
    encode_threads: int | None = None
    batch_records: int = 64
    batch_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"WriterConfig.overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if not isinstance(self.overflow_wait, timedelta) or self.overflow_wait <= timedelta(0):
            raise ConfigError(
                f"WriterConfig.overflow_wait must be a positive timedelta, got {self.overflow_wait!r}",
                hint="e.g. timedelta(seconds=10); a hung store must not stop training for good",
            )
        if self.codec not in _CODECS:
            raise ConfigError(f"WriterConfig.codec must be one of {_CODECS}, got {self.codec!r}")
        for name in ("max_queue_bytes", "batch_records", "batch_bytes"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"WriterConfig.{name} must be an int >= 1, got {v!r}")
        if self.encode_threads is not None and (not _is_int(self.encode_threads) or self.encode_threads < 0):
            raise ConfigError(f"WriterConfig.encode_threads must be None or an int >= 0, got {self.encode_threads!r}")


@dataclass(kw_only=True, slots=True)
class CommitConfig:
    """The commit step, and the shipping of a stage's own data that it waits for.

    timeout: how long ``commit`` waits for every stage (default 120 s). On timeout the iteration
        is aborted for everyone.
    prefix: key prefix in the commit store. None (default): ``f"swiftlog/{run_id}"``. Under a
        torchrun restart (:data:`ENV_RESTART_COUNT` > 0) it is ``f"swiftlog/{run_id}/restart{n}"``:
        the agent's store outlives the workers it restarts, and the first attempt's decisions
        must not answer the redone iterations. ``ClientConfig.commit_prefix`` is the one in force.
    ship_data: after every iteration, seal this stage's input, target and META segments so the
        uploader ships them to the cold tier at once (default True; no-op without a cold tier).
    ship_wait: how long ``commit(t)`` waits, before reporting the stage done, until t's own data
        is in the cold tier (default 10 s). It applies with ``ship_data`` on a stage that logs
        data only it has: the first stage's inputs and the last stage's targets with
        ``log_data``, and any stage's keyword inputs of the step. Then a replacement of this
        stage can replay t when its machine (and disk) dies right after the commit. None: never
        wait (such a failure then needs a rollback). A wait that times out is a "ship_timeout"
        fault. After one, commits only check (no wait) until the cold tier has caught up.
    ship_lag_report: while the cold tier has not caught up, a "ship_lag" fault is reported at
        most this often (default 60 s).
    """

    timeout: timedelta = timedelta(seconds=120)
    prefix: str | None = None
    ship_data: bool = True
    ship_wait: timedelta | None = timedelta(seconds=10)
    ship_lag_report: timedelta = timedelta(seconds=60)

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, timedelta) or self.timeout <= timedelta(0):
            raise ConfigError(f"CommitConfig.timeout must be a positive timedelta, got {self.timeout!r}")
        if self.prefix is not None and (not isinstance(self.prefix, str) or not self.prefix):
            raise ConfigError(f"CommitConfig.prefix must be None or a non-empty string, got {self.prefix!r}")
        if self.ship_wait is not None and (not isinstance(self.ship_wait, timedelta) or self.ship_wait < timedelta(0)):
            raise ConfigError(
                f"CommitConfig.ship_wait must be None or a non-negative timedelta, got {self.ship_wait!r}"
            )
        if not isinstance(self.ship_lag_report, timedelta) or self.ship_lag_report < timedelta(0):
            raise ConfigError(
                f"CommitConfig.ship_lag_report must be a non-negative timedelta, got {self.ship_lag_report!r}"
            )


@dataclass(kw_only=True, slots=True)
class StorageConfig:
    """The node's log store, beyond where it is (``ClientConfig.store_root`` and ``cold_url``).

    cold_options: fsspec/s3fs storage options for the cold tier (endpoint, keys...). They are also
        used for checkpoints written under an ``s3://`` checkpoint URL. Default empty.
    segment_iters: iterations per hot-tier segment (default 4); GC and upload granularity.
    durability: "process" (default: survives the death of the process) or "fsync".
    max_backlog_bytes: sealed-but-not-uploaded bytes beyond which writes fail and become gaps
        (the store raises StoreFullError). None (default): bounded by the disk only.
    """

    cold_options: dict[str, Any] = field(default_factory=dict)
    segment_iters: int = 4
    durability: str = "process"
    max_backlog_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cold_options, dict):
            raise ConfigError(f"StorageConfig.cold_options must be a dict, got {type(self.cold_options).__name__}")
        if not _is_int(self.segment_iters) or self.segment_iters < 1:
            raise ConfigError(f"StorageConfig.segment_iters must be an int >= 1, got {self.segment_iters!r}")
        if self.max_backlog_bytes is not None and (not _is_int(self.max_backlog_bytes) or self.max_backlog_bytes < 0):
            raise ConfigError(
                f"StorageConfig.max_backlog_bytes must be None or an int >= 0, got {self.max_backlog_bytes!r}"
            )
        if self.durability not in ("process", "fsync"):
            raise ConfigError(f"StorageConfig.durability must be 'process' or 'fsync', got {self.durability!r}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where a stage's checkpoints go, how many are kept, and the GC they trigger.

    url: directory (local path, ``file://`` or ``s3://``) for checkpoints. None (default):
        ``{cold_url}/{run_id}/checkpoint-files`` when there is a cold tier, else
        ``{store_root}/{run_id}/checkpoint-files`` (then durable only on a shared filesystem).
    keep: keep only this stage's newest N checkpoints that this client wrote (at its ``url``).
        Once a newer one is registered, an older one's registration is withdrawn, then its file
        deleted (in the background; failures are "checkpoint_retire" faults). None (default)
        keeps every file. At least 2: a rollback restarts from the newest checkpoint every stage
        has, and one stage may not have finished its newest.
    gc_after: run ``store.gc()`` in the background after each registered checkpoint, once the
        writer has drained the older records (default True).
    format: ``"torch"`` (default: one ``torch.save`` file per stage and iteration) or ``"dcp"``
        (``torch.distributed.checkpoint``: a directory per step, see
        ``trainer_client.dcp_checkpoint``).
    async_save: with ``"dcp"``, ``dcp.async_save``: ``checkpoint`` returns once the state is
        staged; the checkpoint is registered (and counts as durable) only when the save completed.
    """

    url: str | None = None
    keep: int | None = None
    gc_after: bool = True
    format: str = "torch"
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.format not in ("torch", "dcp"):
            raise ConfigError(f"CheckpointConfig.format must be 'torch' or 'dcp', got {self.format!r}")
        if self.async_save and self.format != "dcp":
            raise ConfigError("CheckpointConfig.async_save needs format='dcp'")
        if self.url is not None and (not isinstance(self.url, str) or not self.url):
            raise ConfigError(f"CheckpointConfig.url must be None or a non-empty string, got {self.url!r}")
        if self.keep is not None and (not _is_int(self.keep) or self.keep < 2):
            raise ConfigError(
                f"CheckpointConfig.keep must be None or an int >= 2, got {self.keep!r}",
                hint="a rollback restarts from the newest checkpoint every stage has; "
                "a stage may not have finished its newest",
            )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """The client's Prometheus exporter (``trainer_client.metrics``).

    port: serve this client's counters (``stats()``) at ``http://{host}:{port}/metrics``, read at
        scrape time. None (default): off. 0: any free port (``SwiftlogClient.metrics_address``
        says which). One port per rank, e.g. a base port plus the stage.
    host: the address the exporter listens on (default ``127.0.0.1``, loopback only). ``0.0.0.0``
        lets a Prometheus server on another host scrape it.
    """

    port: int | None = None
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.port is not None and (not _is_int(self.port) or not 0 <= self.port <= 65535):
            raise ConfigError(
                f"MetricsConfig.port must be None or an int in 0..65535, got {self.port!r}",
                hint="None turns the exporter off; 0 takes any free port",
            )
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(
                f"MetricsConfig.host must be a host name or address, got {self.host!r}", hint="e.g. 127.0.0.1"
            )


class _MeshPosition:
    """Where a config's rank stands in the mesh, derived from ``num_stages``, ``dp_replicate``,
    ``dp_shard``, ``stage``, ``replica`` and ``shard`` (shared by :class:`ClientConfig` and
    :class:`RecoveryConfig`)."""

    __slots__ = ()
    num_stages: int
    dp_replicate: int
    dp_shard: int
    stage: int
    replica: int
    shard: int
    stages_per_rank: int
    stage_style: str

    @property
    def stages(self) -> tuple[int, ...]:
        """The pipeline stages this rank holds (``(stage,)`` with one stage per rank)."""
        return rank_stages(self.stage, self.num_stages, self.stages_per_rank, self.stage_style)

    @property
    def num_pipeline_stages(self) -> int:
        """Stages of the whole pipeline: ``num_stages * stages_per_rank``."""
        return self.num_stages * self.stages_per_rank

    def _check_stages(self) -> None:
        if not _is_int(self.stages_per_rank) or self.stages_per_rank < 1:
            raise ConfigError(f"stages_per_rank must be an int >= 1, got {self.stages_per_rank!r}")
        if self.stage_style not in STAGE_STYLES:
            raise ConfigError(f"stage_style must be one of {STAGE_STYLES}, got {self.stage_style!r}")
        if self.stages_per_rank > 1 and self.dp_size > 1:
            raise ConfigError(
                "stages_per_rank > 1 with dp_replicate or dp_shard > 1 is not supported yet",
                hint="a multi-stage schedule runs one pipeline (dp_replicate = dp_shard = 1)",
            )

    @property
    def layout(self) -> MeshLayout:
        """The mesh: ``num_stages`` x ``dp_replicate`` x ``dp_shard``."""
        return MeshLayout(self.num_stages, self.dp_replicate, self.dp_shard)

    @property
    def rank(self) -> int:
        """This rank's global rank in the mesh: ``(stage * dp_replicate + replica) * dp_shard +
        shard`` (the stage, in a mesh of one pipeline)."""
        return self.layout.rank(self.stage, self.replica, self.shard)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_index(self) -> int:
        """This rank's data-parallel pipeline: ``replica * dp_shard + shard``."""
        return self.replica * self.dp_shard + self.shard

    @property
    def dp_size(self) -> int:
        """How many data-parallel pipelines the mesh runs."""
        return self.dp_replicate * self.dp_shard


@dataclass(kw_only=True, slots=True)
class ClientConfig(_MeshPosition):
    """Configuration of one stage's :class:`~trainer_client.SwiftlogClient`.

    Identity
        run_id: run id shared by every stage (a safe name: letters, digits, ``._-``).
        stage: this process's pipeline stage index, ``0 <= stage < num_stages``.
        num_stages: number of pipeline stages.
        seed: run seed (0..2**64-1, default 0). Every micro-batch forward is seeded from
            (seed, stage, iteration, micro-batch), see ``trainer_client.determinism``.
        writer_name: this stage's writer name in the log store (default ``f"stage{stage}"``).
            Unique per process on a store root.
        replica / dp_replicate: this rank's data-parallel replica and how many replicas hold
            each stage (default 0 of 1). With more than one, the rank's coordinate in the
            ``pp`` x ``dp_replicate`` mesh is ``(stage, replica)`` (``trainer_client.mesh``):
            each replica's pipeline logs under a run of its own (:attr:`log_run`), the commit
            step spans the whole mesh, and ``step`` averages the gradients over the replicas.
        stages_per_rank / stage_style: a multi-stage schedule (``SwiftlogClient.schedule``:
            Interleaved1F1B, ZBVZeroBubble, ...) puts ``stages_per_rank`` stages on every rank,
            placed in torch's ``"loop"`` or ``"v"`` style (``trainer_client.mesh.rank_stages``).
            Then ``stage`` and ``num_stages`` are the rank's position in the ``pp`` dimension and
            the number of ranks; :attr:`stages` are the pipeline stages it holds. Default 1,
            "loop". Not yet with ``dp_replicate`` / ``dp_shard`` > 1 or logging groups.
        shard / dp_shard: this rank's shard and how many ranks shard each stage in a replica
            (FSDP2's ``fully_shard`` over the mesh's ``dp_shard`` group, default 0 of 1). Every
            ``(replica, shard)`` pair is a data-parallel pipeline of its own, with its own logs
            (``dp_index``). With replicas too (HSDP) ``step`` averages the gradients' shards over
            the replicas.
        replica_bucket_bytes: the bucket of that average (default 25 MiB, torch DDP's); part of
            the layout a replay repeats.
        node_map: rank -> the machine it runs on (``trainer_client.mesh.node_map``: a list by
            rank or a mapping), or None.
        replica_logging: ``"always"`` (default) or ``"when_exposed"``: with a node map, log only
            when some stage has every replica on one machine (``mesh.exposed_stages``). Where none
            has, a single failure is always healed by a copy; logging is then off for the run
            (``logging_off_reason`` says why) and a double failure costs a rollback.

    Where logs go
        store_root: the node's log-store root directory (hot tier: LMDB index + segments).
        cold_url: ``file:///dir`` or ``s3://bucket/prefix`` for the cold tier. None (default):
            hot only (a dead node's logs are then only reachable through that node's disk).

    What is logged
        logging_groups: sizes of consecutive logging groups summing to num_stages. Only sends
            that cross a group boundary are logged (with their digests). None (default): every
            stage is its own group, so every send is logged. Also takes what the group planner
            returns (``replay.plan_groups``, ``swiftlog plan-groups --json``, the REST API): a
            plan with ``sizes``, or its JSON document.
        log_data: log stage-0 inputs and last-stage targets (default True). Set False only when
            a deterministic, iteration-addressable data source is given to the client and to
            the replay.
        enabled: start with logging on (default True). Seeding, META and the commit step happen
            either way; see ``SwiftlogClient.set_logging``.

    Components (each a config of its own, with its defaults)
        writer: :class:`WriterConfig`. commit: :class:`CommitConfig`. storage:
        :class:`StorageConfig`. checkpoints: :class:`CheckpointConfig`. metrics:
        :class:`MetricsConfig`.

    Derived
        commit_prefix: the commit-store key prefix in force (``CommitConfig.prefix``, else the
            default it describes), fixed when the config is built.
    """

    run_id: str
    stage: int
    num_stages: int
    store_root: str | os.PathLike[str]
    cold_url: str | None = None
    seed: int = 0
    writer_name: str | None = None
    replica: int = 0
    dp_replicate: int = 1
    shard: int = 0
    dp_shard: int = 1
    stages_per_rank: int = 1
    stage_style: str = "loop"
    replica_bucket_bytes: int = 25 << 20
    node_map: Any = None
    replica_logging: str = "always"
    logging_groups: Sequence[int] | None = None
    log_data: bool = True
    enabled: bool = True
    writer: WriterConfig = field(default_factory=WriterConfig)
    commit: CommitConfig = field(default_factory=CommitConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    commit_prefix: str = field(init=False, default="")
    logging_off_reason: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        try:
            validate_run(self.run_id)
        except InvalidNameError as e:
            raise ConfigError(f"run_id: {e}") from e
        if not _is_int(self.num_stages) or self.num_stages < 1:
            raise ConfigError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if not _is_int(self.stage) or not 0 <= self.stage < self.num_stages:
            raise ConfigError(f"stage must be an int in 0..{self.num_stages - 1}, got {self.stage!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise ConfigError(f"seed must be an int in 0..2**64-1, got {self.seed!r}")
        _check_replica(self.replica, self.dp_replicate)
        _check_replica(self.shard, self.dp_shard, "shard", "dp_shard")
        self._check_stages()
        if self.stages_per_rank > 1 and self.logging_groups is not None:
            raise ConfigError(
                "logging_groups with stages_per_rank > 1 are not supported",
                hint="log every boundary (logging_groups=None) with a multi-stage schedule",
            )
        if not _is_int(self.replica_bucket_bytes) or self.replica_bucket_bytes < 1024:
            raise ConfigError(f"replica_bucket_bytes must be an int >= 1024, got {self.replica_bucket_bytes!r}")
        if self.dp_size > 1 and self.logging_groups is not None:
            raise ConfigError(
                "logging_groups with dp_replicate or dp_shard > 1 are not supported yet",
                hint="log every boundary (logging_groups=None) in a data-parallel mesh",
            )
        if self.writer_name is None:
            self.writer_name = f"stage{self.stage}"
        try:
            validate_name(self.writer_name, "writer name")
        except InvalidNameError as e:
            raise ConfigError(f"writer_name: {e}") from e
        if not isinstance(self.store_root, (str, os.PathLike)) or not str(self.store_root):
            raise ConfigError(f"store_root must be a directory path, got {self.store_root!r}")
        if self.cold_url is not None and (not isinstance(self.cold_url, str) or not self.cold_url):
            raise ConfigError(
                f"cold_url must be None or a URL string, got {self.cold_url!r}",
                hint="e.g. file:///data/cold or s3://bucket/prefix",
            )
        if self.logging_groups is not None:
            self.logging_groups = logging_group_sizes(self.logging_groups, self.num_stages)
        for name, kind in (
            ("writer", WriterConfig),
            ("commit", CommitConfig),
            ("storage", StorageConfig),
            ("checkpoints", CheckpointConfig),
            ("metrics", MetricsConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}",
                    hint=f"e.g. ClientConfig(..., {name}={kind.__name__}())",
                )
        self.commit_prefix = self.commit.prefix or _default_commit_prefix(self.run_id)
        self._replica_logging()

    def _replica_logging(self) -> None:
        """Check the node map and ``replica_logging``; set ``logging_off_reason`` when no stage
        can lose all its replicas to one machine's failure."""
        if self.replica_logging not in ("always", "when_exposed"):
            raise ConfigError(f"replica_logging must be 'always' or 'when_exposed', got {self.replica_logging!r}")
        if self.node_map is not None:
            try:
                self.node_map = node_map(self.layout, self.node_map)
            except ValueError as e:
                raise ConfigError(f"node_map: {e}") from None
        if self.replica_logging == "always":
            return
        if self.node_map is None or self.dp_replicate < 2:
            raise ConfigError(
                "replica_logging='when_exposed' needs dp_replicate > 1 and a node_map",
                hint="node_map: the machine of every rank, e.g. ['host-a', 'host-b', ...] by rank",
            )
        if not exposed_stages(self.layout, self.node_map):
            self.logging_off_reason = (
                "every stage has replicas on two or more machines: one machine's loss is healed by a copy"
            )

    # -- derived ---------------------------------------------------------------------------
    @property
    def log_run(self) -> str:
        """The run this rank's logs and checkpoints go under: ``run_id``, or with several
        data-parallel pipelines ``f"{run_id}.dp{dp_index}"`` (each pipeline is logged on its own)."""
        return replica_run(self.run_id, self.dp_index, self.dp_size)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def logs_forward_send(self) -> bool:
        """Whether this stage's activations to ``stage + 1`` cross a logging-group boundary."""
        return not self.is_last and (self.stage + 1) in group_starts(self.logging_groups, self.num_stages)

    def logs_backward_send(self) -> bool:
        """Whether this stage's gradients to ``stage - 1`` cross a logging-group boundary."""
        return not self.is_first and self.stage in group_starts(self.logging_groups, self.num_stages)

    def group_of(self, stage: int | None = None) -> tuple[int, int]:
        """``(first, last)`` stage of the logging group holding ``stage`` (default: this stage)."""
        s = self.stage if stage is None else stage
        starts = sorted(group_starts(self.logging_groups, self.num_stages))
        first = max(x for x in starts if x <= s)
        nxt = [x for x in starts if x > s]
        return first, (nxt[0] - 1 if nxt else self.num_stages - 1)

    def stage_view(self, stage: int) -> ClientConfig:
        """The config of pipeline stage ``stage`` of this rank (a multi-stage schedule): the same
        run, store and components, with ``stage`` / ``num_stages`` the pipeline's and one stage per
        rank, and no metrics port (the rank's client serves one). Raises ConfigError for a stage
        this rank does not hold."""
        if stage not in self.stages:
            raise ConfigError(f"rank at pp position {self.stage} holds stages {list(self.stages)}, not {stage}")
        return dataclasses.replace(
            self,
            stage=stage,
            num_stages=self.num_pipeline_stages,
            stages_per_rank=1,
            stage_style="loop",
            metrics=MetricsConfig(),
        )

    def store_config(self) -> StoreConfig:
        """The configuration of this stage's :class:`~logstore.LogStore`."""
        s = self.storage
        return StoreConfig(
            root=self.store_root,
            run=self.log_run,
            writer=self.writer_name,
            cold_url=self.cold_url,
            cold_options=dict(s.cold_options),
            durability=s.durability,
            segment_iters=s.segment_iters,
            max_backlog_bytes=s.max_backlog_bytes,
            codec=self.writer.codec,
        )

    def checkpoint_options(self) -> dict[str, Any] | None:
        """fsspec storage options for the checkpoint location: ``storage.cold_options`` for a
        remote URL (``s3://``...), None for a local path or ``file://``."""
        url = self.resolved_checkpoint_url()
        return dict(self.storage.cold_options) if "://" in url and not url.startswith("file://") else None

    def resolved_checkpoint_url(self) -> str:
        """Where checkpoints go when ``checkpoints.url`` is None (see :class:`CheckpointConfig`)."""
        if self.checkpoints.url:
            base = self.checkpoints.url.rstrip("/")
            return base if self.dp_size == 1 else f"{base}/dp{self.dp_index}"
        if self.cold_url:
            base = self.cold_url.rstrip("/")
            if "://" not in base:
                base = "file://" + os.path.abspath(base)
            return f"{base}/{self.log_run}/checkpoint-files"
        return os.path.join(os.path.abspath(os.fspath(self.store_root)), self.log_run, "checkpoint-files")


@dataclass(kw_only=True, slots=True)
class RecoveryConfig(_MeshPosition):
    """How one stage takes part in in-place recovery (:class:`~trainer_client.ResilientLoop`).

    run_id / stage / num_stages / replica / dp_replicate / shard / dp_shard / stages_per_rank /
        stage_style: as in
        :class:`ClientConfig`. The
        recovery protocol's keys and the process groups are per rank (``rank``, ``world_size``).
    generation: the process-group generation the stage starts in (default 0; the new one for a
        replacement).
    backend: the process groups' backend (default "gloo").
    pg_timeout: gloo timeout of each process group (default 60 s). A safety net: failures are
        detected from errors, not from it.
    rejoin_timeout: longest wait for the replacement to be ready and for the new group to form
        (default 120 s).
    heartbeat_interval: each stage writes a heartbeat into the store this often (default 100 ms).
    heartbeat_timeout: a stage whose heartbeat is older than this is declared dead and its
        generation marked failed (default 2 s). It must exceed the longest stall of a live
        process; 2 s is conservative on a loaded machine. None disables the monitor.
    store_host / store_port: where the heartbeat thread opens its own store connection (default
        None: no heartbeat).
    commit_prefix: the commit store's key prefix (default None: the client's).
    max_failures: recoveries after which a further failure is raised instead (default 4).
    snapshot_dir: under torchrun (which stops every rank when one fails): a node-local directory
        (e.g. ``trainer_client.snapshots.default_snapshot_dir()``). On a failure, or on the
        agent's SIGTERM, this rank saves its state there at the resume iteration and raises
        ``RestartRequired`` instead of waiting for a replacement; ``replay.recover_on_restart``
        resumes from it in the next attempt. None (default): wait for a replacement.
    """

    run_id: str
    stage: int
    num_stages: int
    replica: int = 0
    dp_replicate: int = 1
    shard: int = 0
    dp_shard: int = 1
    stages_per_rank: int = 1
    stage_style: str = "loop"
    generation: int = 0
    backend: str = "gloo"
    pg_timeout: datetime.timedelta = datetime.timedelta(seconds=60)
    rejoin_timeout: datetime.timedelta = datetime.timedelta(seconds=120)
    heartbeat_interval: datetime.timedelta = datetime.timedelta(milliseconds=100)
    heartbeat_timeout: datetime.timedelta | None = datetime.timedelta(seconds=2)
    store_host: str | None = None
    store_port: int | None = None
    commit_prefix: str | None = None
    max_failures: int = 4
    snapshot_dir: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.num_stages:
            raise ConfigError(f"stage {self.stage} is not in [0, {self.num_stages})")
        _check_replica(self.replica, self.dp_replicate)
        _check_replica(self.shard, self.dp_shard, "shard", "dp_shard")
        self._check_stages()
        if self.generation < 0:
            raise ConfigError(f"generation must be >= 0, got {self.generation}")
        if self.rejoin_timeout.total_seconds() <= 0:
            raise ConfigError("rejoin_timeout must be positive")
        if self.heartbeat_timeout is not None and self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must be longer than heartbeat_interval")


def _check_replica(replica: object, dp_replicate: object, name: str = "replica", dim: str = "dp_replicate") -> None:
    if not _is_int(dp_replicate) or dp_replicate < 1:  # type: ignore[operator]
        raise ConfigError(f"{dim} must be an int >= 1, got {dp_replicate!r}")
    if not _is_int(replica) or not 0 <= replica < dp_replicate:  # type: ignore[operator]
        raise ConfigError(f"{name} must be an int in 0..{dp_replicate - 1}, got {replica!r}")  # type: ignore[operator]


def _default_commit_prefix(run_id: str) -> str:
    """``swiftlog/{run_id}``, under a torchrun restart ``swiftlog/{run_id}/restart{n}``."""
    restart = os.environ.get(ENV_RESTART_COUNT, "0").strip()
    return f"swiftlog/{run_id}" + (f"/restart{restart}" if restart not in ("", "0") else "")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
