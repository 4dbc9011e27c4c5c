"""SwiftlogClient: the one object a training script holds per pipeline stage.

It owns the stage's :class:`~logstore.LogStore` (writer = ``config.writer``), the asynchronous
writer, the capture state of the :class:`LoggingPipelineStage` it builds, the commit coordinator
(when given a decision store), and a maintenance thread that registers checkpoints and runs GC.

Per iteration the script calls ``step`` (or ``begin_iteration`` + ``schedule.step``), then
``commit`` before the optimizer step. Logging faults never raise: ``commit``, ``flush`` and
``close`` report them, ``stats()`` counts them, and with ``ClientConfig.metrics_port`` a
Prometheus endpoint serves the counts (``trainer_client.metrics``). What does raise: misuse (wrong iteration,
unsupported schedule, bad config), :class:`IterationAbortedError` from ``commit`` (the protocol
says: discard the iteration) and :class:`CheckpointError` when a checkpoint cannot be written.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from logstore import Channel, LogStore, StoreConfig
from logstore.errors import ConfigError, SwiftlogError
from trainer_client.checkpoint import checkpoint_uri, save_checkpoint, scheduler_next_rates
from trainer_client.commit import CommitCoordinator, CommitResult, SharedRegistrations
from trainer_client.config import ClientConfig
from trainer_client.determinism import SEED_SCHEME, derive_seed, environment_fingerprint, seed_micro_batch
from trainer_client.digest import grad_digest_changes, grad_digests, hex_digests
from trainer_client.errors import IterationAbortedError, UnsupportedScheduleError
from trainer_client.maintenance import CheckpointMaintenance
from trainer_client.meta import (
    META_VERSION,
    decode_meta,
    encode_meta,
    hparam_changes,
    importable_name,
    optimizer_hparams,
    script_name,
)
from trainer_client.metrics import MetricsExporter
from trainer_client.stage import LoggingPipelineStage, StageRecorder
from trainer_client.writer import AsyncLogWriter, Fault

__all__ = [
    "SwiftlogClient",
    "CommitReport",
    "FlushReport",
    "DataSource",
    "SUPPORTED_SCHEDULES",
    "META_VERSION",
    "encode_meta",
    "decode_meta",
]

logger = logging.getLogger(__name__)

#: A deterministic, iteration-addressable data source: ``source(iteration) -> (inputs, target)``
#: with ``inputs`` the whole batch of stage 0: a tensor, a tuple of tensors (positional inputs), a
#: dict of tensors (keyword inputs), or a tuple whose last item is such a dict (both; see
#: :func:`data_inputs`), and ``target`` the whole batch of targets of the last stage (or None).
#: Same iteration, same tensors, every time.
DataSource = Callable[[int], tuple[Any, Any]]


def data_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A :data:`DataSource` batch's inputs as (positional, keyword): a dict is keyword inputs, a
    tuple / list ending in a dict is positional inputs then keyword ones, anything else positional."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        if inputs and isinstance(inputs[-1], Mapping):
            return tuple(inputs[:-1]), dict(inputs[-1])
        return tuple(inputs), {}
    return (inputs,), {}


def on_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or a tuple/list/dict of tensors and other values, e.g. a DataSource batch)
    with its tensors on ``device``. Tensors already there are returned as they are (never copied)."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(on_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: on_device(v, device) for k, v in x.items()}
    return x


SUPPORTED_SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True, slots=True)
class CommitReport:
    """What ``commit`` did: the decision (None when no decision store is configured) and the
    logging faults that happened since the previous report (never raised)."""

    iteration: int
    decision: CommitResult | None
    logging_faults: list[Fault] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FlushReport:
    """Outcome of ``flush``/``close``.

    ``logging_faults`` are the faults since the previous report (commit/flush/close);
    ``faults_total`` counts every fault of this client's life. ``ok`` iff everything queued was
    written, (with a cold tier) uploaded, and no logging fault ever happened, i.e. the logs of
    this stage are complete.
    """

    drained: bool
    uploaded_segments: int
    error: str | None
    logging_faults: list[Fault] = field(default_factory=list)
    faults_total: int = 0

    @property
    def ok(self) -> bool:
        return self.drained and self.error is None and not self.logging_faults and self.faults_total == 0


def _seal_then_set(store: LogStore, channels: list[Channel], done: threading.Event) -> None:
    """Writer marker: seal ``channels`` (the uploader ships them first), then set ``done``."""
    try:
        store.seal(channels)
    finally:
        done.set()


class SwiftlogClient:
    """Asynchronous SWIFT logging for one pipeline stage. See the package docstring for usage.

    Args:
        config: the stage's :class:`ClientConfig`.
        commit_store: a ``torch.distributed.Store`` hosted outside the training ranks (e.g. a
            TCPStore client); enables the commit decision in :meth:`commit`. None: ``commit`` only
            finalizes the iteration's logs.
        data_source: a deterministic :data:`DataSource`; ``step`` then fetches each iteration's
            batch itself, and with ``config.log_data=False`` inputs/targets are not logged (a
            replay must be given the same source).
    """

    def __init__(
        self, config: ClientConfig, *, commit_store: dist.Store | None = None, data_source: DataSource | None = None
    ) -> None:
        self.metrics: MetricsExporter | None = None  # bound first: a port in use fails before anything is opened
        if config.metrics_port is not None:
            labels = {"run": config.run_id, "stage": str(config.stage), "writer": str(config.writer)}
            self.metrics = MetricsExporter(
                functools.partial(_stats_of, weakref.ref(self)),
                labels,
                host=config.metrics_host,
                port=config.metrics_port,
            )
        try:
            self._open(config, commit_store, data_source)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise

    def _open(self, config: ClientConfig, commit_store: dist.Store | None, data_source: DataSource | None) -> None:
        self.config = config
        self.data_source = data_source
        if not config.log_data and data_source is None:
            logger.warning(
                "stage %d: log_data=False without a data source: a replay of stage 0 / the last stage "
                "needs the same deterministic data source",
                config.stage,
            )
        self.store = LogStore(
            StoreConfig(
                root=config.store_root,
                run=config.run_id,
                writer=config.writer,
                cold_url=config.cold_url,
                cold_options=dict(config.cold_options),
                durability=config.durability,
                segment_iters=config.segment_iters,
                max_backlog_bytes=config.max_backlog_bytes,
                codec=config.codec,
            )
        )
        name = f"swiftlog-{config.writer}"
        self.writer = AsyncLogWriter(
            self.store,
            codec=config.codec,
            max_queue_bytes=config.max_queue_bytes,
            overflow=config.overflow,
            overflow_wait_s=config.overflow_wait.total_seconds(),
            encode_threads=config.encode_threads,
            batch_records=config.write_batch_records,
            batch_bytes=config.write_batch_bytes,
            name=name,
        )
        self.recorder = StageRecorder(config, self.writer)
        self.coordinator: CommitCoordinator | None = None
        if commit_store is not None:
            self.coordinator = CommitCoordinator(
                commit_store,
                stage=config.stage,
                num_stages=config.num_stages,
                prefix=config.commit_prefix or f"swiftlog/{config.run_id}",
                timeout=config.commit_timeout,
            )
        ck_base = config.resolved_checkpoint_url()
        shared = None
        if commit_store is not None:
            prefix = config.commit_prefix or f"swiftlog/{config.run_id}"
            shared = SharedRegistrations(commit_store, prefix=prefix, stage=config.stage, num_stages=config.num_stages)
        elif config.cold_url is None and config.num_stages > 1:
            logger.warning(
                "stage %d: no cold tier and no commit store: this stage's checkpoint registrations reach this "
                "node's store root only, so nodes holding what it received never free it",
                config.stage,
            )
        self._maint = CheckpointMaintenance(
            self.store,
            self.writer,
            name,
            keep=config.keep_checkpoints,
            own_uri=lambda st, it: checkpoint_uri(ck_base, st, it),
            storage_options=config.checkpoint_options(),
            shared=shared,
        )
        self._stage: LoggingPipelineStage | None = None
        self._schedule: PipelineScheduleSingle | None = None
        self._schedule_info: dict[str, Any] = {}
        self._iteration: int | None = None
        self._step_t0: float | None = None
        self._grad_clips: list[dict[str, Any]] = []  # the current iteration's clip_grad_norm_ calls (META "grad_clip")
        self._grad_reduces: list[
            dict[str, Any]
        ] = []  # its all_reduce_grads_ calls (META "grad_reduce"; records reduced_{stage})
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = (
            None  # the tracked one (META "lrs", "hparams"; track_optimizer)
        )
        self._step_hook: Any = None  # its step pre-hook's handle
        self._step_expect: tuple[int, dict[str, Any]] | None = (
            None  # (iteration, META) committed, its optimizer step not yet seen
        )
        self._grad_versions: list[int] | None = (
            None  # the stage's gradients' version counters after the schedule's step
        )
        self._lr_scheduler: weakref.ref[Any] | None = None  # the tracked one (META "sched_epoch"; track_lr_scheduler)
        self._committed: tuple[int, dict[str, Any]] | None = (
            None  # the last committed iteration and its META (amendments merged)
        )
        self._amendment: dict[str, Any] | None = None  # what has been amended in that META (its micro-batch 1 record)
        self._apply_checked: int | None = None  # the last iteration whose optimizer / scheduler steps were counted
        self._apply_irregular: int | None = (
            None  # the first iteration not followed by exactly one of each (META "apply_irregular")
        )
        self._warned_carried = False  # grads_not_zeroed reported (once)
        self._stepped: int | None = (
            None  # the iteration whose schedule step finished and is not yet committed or aborted
        )
        self._early_step: int | None = None  # an iteration whose optimizer step came before its commit
        self._stepped_grads: list[tuple[Any, int] | None] | None = (
            None  # each gradient at the last optimizer step (weakref, version)
        )
        self._carried: list[
            str
        ] = []  # parameters whose gradients the current iteration's schedule step added to, not zeroed
        self._declared_inputs: list[list[Any]] | None = (
            None  # [dtype, shape] of each part input_args declare (None: not given)
        )
        self._decl_checked = False  # input_args compared with what the stage before declares it sends
        self._commits = 0
        self._commit_wait_s = 0.0
        self._aborts = 0
        self._closed = False
        # the inputs / targets this stage logs: a replay of this stage needs them, and only this stage has them
        self._own_data = (
            [
                c
                for c in (
                    Channel.input(config.stage) if config.is_first else None,
                    Channel.target(config.stage) if config.is_last else None,
                )
                if c is not None
            ]
            if config.log_data
            else []
        )
        self._ship_lagging = False  # a ship wait timed out: commits only check until the cold tier catches up
        self._ship_lag_since = 0  # the iteration whose ship wait timed out
        self._ship_lag_noted = 0.0  # time.monotonic() of the last "ship_lag" fault
        self._own_sealed: threading.Event | None = (
            None  # set once this iteration's inputs / targets are written and sealed
        )
        self._ship_wait_s = 0.0
        self._ready = True  # built: a metrics scrape may read the stats

    # ================================================================ building the pipeline
    def pipeline_stage(
        self,
        module: torch.nn.Module,
        device: torch.device | str,
        *,
        input_args: Any = None,
        output_args: Any = None,
        group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> LoggingPipelineStage:
        """Wrap ``module`` in a :class:`LoggingPipelineStage` for this stage (same arguments as
        ``PipelineStage``; stage index and count come from the config). Call it again after the
        process group is re-formed; the newest stage is the one logged.

        Raises ConfigError when the example tensors cannot carry gradients where torch's schedules
        need them (they fail later, in backward, with an error that does not say why): floating
        ``output_args`` of a stage before the last, or ``input_args`` of a stage after the first,
        none of which requires grad."""
        c = self.config
        for what, args, needed in (
            ("output_args", output_args, not c.is_last),
            ("input_args", input_args, not c.is_first),
        ):
            floats = [t for t in _tensors(args) if t.is_floating_point()]
            if needed and floats and not any(t.requires_grad for t in floats):
                role = (
                    "receives the gradients of what it sends"
                    if what == "output_args"
                    else "sends back the gradients of what it receives"
                )
                raise ConfigError(
                    f"stage {c.stage}: no floating tensor of {what} requires grad, but the stage {role}",
                    hint=f"create the example {what} with requires_grad=True (torch builds gradient buffers only for those)",
                )
        self._publish_declaration(input_args, output_args)
        self._stage = LoggingPipelineStage(
            module,
            self.config.stage,
            self.config.num_stages,
            torch.device(device),
            recorder=self.recorder,
            input_args=input_args,
            output_args=output_args,
            group=group,
            **kwargs,
        )
        return self._stage

    def schedule(
        self,
        stage: LoggingPipelineStage,
        schedule: str | type[PipelineScheduleSingle] = "1f1b",
        *,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        scale_grads: bool = True,
        **kwargs: Any,
    ) -> PipelineScheduleSingle:
        """Build a GPipe or 1F1B schedule over ``stage`` whose loss function also logs targets.

        ``loss_fn`` must be given on every stage (torch runs no backward on a rank whose schedule
        has no loss_fn). META names it when it can be imported by name (a module-level function;
        in a script run by path, one whose top level only defines things), so a replay of the last
        stage uses it without being told; any other callable (a lambda, an ``nn.CrossEntropyLoss()``
        instance) must be named to the replay (``--loss module:attr`` or ``--loss path/to/file.py:attr``).
        Raises UnsupportedScheduleError for any other schedule: their split
        backward (F/I/W) or multi-stage execution is not captured exactly.
        """
        if not isinstance(stage, LoggingPipelineStage) or stage.recorder is not self.recorder:
            raise UnsupportedScheduleError(
                "schedule() needs the LoggingPipelineStage built by this client's pipeline_stage()"
            )
        cls: Any = SUPPORTED_SCHEDULES.get(schedule.lower()) if isinstance(schedule, str) else schedule
        if cls is None or not isinstance(cls, type) or not issubclass(cls, (ScheduleGPipe, Schedule1F1B)):
            raise UnsupportedScheduleError(
                f"schedule {schedule!r} is not supported",
                hint=f"use one of {sorted(SUPPORTED_SCHEDULES)} (ScheduleGPipe, Schedule1F1B)",
            )
        if loss_fn is None:
            raise UnsupportedScheduleError(
                "loss_fn is required on every stage",
                hint="torch.distributed.pipelining runs no backward on a stage whose schedule has no loss_fn",
            )
        recorder = self.recorder

        def logged_loss(output: Any, target: Any, **kw: Any) -> torch.Tensor:
            recorder.on_loss(target)
            return loss_fn(output, target, **kw)

        self._schedule = cls(
            stage, n_microbatches=n_microbatches, loss_fn=logged_loss, scale_grads=scale_grads, **kwargs
        )
        # all of an iteration's inputs / targets queued (its last forward / loss): seal them at once
        self.recorder.n_microbatches = n_microbatches
        self.recorder.on_data_complete = self._seal_own_data
        loss_name = importable_name(loss_fn)
        self._schedule_info = {
            "schedule": cls.__name__,
            "n_microbatches": n_microbatches,
            "scale_grads": scale_grads,
            "grad_scale_factor": n_microbatches if scale_grads else 1,
            "loss": loss_name,  # a replay of the last stage imports it (unless given another)
            "loss_repr": repr(loss_fn)[:200],
            "loss_script": None if loss_name else script_name(loss_fn),  # not loaded by itself: the error names it
        }
        return self._schedule

    @property
    def stage_module(self) -> torch.nn.Module | None:
        """The module of the stage built by :meth:`pipeline_stage` (None before, or after :meth:`release_pipeline`)."""
        return None if self._stage is None else self._stage.submod

    def release_pipeline(self) -> None:
        """Forget the stage and schedule (after a failure), so that the process group they hold
        can be destructed and its connections closed; build new ones before the next ``step``."""
        self._stage = None
        self._schedule = None
        self._stepped = None

    # ================================================================ per iteration
    def begin_iteration(self, iteration: int) -> None:
        """Start ``iteration`` (0-based, the number of iterations applied so far)."""
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
        self._iteration = iteration
        self._step_t0 = time.perf_counter()
        self._grad_clips = []
        self._grad_reduces = []
        self._carried = []
        self._own_sealed = None
        self.recorder.begin(iteration)

    def step(self, iteration: int, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """``begin_iteration(iteration)`` then ``schedule.step`` with what this stage needs.

        The same call works on every stage: inputs are passed only on the first stage and
        target/losses only on the last. With a data source and no inputs/target given, the
        batch of ``iteration`` is fetched from it. Returns what ``schedule.step`` returns.
        """
        if self._schedule is None:
            raise RuntimeError(
                "call client.schedule(...) before client.step(...) (under a ResilientLoop: the loop calls your rebuild(), which "
                "builds them, in loop.join() or in loop.run() without joined=True)"
            )
        if self._stepped is not None and self._stepped == iteration:
            raise RuntimeError(
                f"client.step({iteration}) again before client.commit({iteration}): a replay repeats exactly one schedule step per "
                "iteration, so gradients accumulated over several steps cannot be replayed; give the schedule more micro-batches "
                "(n_microbatches) instead, or commit each step as its own iteration with its own optimizer step"
            )
        self._check_apply(iteration)
        if not self._decl_checked:
            self._check_declaration()
        carried = self._grads_carried()
        self.begin_iteration(iteration)
        self._carried = carried
        c = self.config
        if self.data_source is not None and not args and target is None and (c.is_first or c.is_last):
            inputs, target = self.data_source(iteration)
            src_args, src_kwargs = data_inputs(inputs)
            assert self._stage is not None
            dev = self._stage.device  # where the stage computes
            args, target = on_device(src_args, dev), on_device(target, dev)
            if c.is_first:  # the source's keyword inputs are stage 0's; the caller's own go to every stage
                kwargs = {**on_device(src_kwargs, dev), **kwargs}
        if not c.is_first:
            args = ()
        if not c.is_last:
            target, losses = None, None
        out = self._schedule.step(*args, target=target, losses=losses, **kwargs)
        self._stepped = iteration
        # what the coming optimizer step should find (see _check_step); only with a tracked optimizer, whose steps are checked
        self._grad_versions = self._grad_snapshot() if self._optimizer is not None else None
        return out

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        module: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that a replay can repeat exactly; returns the total norm.

        Call it after the schedule's step and before ``commit(iteration)``. ``group``: the norm is
        taken over the gradients of every rank of this process group (e.g. all the pipeline's
        stages: the global norm, each rank's ``norm ** norm_type`` summed, or the max for inf);
        None: over ``parameters`` only. ``parameters`` must belong to the stage's module (the one
        given to :meth:`pipeline_stage`; ``module`` only without one, a hand-written runtime's). The norm it used goes into
        the iteration's META record, so the replay clips with the same norm, bit for bit, without
        the other stages' gradients. Several calls in one iteration are replayed in order.
        Raises ValueError for a parameter not in the module, RuntimeError when called outside an
        iteration or after its commit. Never changes gradients other than by the torch clip.
        """
        if self._iteration is None or self._step_t0 is None:
            raise RuntimeError(
                "clip_grad_norm_ belongs between client.step(it) and client.commit(it); no iteration is in progress"
            )
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        index = self._param_positions("clip_grad_norm_", params, module)
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if (
            group is not None
        ):  # in float64: every rank's part has one dtype whatever its parameters' (a float64 stage among float32 ones)
            inf = norm_type == float("inf")
            part = (total if inf else total.pow(norm_type)).to(torch.float64)
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
            total = (part if inf else part.pow(1.0 / norm_type)).to(total.dtype)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        positions = [index[id(p)] for p in params]
        self._grad_clips.append(
            {
                "seq": self._grad_op_seq(),
                "max_norm": float(max_norm),
                "total_norm": float(total),  # a float32 / bf16 value is exact as a Python float (and in JSON)
                "dtype": str(total.dtype).removeprefix("torch."),
                "foreach": foreach,
                "params": None if positions == list(range(len(index))) else positions,
            }
        )
        if self._grad_versions is not None:  # a change the replay repeats
            self._grad_versions = self._grad_snapshot()
        return total

    def all_reduce_grads_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        average: bool = False,
        module: torch.nn.Module | None = None,
    ) -> None:
        """``dist.all_reduce`` (sum) of the parameters' gradients over ``group``, in place, which a
        replay repeats exactly: the reduced gradients are logged (channel ``reduced_{stage}``, one
        record per call, a part per parameter, shipped off the node before the commit completes,
        like the first stage's inputs), and the replay puts them in place of its own at the same
        point. For weights tied across stages (an embedding shared by the first and the last
        stage) or any other gradient sum over ranks the replay could not recompute alone.

        Call it between the schedule's step and ``commit(iteration)``, on every rank of ``group``
        (default: the world) in the same order with the same parameters' shapes (a collective);
        ``client.clip_grad_norm_`` calls before and after it are replayed in their order.
        ``average``: divide the sum by the group's size. A parameter without a gradient takes part
        with zeros (and has them as its gradient afterwards). ``parameters`` must belong to the
        stage's module (the one given to :meth:`pipeline_stage`; ``module`` only without one); on
        CPU, META also records the digests of the gradients before the reduction, so the replay
        checks its own. Raises ValueError for a parameter not in the module or a rank outside
        ``group``, RuntimeError outside an iteration or after its commit. Never changes a gradient other than by the reduction.
        """
        if self._iteration is None or self._step_t0 is None:
            raise RuntimeError(
                "all_reduce_grads_ belongs between client.step(it) and client.commit(it); no iteration is in progress"
            )
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        index = self._param_positions("all_reduce_grads_", params, module)
        if not params:
            raise ValueError("all_reduce_grads_: no parameters given")
        if dist.get_rank(group) < 0:
            raise ValueError(
                f"all_reduce_grads_: this rank ({dist.get_rank()}) is not a member of the group given; call it on the group's ranks only"
            )
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        pre = hex_digests(grads)
        reduced = _all_reduce_flat(grads, group, average)
        for g, r in zip(grads, reduced, strict=True):
            g.copy_(r)
        call = len(self._grad_reduces)
        self._grad_reduces.append(
            {
                "seq": self._grad_op_seq(),
                "params": [index[id(p)] for p in params],
                "average": bool(average),
                "world": dist.get_world_size(group),
                "pre": pre,
            }
        )
        if self.recorder.enabled:
            self.writer.submit(
                Channel.reduced(self.config.stage), self._iteration, call, reduced
            )  # `reduced` is ours alone: no copy
        if self._grad_versions is not None:  # a change the replay repeats
            self._grad_versions = self._grad_snapshot()

    def _grad_op_seq(self) -> int:
        """The place of the next clip_grad_norm_ / all_reduce_grads_ call among the iteration's ones
        (META ``seq``: the replay repeats them in this order)."""
        return len(self._grad_clips) + len(self._grad_reduces)

    def _param_positions(
        self, what: str, params: Sequence[torch.Tensor], module: torch.nn.Module | None
    ) -> dict[int, int]:
        """id -> position in the stage module's ``parameters()`` (the order a replay's stage has;
        ``module`` only when the client has no stage module, a hand-written runtime's), of every
        parameter of the stage; raises ValueError naming ``params`` not among them."""
        mod = self.stage_module if self.stage_module is not None else module
        if mod is None:
            raise ValueError(
                f"{what} needs the stage's module: pass module=, or build the stage with client.pipeline_stage()"
            )
        index = {id(p): i for i, p in enumerate(mod.parameters())}
        missing = [i for i, p in enumerate(params) if id(p) not in index]
        if missing:
            raise ValueError(
                f"{what}: parameters {missing} (positions in the list given) are not parameters of the stage's module"
            )
        return index

    def commit(self, iteration: int) -> CommitReport:
        """Finish ``iteration``'s logs and, with a decision store, agree with every stage to apply it.

        Call after the schedule's step and before ``optimizer.step()``. Queues the iteration's
        META record, asks the store to ship inputs/targets/META off the node (and, with a decision
        store, puts the META there too, in the request that reports this stage done), and reports the
        logging faults since the last report (logged as a warning, never raised). Raises
        IterationAbortedError when the decision is "abort" (zero the gradients, skip the
        optimizer step, recover) and ValueError if ``iteration`` is not the current one.
        """
        if self._iteration is None or iteration != self._iteration:
            raise ValueError(
                f"commit({iteration}) but the current iteration is {self._iteration}; call begin_iteration/step first"
            )
        self._stepped = None
        rec = self.recorder
        n_fwd = sum(1 for k, _ in rec.order if k == "F")
        n_bwd = sum(1 for k, _ in rec.order if k == "B")
        n_mb = self._schedule_info.get("n_microbatches")
        if n_mb is not None and (n_fwd != n_mb or n_bwd != n_mb):
            self.writer.note_fault(
                "incomplete_iteration",
                f"iteration {iteration} ran {n_fwd} forwards and {n_bwd} backwards of {n_mb} micro-batches",
                iteration=iteration,
            )
        meta = None
        doc: dict[str, Any] | None = None
        sealed: threading.Event | None = None
        own = self._own_channels()
        self._step_expect = None
        if rec.enabled:
            doc = self._meta(iteration)
            meta = encode_meta(doc)
            self.writer.submit(Channel.meta(self.config.stage), iteration, 0, [meta])
            if self.config.ship_data and self.store.cold is not None:
                sealed = threading.Event()
                self.writer.mark(
                    functools.partial(_seal_then_set, self.store, [*own, Channel.meta(self.config.stage)], sealed)
                )
            self.writer.kick()  # write the iteration's records now, overlapping the optimizer step
        if sealed is not None and own and self.config.ship_wait is not None:
            # the early seal covers the iteration's data unless more was logged after it (a schedule that ran more micro-batches)
            early = self._own_sealed if rec.data_count == rec.data_sealed_at and not self._grad_reduces else None
            self._wait_shipped(iteration, own, early or sealed, self.config.ship_wait.total_seconds())
        self._step_t0 = None  # META is written: a clip_grad_norm_ now could not reach it (it raises)
        faults = self.writer.take_faults()
        if faults:
            logger.warning(
                "stage %d iteration %d: %d logging fault(s), first: %s: %s",
                self.config.stage,
                iteration,
                len(faults),
                faults[0].kind,
                faults[0].message,
            )
        decision = None
        if self.coordinator is not None:
            try:
                # META goes to the decision store too: it outlives this machine, unlike a log not yet shipped
                decision = self.coordinator.commit(iteration, meta=None if meta is None else meta.numpy().tobytes())
            except IterationAbortedError:
                self._aborts += 1
                raise
            self._commits += 1
            self._commit_wait_s += decision.wait_s
        self._iteration = iteration + 1
        if doc is not None:
            self._committed, self._amendment = (iteration, doc), None
            if doc["lrs"] is not None:  # the coming optimizer step is checked against it
                self._step_expect = (iteration, doc)
        return CommitReport(iteration, decision, faults)

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Record ``optimizer``'s learning rates and other hyperparameters in every META (what the
        coming step uses) and check its steps: a step that runs with other values than the
        iteration's META says (set between :meth:`commit` and ``optimizer.step()``), or on
        gradients changed since the schedule's step other than by :meth:`clip_grad_norm_`, amends
        the META (a replay then stops at that step, naming the change, instead of taking it for
        another) and is reported as a ``step_after_commit`` fault. :meth:`checkpoint` and
        ``ResilientLoop`` call it; one optimizer per client (the last one given). Never changes
        what the step does."""
        if self._optimizer is not None and self._optimizer() is optimizer:
            return
        if self._step_hook is not None:
            self._step_hook.remove()
        self._optimizer = weakref.ref(optimizer)
        me = weakref.ref(self)

        def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            client = me()
            if client is not None:
                client._check_step(opt, kwargs)

        self._step_hook = optimizer.register_step_pre_hook(pre_step)

    def _check_step(self, opt: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
        """The optimizer step after :meth:`commit`: amend the iteration's META if the step uses
        other learning rates / hyperparameters than it says, or gradients changed since the
        schedule's step (version counters; a GradScaler's step). Never raises."""
        expect, self._step_expect = self._step_expect, None
        versions, self._grad_versions = self._grad_versions, None
        if (
            self._optimizer is not None and self._optimizer() is opt and self.stage_module is not None
        ):  # seen again at the next step()
            self._stepped_grads = [
                None if p.grad is None else (weakref.ref(p.grad), p.grad._version)
                for p in self.stage_module.parameters()
            ]
        if (
            expect is None and self._stepped is not None
        ):  # stepped before its commit (not the documented order): counted all the same
            self._early_step = self._stepped
        if expect is None or self._optimizer is None or self._optimizer() is not opt:
            return
        it, doc = expect
        try:
            lrs, hparams = self._learning_rates(), optimizer_hparams(opt)
            grads = self._grads_changed(versions)
            scaled = _stepped_by_grad_scaler(opt, kwargs)
            how = "a GradScaler unscaled them" if scaled else "torch's clip_grad_norm_, a manual scaling"
            if scaled and not grads:  # its unscale kernel leaves the version counters alone
                grads = [
                    n
                    for n, p in (self.stage_module.named_parameters() if self.stage_module is not None else [])
                    if p.grad is not None
                ]
            if (
                not grads and doc.get("grad_digests") is not None and self.stage_module is not None
            ):  # what leaves the counters alone
                now = grad_digests(self.stage_module)
                if now is not None:
                    grads = grad_digest_changes(
                        [n for n, _ in self.stage_module.named_parameters()], doc["grad_digests"], now
                    )
                    how = "without touching their version counters: a collective such as dist.all_reduce, a write through .data"
            if lrs == doc["lrs"] and hparams == doc["hparams"] and not grads:
                return
            changed = hparam_changes(doc["lrs"], doc["hparams"], lrs, hparams)
            if grads:
                changed.append(
                    f"the gradients of {len(grads)} parameter(s) ({', '.join(grads[:3])}{', ...' if len(grads) > 3 else ''}), changed after "
                    f"the schedule's backward other than by client.clip_grad_norm_ or client.all_reduce_grads_ ({how})"
                )
            changed = changed or ["the optimizer's hyperparameters"]
            self._amend(
                it, doc, {"lrs": lrs, "hparams": hparams, "changed_after_commit": changed, "grads_changed": grads}
            )
            self.writer.note_fault(
                "step_after_commit",
                f"iteration {it}: the optimizer step is not what its META says: {'; '.join(changed)}; "
                "a replay of this iteration stops there (recovery falls back to the checkpoint): change hyperparameters "
                "before client.commit or through the lr scheduler, and gradients only through client.clip_grad_norm_ and client.all_reduce_grads_",
                iteration=it,
            )
        except Exception as e:
            self.writer.note_fault("hook", f"optimizer step check: {type(e).__name__}: {e}", iteration=it)

    def _publish_declaration(self, input_args: Any, output_args: Any) -> None:
        """Put what this stage declares it receives and sends (dtype and shape of each part) into the
        commit store, where the next stage compares it with its own (:meth:`_check_declaration`)."""
        self._declared_inputs, self._decl_checked = _part_specs(input_args), self.config.is_first
        if self.coordinator is None:
            return
        try:
            self.coordinator.store.set(
                _declaration_key(self.coordinator.prefix, self.config.stage),
                json.dumps({"inputs": self._declared_inputs, "outputs": _part_specs(output_args)}),
            )
        except Exception as e:  # the store is the commit's: if it is gone, the commit says so
            logger.debug("stage %d: declaration not published: %s", self.config.stage, e)

    def _check_declaration(self) -> None:
        """Before the first step: compare this stage's ``input_args`` with the ``output_args`` of the
        stage before it (from the commit store, waiting up to 30 s for it to be built). torch receives
        into buffers of the receiver's declared dtype and shape without conversion: a mismatch
        delivers another tensor than was sent (or gloo aborts the receiver). Raises ConfigError
        naming both declarations; skipped without a commit store or a declaration to compare."""
        self._decl_checked = True
        if self.coordinator is None or self._declared_inputs is None:
            return
        key = _declaration_key(self.coordinator.prefix, self.config.stage - 1)
        try:
            self.coordinator.store.wait([key], datetime.timedelta(seconds=30))
            sent = json.loads(self.coordinator.store.get(key))["outputs"]
        except Exception as e:  # not published (another client version, a store hiccup): nothing to compare
            logger.info(
                "stage %d: the declaration of stage %d is not in the commit store (%s); not compared",
                self.config.stage,
                self.config.stage - 1,
                e,
            )
            return
        if sent is not None and sent != self._declared_inputs:
            k = self.config.stage
            raise ConfigError(
                f"stage {k} declares that it receives {_fmt_parts(self._declared_inputs)} (input_args), but stage {k - 1} "
                f"declares that it sends {_fmt_parts(sent)} (output_args): torch receives into the declared buffers without conversion, so "
                "what arrives would not be what was sent (or gloo aborts the receiver)",
                hint="declare input_args exactly as the previous stage's output_args (dtype, shape, one tensor per part, in order)",
            )

    def track_lr_scheduler(self, lr_scheduler: Any) -> None:
        """Count ``lr_scheduler``'s steps (its ``last_epoch``): META records it at every commit
        (``sched_epoch``), and when the loop does not step it exactly once between two iterations
        (a scheduler stepped per epoch), the next :meth:`step` amends the previous iteration's META
        with the number of steps made, which a replay then repeats. :meth:`checkpoint` calls it
        (and ``ResilientLoop`` when given one); one scheduler per client (the last one given). A
        composite without a ``last_epoch`` of its own (``ChainedScheduler``) is counted by its first
        part's. Never changes the scheduler (:meth:`_sched_next` steps it and puts it back)."""
        if lr_scheduler is not None and _last_epoch(lr_scheduler) is not None:
            self._lr_scheduler = weakref.ref(lr_scheduler)

    def _sched_next(self) -> list[float] | None:
        """The learning rates the tracked scheduler's next step will set (:func:`scheduler_next_rates`);
        None without one."""
        sch = self._lr_scheduler() if self._lr_scheduler is not None else None
        return None if sch is None else scheduler_next_rates(sch)

    def _sched_epoch(self) -> int | None:
        """The tracked lr scheduler's ``last_epoch`` now; None without one."""
        sch = self._lr_scheduler() if self._lr_scheduler is not None else None
        return None if sch is None else _last_epoch(sch)

    def _check_apply(self, iteration: int) -> None:
        """Before the schedule step of ``iteration``: count the optimizer and lr-scheduler steps
        made since the commit of ``iteration - 1`` (a replay makes one of each after every
        iteration). From the first iteration with another count on, every iteration's META is
        amended with its counts (``apply``): a replay repeats the scheduler's, and stops at an
        iteration without an optimizer step (gradients accumulated over iterations), which is also
        reported as a ``no_optimizer_step`` fault. Never raises."""
        last = self._committed
        if last is None or last[0] != iteration - 1 or self._apply_checked == iteration - 1:
            return
        prev, doc = last
        self._apply_checked = prev
        expect, self._step_expect = self._step_expect, None  # a step still expected for `prev` did not come
        try:
            missed = expect is not None and expect[0] == prev and self._early_step != prev
            opt_steps = None if doc.get("lrs") is None else (0 if missed else 1)
            now, then = self._sched_epoch(), doc.get("sched_epoch")
            sched_steps = None if now is None or then is None else now - then
            irregular = opt_steps == 0 or (sched_steps is not None and sched_steps != 1)
            if irregular and self._apply_irregular is None:
                self._apply_irregular = prev
                logger.info(
                    "stage %d: iteration %d was followed by %s optimizer step(s) and %s lr-scheduler step(s); META records "
                    "them from now on",
                    self.config.stage,
                    prev,
                    opt_steps,
                    sched_steps,
                )
            if self._apply_irregular is None:
                return
            self._amend(prev, doc, {"apply": {"optimizer_steps": opt_steps, "scheduler_steps": sched_steps}})
            if opt_steps == 0:
                self.writer.note_fault(
                    "no_optimizer_step",
                    f"iteration {prev}: no optimizer step between client.commit({prev}) and "
                    f"client.step({iteration}) (gradients accumulated over iterations?): a replay makes one after every "
                    "iteration, so a replay of this iteration stops there (recovery falls back to the checkpoint)",
                    iteration=prev,
                )
        except Exception as e:
            self.writer.note_fault("hook", f"optimizer / scheduler step count: {type(e).__name__}: {e}", iteration=prev)

    def _amend(self, iteration: int, doc: dict[str, Any], fields: dict[str, Any]) -> None:
        """Amend committed ``iteration``'s META (``doc``) with ``fields``: a second record (micro-batch
        1; fields amended before are kept) shipped like the META, and the decision store's copy
        replaced with the document so amended. Raises what the store client raises."""
        latest = self._committed is not None and self._committed[0] == iteration
        amendment = {**((latest and self._amendment) or {}), **fields, "iteration": iteration}
        if latest:
            self._amendment = amendment
        stage = self.config.stage
        self.writer.submit(Channel.meta(stage), iteration, 1, [encode_meta(amendment)])
        if self.config.ship_data and self.store.cold is not None:  # off the node soon, like the META itself
            self.writer.mark(functools.partial(_seal_then_set, self.store, [Channel.meta(stage)], threading.Event()))
        self.writer.kick()
        if self.coordinator is not None:  # the copy a replacement reads says what the steps did
            self.coordinator.amend_meta(iteration, encode_meta({**doc, **amendment}).numpy().tobytes())

    def _seal_own_data(self) -> None:
        """The recorder queued the last input / target of the iteration: have the writer seal them
        as soon as they are written (the uploader ships sealed data first), so that the commit's
        wait for them (:meth:`_wait_shipped`) overlaps the rest of the iteration."""
        if self.config.ship_data and self.store.cold is not None and self._own_sealed is None:
            self._own_sealed = threading.Event()
            self.writer.mark(functools.partial(_seal_then_set, self.store, self._own_channels(), self._own_sealed))
            self.writer.kick()

    def _own_channels(self) -> list[Channel]:
        """What this stage logged this iteration that no other stage has and a replay of it needs:
        stage 0's inputs, the last stage's targets, another stage's keyword inputs of the step."""
        own = list(self._own_data)
        if not self.config.is_first and self.recorder.input_kwargs:
            own.append(Channel.input(self.config.stage))
        if self._grad_reduces:
            own.append(Channel.reduced(self.config.stage))
        return own

    def _wait_shipped(self, iteration: int, own: list[Channel], sealed: threading.Event, timeout: float) -> None:
        """Before this stage reports ``iteration`` done: wait until its data of it (``own``) is
        in the cold tier (the writer writes and seals them, the uploader ships them first), so a
        replacement can replay the iteration. Lagging (after a timeout): check only, no wait."""
        t0 = time.perf_counter()
        try:
            if self._ship_lagging:  # caught up when every earlier iteration's data is there (no wait)
                if not self.store.wait_shipped(own, iteration - 1, 0.0):
                    now = time.monotonic()
                    if (
                        now - self._ship_lag_noted >= self.config.ship_lag_report.total_seconds()
                    ):  # still behind: say so again, now and then
                        self._ship_lag_noted = now
                        self.writer.note_fault(
                            "ship_lag",
                            f"iteration {iteration}: this stage's {'/'.join(c.name for c in own)} are still not all in the cold tier "
                            f"since iteration {self._ship_lag_since}: a failure of this stage needs a rollback",
                            iteration=iteration,
                        )
                    return
                self._ship_lagging = False
                logger.info(
                    "stage %d: the cold tier caught up by iteration %d; commits wait for the data again",
                    self.config.stage,
                    iteration,
                )
            if sealed.wait(timeout) and self.store.wait_shipped(
                own, iteration, max(0.0, timeout - (time.perf_counter() - t0))
            ):
                return
            self._ship_lagging, self._ship_lag_since, self._ship_lag_noted = True, iteration, time.monotonic()
            self.writer.note_fault(
                "ship_timeout",
                f"iteration {iteration}'s {'/'.join(c.name for c in own)} not in the cold tier after "
                f"{timeout:g} s: until it catches up, a failure of this stage needs a rollback",
                iteration=iteration,
            )
        finally:
            self._ship_wait_s += time.perf_counter() - t0

    def abort(self, iteration: int, reason: str = "") -> str:
        """This stage saw a failure in ``iteration``: write "abort" unless decided; return the
        decision in force ("commit", "abort", "unknown", or "none" without a decision store)."""
        self._stepped = None
        if self.coordinator is None:
            return "none"
        return self.coordinator.abort(iteration, reason)

    def set_generation(self, generation: int) -> None:
        """Use commit keys of process-group ``generation`` (after the pipeline re-formed)."""
        if self.coordinator is not None:
            self.coordinator.set_generation(generation)

    def set_logging(self, enabled: bool) -> None:
        """Turn capture on or off from the next iteration on (seeding and commit continue).

        Iterations run with logging off cannot be replayed; meant for measurements.
        """
        self.recorder.enabled = bool(enabled)

    # ================================================================ explicit logging API
    def log_send(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        dst_stage: int,
        kind: str,
        iteration: int,
        micro_batch: int,
        *,
        copy: bool = False,
    ) -> bool:
        """Log a hand-written point-to-point send (``kind`` "activation" or "gradient").

        ``copy=False`` promises that the tensors are not modified afterwards. Only sends that
        cross a logging-group boundary are logged; returns True if queued. Never raises for a
        logging fault; ValueError for a (kind, dst_stage) that is not a neighbour send.
        """
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self.recorder.log_send(ts, dst_stage, kind, iteration, micro_batch, copy=copy)

    def log_received(
        self, tensors: torch.Tensor | Sequence[torch.Tensor], src_stage: int, iteration: int, micro_batch: int
    ) -> bool:
        """Record digests of a hand-written receive from ``src_stage`` (before reusing the buffers)."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self.recorder.log_received(ts, src_stage, iteration, micro_batch)

    def log_inputs(self, tensors: torch.Tensor | Sequence[torch.Tensor], iteration: int, micro_batch: int) -> bool:
        """Log stage-0 inputs of a micro-batch (copied) for hand-written runtimes."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self.recorder.log_inputs(iteration, micro_batch, ts)

    def log_target(self, target: torch.Tensor, iteration: int, micro_batch: int) -> bool:
        """Log the last stage's target of a micro-batch (copied) for hand-written runtimes."""
        return self.recorder.log_target(iteration, micro_batch, target)

    def seed_micro_batch(self, iteration: int, micro_batch: int) -> int:
        """Seed the RNG as LoggingPipelineStage does before a forward (hand-written runtimes)."""
        return seed_micro_batch(self.config.seed, self.config.stage, iteration, micro_batch)

    # ================================================================ checkpoints
    def checkpoint(
        self,
        iteration: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        *,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Write this stage's checkpoint at ``iteration`` (iterations applied) atomically; return its URI.

        Blocks while the checkpoint is written (raises CheckpointError if it cannot be made
        durable). Registration with the log store (which makes older logs garbage) and GC run in
        the background, GC only after every record older than ``iteration`` is written; faults
        there are reported like logging faults.
        """
        c = self.config
        self._check_apply(
            iteration
        )  # taken between iterations: the previous one's optimizer / scheduler steps are made
        uri = checkpoint_uri(c.resolved_checkpoint_url(), c.stage, iteration)
        opts = c.checkpoint_options()
        uri = save_checkpoint(
            uri,
            run_id=c.run_id,
            stage=c.stage,
            num_stages=c.num_stages,
            iteration=iteration,
            seed=c.seed,
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            extra=extra,
            storage_options=opts,
        )
        if optimizer is not None:  # from now on META records the learning rates each step uses
            self.track_optimizer(optimizer)
        if lr_scheduler is not None:  # and the scheduler's steps
            self.track_lr_scheduler(lr_scheduler)
        drained = threading.Event()
        self.writer.mark(drained.set)
        meta = {"seed": c.seed, "num_stages": c.num_stages, "writer": c.writer}
        if (
            c.logging_groups is not None
        ):  # a group is replayed from the checkpoint all its members have: GC keeps what that needs
            meta["logging_groups"] = list(c.logging_groups)
        self._maint.submit(("register", c.stage, iteration, uri, meta, drained, c.gc_after_checkpoint))
        if (
            self.coordinator is not None and c.gc_after_checkpoint
        ):  # the META copies below it too (cheap store requests)
            self.coordinator.forget_metas(iteration)
        return uri

    # ================================================================ reporting and lifecycle
    def stats(self, *, include_store: bool = False) -> dict[str, Any]:
        """Counters of this client (never blocks on the object store unless ``include_store``).

        ``writer``: queue, bytes, drops, waits, faults, training-thread seconds; ``selective``:
        bytes logged vs skipped by logging groups; ``commit``; ``checkpoints``; ``store``: the
        log store's own stats (only with ``include_store=True``; may list the cold tier).
        """
        w = self.writer.stats()
        rec = self.recorder
        out: dict[str, Any] = {
            "run_id": self.config.run_id,
            "stage": self.config.stage,
            "iteration": self._iteration,
            "logging_enabled": rec.enabled,
            "writer": w.to_dict(),
            "training_thread_s": w.submit_s + w.digest_s,
            "selective": {
                "logging_groups": None if self.config.logging_groups is None else list(self.config.logging_groups),
                "logged_send_bytes": rec.logged_send_bytes,
                "skipped_send_bytes": rec.skipped_send_bytes,
                "skipped_send_records": rec.skipped_send_records,
            },
            "commit": {
                "commits": self._commits,
                "aborts": self._aborts,
                "wait_s": self._commit_wait_s,
                "ship_wait_s": self._ship_wait_s,
                "ship_lagging": self._ship_lagging,
                "ship_lag_since": self._ship_lag_since if self._ship_lagging else None,
            },
            "checkpoints": {
                "registered": [list(x) for x in self._maint.registered],
                "unregistered": [[st, it, uri] for st, it, uri, _m, _g in self._maint.unregistered],  # refused: retried
                "retired": [list(x) for x in self._maint.retired],  # keep_checkpoints: withdrawn and deleted
                "gc_runs": self._maint.gc_runs,
                "gc_deleted_records": self._maint.gc_deleted_records,
                "last_gc": self._maint.last_gc,
            },
        }
        if include_store:
            try:
                out["store"] = self.store.stats()
            except SwiftlogError as e:
                out["store"] = {"error": str(e)}
        return out

    def flush(self, timeout: float | None = 60.0) -> FlushReport:
        """Wait until every queued record is written and pending checkpoint work is done, then
        upload every segment to the cold tier. Blocks the caller; never raises a logging fault."""
        drained = self.writer.drain(timeout)
        self._maint.wait_idle(timeout)
        uploaded, error = 0, None
        try:
            uploaded = self.store.flush()
        except SwiftlogError as e:
            error = f"{type(e).__name__}: {e}"
            self.writer.note_fault("flush", error)
        return FlushReport(drained, uploaded, error, self.writer.take_faults(), self.writer.stats().faults)

    def close(self, *, flush: bool = True, timeout: float | None = 60.0) -> FlushReport:
        """Write what is queued, finish checkpoint registration and GC (a final GC if a checkpoint
        was registered), upload everything when ``flush`` and a cold tier exist, and close the
        store. ``timeout`` bounds the whole close (None: wait for everything); a cold tier that is
        slow or down leaves the rest in the hot tier, reported as a "flush" fault (one upload in
        flight may overrun it by the cold tier's ``timeout_s``). Idempotent; never raises a
        logging fault."""
        if self._closed:
            return FlushReport(True, 0, None, [], self.writer.stats().faults)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self._committed is not None:  # the last iteration's optimizer / scheduler steps are made by now
            self._check_apply(self._committed[0] + 1)
        drained = self.writer.drain(left())
        self._maint.wait_idle(left())
        if self._maint.registered and self.config.gc_after_checkpoint:
            self._maint.submit(("gc",))
            self._maint.wait_idle(left())
        uploaded, error = 0, None
        if flush and self.store.cold is not None:
            try:
                uploaded = self.store.flush(left())
            except SwiftlogError as e:
                error = f"{type(e).__name__}: {e}"
                self.writer.note_fault("flush", error)
            if uploaded and self._maint.registered and self.config.gc_after_checkpoint:
                # the flush sealed and shipped the open segments, older iterations among them: garbage in the cold tier now
                self._maint.submit(("gc",))
                self._maint.wait_idle(left())
        self.writer.close(left())
        self._maint.close(left())
        faults = self.writer.take_faults()
        try:
            rest = left()
            self.store.close(timeout=30.0 if rest is None else max(rest, 1.0))
        except SwiftlogError as e:
            error = error or f"{type(e).__name__}: {e}"
        self._closed = True
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if faults or error:
            logger.warning(
                "stage %d: closed with %d logging fault(s)%s",
                self.config.stage,
                len(faults),
                f"; {error}" if error else "",
            )
        if self.metrics is not None:
            self.metrics.close()
        return FlushReport(drained, uploaded, error, faults, self.writer.stats().faults)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of this client's Prometheus endpoint (``/metrics``); None when it is off."""
        return None if self.metrics is None else self.metrics.address

    def __enter__(self) -> SwiftlogClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================ internals
    def _learning_rates(self) -> list[float] | None:
        """Each param group's learning rate now (at commit: what the coming optimizer step uses), of
        the tracked optimizer (:meth:`track_optimizer`); None before there is one."""
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is None:
            return None
        try:
            return [float(g["lr"]) for g in opt.param_groups]
        except (KeyError, TypeError, ValueError):  # an optimizer without a scalar lr
            return None

    def _grad_snapshot(self) -> list[int] | None:
        """The version counter of each gradient of the stage's module (-1: none); None without a module."""
        mod = self.stage_module
        return None if mod is None else [-1 if p.grad is None else p.grad._version for p in mod.parameters()]

    def _grads_carried(self) -> list[str]:
        """Before a schedule step: the stage's parameters whose gradient is still the one the last
        optimizer step used, untouched (the loop did not zero the gradients: this step adds to
        them, which a replay, starting from None, does not); reported as a ``grads_not_zeroed``
        fault once, and the iteration's META says so (``grads_carried``). Only with a tracked
        optimizer. Never raises."""
        snap, self._stepped_grads = self._stepped_grads, None
        mod = self.stage_module
        if snap is None or mod is None:
            return []
        try:
            carried = [
                n
                for (n, p), s in zip(mod.named_parameters(), snap, strict=False)
                if s is not None and p.grad is not None and s[0]() is p.grad and p.grad._version == s[1]
            ]
        except Exception as e:
            self.writer.note_fault("hook", f"gradient zeroing check: {type(e).__name__}: {e}")
            return []
        if carried and not self._warned_carried:
            self._warned_carried = True
            self.writer.note_fault(
                "grads_not_zeroed",
                f"the gradients of {len(carried)} parameter(s) ({', '.join(carried[:3])}"
                f"{', ...' if len(carried) > 3 else ''}) were not zeroed after the last optimizer step: this step adds to "
                "them, which a replay does not repeat (call optimizer.zero_grad() after each step); a replay of such an "
                "iteration stops there",
            )
        return carried

    def _grads_changed(self, versions: list[int] | None) -> list[str]:
        """Names of the stage's parameters whose gradient changed in place (or was replaced) since
        ``versions`` was taken. Sees what bumps a version counter (torch's in-place ops); not a
        collective (an all_reduce of the gradients) or a write through ``.data``."""
        mod = self.stage_module
        if versions is None or mod is None:
            return []
        now = self._grad_snapshot() or []
        names = [n for n, _ in mod.named_parameters()]
        return [n for n, a, b in zip(names, versions, now, strict=False) if a != b]

    def _hparams(self) -> list[dict[str, Any]] | None:
        """The tracked optimizer's other hyperparameters now (:func:`~trainer_client.meta.optimizer_hparams`); None without one."""
        opt = self._optimizer() if self._optimizer is not None else None
        return None if opt is None else optimizer_hparams(opt)

    def _meta(self, iteration: int) -> dict[str, Any]:
        c = self.config
        rec = self.recorder
        n_mb = self._schedule_info.get("n_microbatches") or len({mb for _, mb in rec.order})
        env = (
            environment_fingerprint()
        )  # now, not at construction: determinism flags or the GPU may be set up after the client
        return {
            "version": META_VERSION,
            "run_id": c.run_id,
            "stage": c.stage,
            "num_stages": c.num_stages,
            "iteration": iteration,
            "generation": self.coordinator.generation if self.coordinator is not None else 0,
            **self._schedule_info,
            "n_microbatches": n_mb,
            "order": [[k, mb] for k, mb in rec.order],
            "split_backward": rec.split_backward,
            "seed": c.seed,
            "seed_scheme": SEED_SCHEME,
            "seeds": [derive_seed(c.seed, c.stage, iteration, mb) for mb in range(n_mb)],
            "data": "logged" if c.log_data else "source",
            "input_kwargs": list(rec.input_kwargs),
            "input_consts": dict(rec.input_consts),
            "recv_requires_grad": rec.recv_requires_grad,
            "grad_clip": list(self._grad_clips),
            "grad_reduce": list(self._grad_reduces),
            "grad_digests": grad_digests(self.stage_module),  # what the coming step should use; a replay checks its own
            "grads_carried": list(self._carried),
            "lrs": self._learning_rates(),
            "hparams": self._hparams(),
            "sched_epoch": self._sched_epoch(),
            "sched_next": self._sched_next(),
            "apply_irregular": self._apply_irregular,
            "autocast": rec.autocast,
            "autocast_varies": rec.autocast_varies,
            "logging_groups": None if c.logging_groups is None else list(c.logging_groups),
            "env": env,
            "step_s": None if self._step_t0 is None else time.perf_counter() - self._step_t0,
            "time": time.time(),
        }


def _stats_of(client: weakref.ref[SwiftlogClient]) -> dict[str, Any] | None:
    """The stats of ``client`` for a metrics scrape; None once it is gone or not yet built."""
    c = client()
    return c.stats() if c is not None and getattr(c, "_ready", False) else None


def _all_reduce_flat(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, average: bool
) -> list[torch.Tensor]:
    """The sums of ``grads`` over ``group`` (divided by its size with ``average``), as new tensors:
    one all_reduce per dtype and device over the gradients laid end to end."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.dtype, g.device), []).append(i)
    for idx in by_kind.values():
        flat = torch.cat([grads[i].detach().reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(dist.get_world_size(group))
        off = 0
        for i in idx:
            n = grads[i].numel()
            out[i] = flat[off : off + n].view_as(grads[i])
            off += n
    return cast("list[torch.Tensor]", out)  # every index is in one of the groups


def _last_epoch(sch: Any) -> int | None:
    """A scheduler's ``last_epoch``, or its first part's for a composite without one; None if neither is an int."""
    epoch = getattr(sch, "last_epoch", None)
    if isinstance(epoch, int):
        return epoch
    inner = getattr(sch, "_schedulers", None)
    return _last_epoch(inner[0]) if isinstance(inner, (list, tuple)) and inner else None


def _stepped_by_grad_scaler(opt: torch.optim.Optimizer, kwargs: dict[str, Any]) -> bool:
    """Whether this optimizer step comes from a ``torch.amp.GradScaler`` that unscaled the gradients
    (its kernel changes them without bumping their version counters): the scaler hands itself or
    its scale to optimizers that take them, else its ``_maybe_opt_step`` is a few frames up."""
    if kwargs.get("grad_scaler") is not None or getattr(opt, "grad_scale", None) is not None:
        return True
    f = sys._getframe(1)
    for _ in range(12):  # this check, the step hook, torch's step wrappers, then the scaler
        if f is None:
            return False
        if f.f_code.co_name == "_maybe_opt_step" and f.f_code.co_filename.endswith("grad_scaler.py"):
            return True
        f = f.f_back
    return False


def _part_specs(args: Any) -> list[list[Any]] | None:
    """``[dtype, shape]`` of each tensor of example arguments, in order; None when not given."""
    return None if args is None else [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in _tensors(args)]


def _fmt_parts(parts: list[list[Any]]) -> str:
    return ", ".join(f"{d} {shape}" for d, shape in parts) or "nothing"


def _declaration_key(prefix: str, stage: int) -> str:
    """The commit-store key of what ``stage`` declares it receives and sends (JSON)."""
    return f"{prefix}/declared/{stage}"


def _tensors(args: Any) -> list[torch.Tensor]:
    """The tensors of an example-arguments structure (a tensor, or tuples / lists of them)."""
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (tuple, list)):
        return [t for a in args for t in _tensors(a)]
    return []
