"""ClientConfig: everything the trainer client needs to know, as plain values.

Runtime objects (the commit TCPStore, a data source, process groups) are never part of the
config: they are passed to :class:`trainer_client.SwiftlogClient` separately.

Sizes are bytes, durations are ``timedelta``. ``__post_init__`` rejects any value that cannot
work with a :class:`~logstore.ConfigError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from logstore import validate_name, validate_run
from logstore.errors import ConfigError, InvalidNameError

__all__ = ["ClientConfig", "OVERFLOW_POLICIES", "group_starts"]

MiB = 1 << 20
#: "wait": block the training thread until the writer frees memory (counted and timed; at most
#: ``ClientConfig.overflow_wait``, then as "gap"); "gap": drop the record and mark the gap in the
#: store (counted).
OVERFLOW_POLICIES = ("wait", "gap")
_CODECS = ("auto", "planes", "zstd", "raw")


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
class ClientConfig:
    """Configuration of one stage's :class:`~trainer_client.SwiftlogClient`.

    Identity
        run_id: run id shared by every stage (a safe name: letters, digits, ``._-``).
        stage: this process's pipeline stage index, ``0 <= stage < num_stages``.
        num_stages: number of pipeline stages.
        seed: run seed (0..2**64-1, default 0); every micro-batch forward is seeded from
            (seed, stage, iteration, micro-batch), see ``trainer_client.determinism``.
        writer: this stage's writer name in the log store (default ``f"stage{stage}"``); unique
            per process on a store root.

    Where logs go
        store_root: the node's log-store root directory (hot tier: LMDB index + segments).
        cold_url: ``file:///dir`` or ``s3://bucket/prefix`` for the cold tier; None (default) =
            hot only (a dead node's logs are then only reachable through that node's disk).
        cold_options: fsspec/s3fs storage options for the cold tier (endpoint, keys...), also
            used for checkpoints written under an ``s3://`` checkpoint_url. Default empty.
        checkpoint_url: directory (local path, ``file://`` or ``s3://``) for checkpoints; None
            (default) = ``{cold_url}/{run_id}/checkpoint-files`` when there is a cold tier, else
            ``{store_root}/{run_id}/checkpoint-files`` (then durable only if that is a shared
            filesystem).
        segment_iters: iterations per hot-tier segment (default 4); GC and upload granularity.
        durability: "process" (default: survives the death of the process) or "fsync".
        max_backlog_bytes: sealed-but-not-uploaded bytes beyond which writes fail and become
            gaps (the store raises StoreFullError); None (default) = bounded by the disk only.

    What is logged
        logging_groups: sizes of consecutive logging groups summing to num_stages; only sends
            that cross a group boundary are logged (with their digests). None (default) = every
            stage is its own group, i.e. every send is logged.
        log_data: log stage-0 inputs and last-stage targets (default True). Set False only when
            a deterministic, iteration-addressable data source is given to the client and to
            the replay.
        ship_data: after every iteration, seal this stage's input/target/meta segments so the
            uploader ships them to the cold tier at once (default True; no-op without cold tier).
        ship_wait: with ``ship_data`` on a stage that logs data only it has (the first stage's
            inputs and the last stage's targets with ``log_data``, any stage's keyword inputs of
            the step): how long ``commit(t)`` waits, before reporting the stage done, until t's are in
            the cold tier, so that a replacement of this stage can replay t when its machine (and
            disk) dies right after the commit (default 10 s). None: never wait (such a failure
            then needs a rollback). A wait that times out is a "ship_timeout" fault; after one,
            commits only check (no wait) until the cold tier has caught up, and report a
            "ship_lag" fault every ``ship_lag_report`` while it has not (default 60 s).
        enabled: start with logging on (default True). Seeding, META and the commit step happen
            either way; see ``SwiftlogClient.set_logging``.

    Asynchronous writer
        max_queue_bytes: bound on bytes held by queued, not yet written records (default 256
            MiB; pinned host memory on GPU). A single record larger than the bound is admitted
            when the queue is empty. The received buffers held until hashed have a bound of their
            own of the same size (``trainer_client.writer``). On a GPU, hold at least 4-8 micro-batches of the stage's
            sends and receives (``docs/gpu.md``).
        overflow: what happens when the bound is hit: "wait" (default) or "gap".
        overflow_wait: the longest one "wait" at the bound blocks the training thread (default
            10 s). Then the record is dropped as a gap, an "overflow_timeout" fault says so, and
            records that do not fit are dropped without waiting until the writer moves again.
        codec: record codec, "auto" (default), "planes", "zstd" or "raw".
        encode_threads: background threads that encode records; 0 = encode on the writer thread.
            Encoding is extra CPU load on the node: size it to spare cores. None (default): chosen
            at the first record (``writer.auto_encode_threads``): 1 for a stage on CPU, whose own
            compute needs the cores; for a stage on a GPU the node's cores per GPU, at most 4
            (``docs/gpu.md``).
        write_batch_records: at most this many records per store transaction (default 64).
        write_batch_bytes: at most about this many encoded bytes per transaction (default 16 MiB).

    Metrics
        metrics_port: serve this client's counters (``stats()``) to Prometheus at
            ``http://{metrics_host}:{metrics_port}/metrics``, read at scrape time
            (``trainer_client.metrics``). None (default): off. 0: any free port
            (``SwiftlogClient.metrics_address`` says which). One port per rank, e.g. a base port
            plus the stage.
        metrics_host: the address the exporter listens on (default ``127.0.0.1``, loopback only;
            ``0.0.0.0`` lets a Prometheus server on another host scrape it).

    Commit and maintenance
        commit_timeout: how long ``commit`` waits for every stage (default 120 s); on timeout
            the iteration is aborted for everyone.
        commit_prefix: key prefix in the commit store (default ``f"swiftlog/{run_id}"``; under
            a torchrun restart, ``TORCHELASTIC_RESTART_COUNT`` > 0, ``f"swiftlog/{run_id}/restart{n}"``:
            the agent's store outlives the workers it restarts, and the first attempt's decisions
            must not answer the redone iterations).
        gc_after_checkpoint: run ``store.gc()`` in the background after each registered
            checkpoint, once the writer has drained the older records (default True).
        keep_checkpoints: keep only this stage's newest N checkpoints that this client wrote
            (its ``checkpoint_url``): once a newer one is registered, an older one's registration
            is withdrawn, then its file deleted (in the background; failures are "checkpoint_retire"
            faults). None (default) keeps every file; at least 2 (a rollback restarts from the
            newest checkpoint every stage has: one stage may not have finished its newest).
    """

    run_id: str
    stage: int
    num_stages: int
    store_root: str | os.PathLike[str]
    cold_url: str | None = None
    cold_options: dict[str, Any] = field(default_factory=dict)
    checkpoint_url: str | None = None
    seed: int = 0
    writer: str | None = None
    segment_iters: int = 4
    durability: str = "process"
    max_backlog_bytes: int | None = None
    logging_groups: Sequence[int] | None = None
    log_data: bool = True
    ship_data: bool = True
    ship_wait: timedelta | None = timedelta(seconds=10)
    ship_lag_report: timedelta = timedelta(seconds=60)
    enabled: bool = True
    max_queue_bytes: int = 256 * MiB
    overflow: str = "wait"
    overflow_wait: timedelta = timedelta(seconds=10)
    codec: str = "auto"
    encode_threads: int | None = None
    write_batch_records: int = 64
    write_batch_bytes: int = 16 * MiB
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    commit_timeout: timedelta = timedelta(seconds=120)
    commit_prefix: str | None = None
    gc_after_checkpoint: bool = True
    keep_checkpoints: int | None = None

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
        if self.writer is None:
            self.writer = f"stage{self.stage}"
        try:
            validate_name(self.writer, "writer name")
        except InvalidNameError as e:
            raise ConfigError(f"writer: {e}") from e
        if not isinstance(self.store_root, (str, os.PathLike)) or not str(self.store_root):
            raise ConfigError(f"store_root must be a directory path, got {self.store_root!r}")
        if self.keep_checkpoints is not None and (not _is_int(self.keep_checkpoints) or self.keep_checkpoints < 2):
            raise ConfigError(
                f"keep_checkpoints must be None or an int >= 2, got {self.keep_checkpoints!r}",
                hint="a rollback restarts from the newest checkpoint every stage has, and a stage may not have finished its newest",
            )
        if self.cold_url is not None and (not isinstance(self.cold_url, str) or not self.cold_url):
            raise ConfigError(
                f"cold_url must be None or a URL string, got {self.cold_url!r}",
                hint="e.g. file:///data/cold or s3://bucket/prefix",
            )
        if not isinstance(self.cold_options, dict):
            raise ConfigError(f"cold_options must be a dict, got {type(self.cold_options).__name__}")
        if self.logging_groups is not None:
            groups = list(self.logging_groups)
            if not groups or not all(_is_int(g) and g >= 1 for g in groups) or sum(groups) != self.num_stages:
                raise ConfigError(
                    f"logging_groups must be positive group sizes summing to num_stages={self.num_stages}, got {self.logging_groups!r}",
                    hint="e.g. [2, 2] for 4 stages, or None to log every boundary",
                )
            self.logging_groups = tuple(groups)
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if not isinstance(self.overflow_wait, timedelta) or self.overflow_wait <= timedelta(0):
            raise ConfigError(
                f"overflow_wait must be a positive timedelta, got {self.overflow_wait!r}",
                hint="e.g. timedelta(seconds=10); a hung store must not stop training for good",
            )
        if self.codec not in _CODECS:
            raise ConfigError(f"codec must be one of {_CODECS}, got {self.codec!r}")
        for name, lo in (
            ("max_queue_bytes", 1),
            ("write_batch_records", 1),
            ("write_batch_bytes", 1),
            ("segment_iters", 1),
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ConfigError(f"{name} must be an int >= {lo}, got {v!r}")
        if self.encode_threads is not None and (not _is_int(self.encode_threads) or self.encode_threads < 0):
            raise ConfigError(f"encode_threads must be None or an int >= 0, got {self.encode_threads!r}")
        if self.max_backlog_bytes is not None and (not _is_int(self.max_backlog_bytes) or self.max_backlog_bytes < 0):
            raise ConfigError(f"max_backlog_bytes must be None or an int >= 0, got {self.max_backlog_bytes!r}")
        if self.durability not in ("process", "fsync"):
            raise ConfigError(f"durability must be 'process' or 'fsync', got {self.durability!r}")
        if self.ship_wait is not None and (not isinstance(self.ship_wait, timedelta) or self.ship_wait < timedelta(0)):
            raise ConfigError(f"ship_wait must be None or a non-negative timedelta, got {self.ship_wait!r}")
        if not isinstance(self.ship_lag_report, timedelta) or self.ship_lag_report < timedelta(0):
            raise ConfigError(f"ship_lag_report must be a non-negative timedelta, got {self.ship_lag_report!r}")
        if not isinstance(self.commit_timeout, timedelta) or self.commit_timeout <= timedelta(0):
            raise ConfigError(f"commit_timeout must be a positive timedelta, got {self.commit_timeout!r}")
        if self.metrics_port is not None and (not _is_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535):
            raise ConfigError(
                f"metrics_port must be None or an int in 0..65535, got {self.metrics_port!r}",
                hint="None turns the exporter off; 0 takes any free port",
            )
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError(
                f"metrics_host must be a host name or address, got {self.metrics_host!r}", hint="e.g. 127.0.0.1"
            )
        if self.commit_prefix is None:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
            self.commit_prefix = f"swiftlog/{self.run_id}" + (f"/restart{restart}" if restart not in ("", "0") else "")

    # -- derived ---------------------------------------------------------------------------
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

    def checkpoint_options(self) -> dict[str, Any] | None:
        """fsspec storage options for the checkpoint location: ``cold_options`` for a remote URL
        (``s3://``...), None for a local path or ``file://``."""
        url = self.resolved_checkpoint_url()
        return dict(self.cold_options) if "://" in url and not url.startswith("file://") else None

    def resolved_checkpoint_url(self) -> str:
        """Where checkpoints go when ``checkpoint_url`` is None (see the field's doc)."""
        if self.checkpoint_url:
            return self.checkpoint_url.rstrip("/")
        if self.cold_url:
            base = self.cold_url.rstrip("/")
            if "://" not in base:
                base = "file://" + os.path.abspath(base)
            return f"{base}/{self.run_id}/checkpoint-files"
        return os.path.join(os.path.abspath(os.fspath(self.store_root)), self.run_id, "checkpoint-files")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
