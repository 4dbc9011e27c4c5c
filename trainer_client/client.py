"""SwiftlogClient: the one object a training script holds per pipeline stage.

It owns the stage's :class:`~logstore.LogStore` (writer = ``config.writer_name``), the asynchronous
writer, the capture state of the :class:`LoggingPipelineStage` it builds, the commit coordinator
(when given a decision store), and a maintenance thread that registers checkpoints and runs GC.

Per iteration the script calls ``step`` (or ``begin_iteration`` + ``schedule.step``), then
``commit`` before the optimizer step. Logging faults never raise: ``commit``, ``flush`` and
``close`` report them, ``stats()`` counts them, and with ``MetricsConfig.port`` a Prometheus
endpoint serves the counts (``trainer_client.metrics``). What does raise: misuse (wrong
iteration, unsupported schedule, bad config), :class:`IterationAbortedError` from ``commit`` (the
protocol says: discard the iteration) and :class:`CheckpointError` when a checkpoint cannot be
written.

The client is a facade over helpers it holds, each in a module of its own: the gradient
operations a replay repeats (``_grad_ops``), the watch over the optimizer and scheduler steps
(``_step_watch``), META building and amendments (``_meta_log``), the shipping of the stage's own
data before its commit (``_shipping``), the checkpoints' writing in either format
(``_checkpointing``), the check of the stages' declared tensors (``_declarations``) and, with
data-parallel replicas, the mesh's groups (``mesh``, ``replicas``). Its reports are in
``reports``. It is over 600 lines because it is the one public surface of a stage: its methods
are the calls a training script makes, each with the documentation that script needs, plus the
per-stage halves of ``step`` / ``commit`` / ``close`` (``_begin_step``, ``_seal``, ``_decide``,
``_settle``, ``_close_part``) that :class:`~trainer_client.MultiStageClient` drives for each stage
of a rank: one stage's protocol, kept in one place.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from logstore import LogStore
from logstore.errors import ConfigError, SwiftlogError
from trainer_client._checkpointing import StageCheckpoints
from trainer_client._declarations import Declarations, example_tensors
from trainer_client._grad_ops import GradOps
from trainer_client._groups import MeshGroups
from trainer_client._meta_log import MetaLog
from trainer_client._shipping import DataShipper
from trainer_client._step_watch import StepWatcher
from trainer_client._store_io import close_store, upload_all
from trainer_client.commit import CommitCoordinator
from trainer_client.config import ClientConfig
from trainer_client.data import DataSource, data_inputs, on_device
from trainer_client.determinism import seed_micro_batch
from trainer_client.errors import IterationAbortedError, UnsupportedScheduleError
from trainer_client.meta import importable_name, script_name
from trainer_client.metrics import MetricsExporter
from trainer_client.progress import Progress
from trainer_client.reports import CommitReport, FlushReport
from trainer_client.stage import LoggingPipelineStage, StageRecorder
from trainer_client.writer import AsyncLogWriter

__all__ = ["SwiftlogClient", "SUPPORTED_SCHEDULES"]

logger = logging.getLogger(__name__)

SUPPORTED_SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


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
        if config.stages_per_rank > 1:
            raise ConfigError(
                f"stages_per_rank={config.stages_per_rank}: a rank with several stages needs a MultiStageClient",
                hint="trainer_client.MultiStageClient(config, commit_store=store)",
            )
        self.metrics: MetricsExporter | None = None  # bound first: a port in use fails before anything is opened
        if config.metrics.port is not None:
            labels = {"run": config.log_run, "stage": str(config.stage), "writer": str(config.writer_name)}
            self.metrics = MetricsExporter(
                functools.partial(_stats_of, weakref.ref(self)),
                labels,
                host=config.metrics.host,
                port=config.metrics.port,
            )
        try:
            self._open(config, commit_store, data_source)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise

    @classmethod
    def _part(
        cls, config: ClientConfig, commit_store: dist.Store | None, store: LogStore, writer: AsyncLogWriter
    ) -> SwiftlogClient:
        """The client of one stage of a multi-stage rank (``config.stage_view``): it logs through
        the rank's ``store`` and ``writer``, which it neither drains nor closes."""
        part = cls.__new__(cls)
        part.metrics = None
        part._open(config, commit_store, None, shared=(store, writer))
        return part

    def _open(
        self,
        config: ClientConfig,
        commit_store: dist.Store | None,
        data_source: DataSource | None,
        shared: tuple[LogStore, AsyncLogWriter] | None = None,
    ) -> None:
        self.config = config
        self._owns_store = shared is None
        self.data_source = data_source
        if not config.log_data and data_source is None:
            logger.warning(
                "stage %d: log_data=False without a data source: a replay of stage 0 / the last stage "
                "needs the same deterministic data source",
                config.stage,
            )
        if config.logging_off_reason is not None:
            logger.warning(
                "stage %d replica %d: logging off for this run (%s); a failure of every replica of a stage "
                "then needs a rollback to the newest checkpoint",
                config.stage,
                config.replica,
                config.logging_off_reason,
            )
        name = f"swiftlog-{config.writer_name}"
        if shared is None:
            self.store = LogStore(config.store_config())
            self.writer = AsyncLogWriter(self.store, config.writer, name=name)
        else:
            self.store, self.writer = shared
            name = f"{name}-s{config.stage}"
        self.recorder = StageRecorder(config, self.writer)
        self.coordinator: CommitCoordinator | None = None
        if commit_store is not None:
            # the commit step spans the whole mesh: one done mark per rank
            self.coordinator = CommitCoordinator(
                commit_store,
                stage=config.rank,
                num_stages=config.layout.world_size,
                prefix=config.commit_prefix,
                timeout=config.commit.timeout,
                shared_stage=config.stage if config.dp_replicate > 1 else None,
            )
        self._checkpoints = StageCheckpoints(config, self.store, self.writer, commit_store, name)
        self._maint = self._checkpoints.maint
        self._stage: LoggingPipelineStage | None = None
        self._schedule: PipelineScheduleSingle | None = None
        self._schedule_info: dict[str, Any] = {}
        self._iteration: int | None = None
        self._step_t0: float | None = None
        # the iteration whose schedule step finished and is not yet committed or aborted
        self._stepped: int | None = None
        self._grad_ops = GradOps(config.stage, self.writer, self.recorder, lambda: self.stage_module)
        self._groups = MeshGroups(config)  # from set_mesh: the generation's pp, dp_replicate, dp_shard groups
        #: called with the iteration on the training thread just before the replicas' gradient
        #: average in ``step`` (tracing, fault injection); None: nothing
        self.before_replica_average: Callable[[int], None] | None = None
        self._meta = MetaLog(config, self.store, self.writer, self.recorder, self.coordinator)
        self._watch = StepWatcher(
            config.stage,
            self.writer,
            self._meta,
            stage_module=lambda: self.stage_module,
            stepped=lambda: self._stepped,
        )
        self._ship = DataShipper(config, self.store, self.writer, self.recorder, self._grad_ops)
        self._declarations = Declarations(config.stage, config.is_first, self.coordinator)
        self._commits = 0
        self._commit_wait_s = 0.0
        self._aborts = 0
        self._closed = False
        self._ready = True  # built: a metrics scrape may read the stats

    # ================================================================ building the pipeline
    def set_mesh(self, mesh: Any) -> None:
        """Use a ``DeviceMesh`` with torchtitan's dimension names: ``mesh["pp"]`` carries the
        pipeline's sends (the default group of :meth:`pipeline_stage`), ``mesh["dp_replicate"]``
        the replicas' gradient average in :meth:`step`, ``mesh["dp_shard"]`` the stage's FSDP
        shard group (:attr:`shard_mesh`). Call it again with the mesh of every new process-group
        generation (``ResilientLoop`` does): the groups are swapped underneath (a
        ``fully_shard``-ed stage is rebound by :meth:`pipeline_stage`). Raises ConfigError when
        the mesh's sizes or this rank's coordinate are not the config's."""
        self._groups.set_mesh(mesh)

    def set_groups(
        self,
        pp: dist.ProcessGroup | None,
        dp_replicate: dist.ProcessGroup | None = None,
        dp_shard: dist.ProcessGroup | None = None,
    ) -> None:
        """The process groups :meth:`set_mesh` takes from a mesh, given directly: ``pp``, this
        rank's pipeline (None: the default group), ``dp_replicate``, this stage's replicas in
        replica order (required with ``dp_replicate > 1``), and ``dp_shard``, the stage's shard
        group in shard order (required with ``dp_shard > 1``). Raises ConfigError when a group's
        size is not the config's."""
        self._groups.set(pp, dp_replicate, dp_shard)

    @property
    def shard_mesh(self) -> Any:
        """A one-dimensional ``DeviceMesh`` of this stage's shard group (``"dp_shard"``) to give
        ``fully_shard`` (after :meth:`set_mesh`). A new generation's group replaces the old one
        under the mesh the module holds (:func:`trainer_client.fsdp.rebind`, by
        :meth:`pipeline_stage`). Raises RuntimeError without ``dp_shard > 1`` or before
        :meth:`set_mesh`."""
        return self._groups.shard_mesh()

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The group of this rank's pipeline: the mesh's ``pp`` group, or the default group
        without a mesh (e.g. for ``clip_grad_norm_(..., group=client.pipeline_group)``)."""
        return self._groups.pp if self._groups.pp is not None else dist.group.WORLD

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
        none of which requires grad. A ``fully_shard``-ed module is rebound to the shard group of
        the last :meth:`set_mesh` (ConfigError when the config has no ``dp_shard > 1`` or no mesh
        was set)."""
        c = self.config
        self._groups.bind(module)
        for what, args, needed in (
            ("output_args", output_args, not c.is_last),
            ("input_args", input_args, not c.is_first),
        ):
            floats = [t for t in example_tensors(args) if t.is_floating_point()]
            if needed and floats and not any(t.requires_grad for t in floats):
                role = (
                    "receives the gradients of what it sends"
                    if what == "output_args"
                    else "sends back the gradients of what it receives"
                )
                raise ConfigError(
                    f"stage {c.stage}: no floating tensor of {what} requires grad, but the stage {role}",
                    hint=f"create the example {what} with requires_grad=True "
                    "(torch builds gradient buffers only for those)",
                )
        self._declarations.publish(input_args, output_args)
        self._stage = LoggingPipelineStage(
            module,
            self.config.stage,
            self.config.num_stages,
            torch.device(device),
            recorder=self.recorder,
            input_args=input_args,
            output_args=output_args,
            group=group if group is not None else self._groups.pp,
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
                f"schedule {schedule!r} is not supported with one stage per rank",
                hint=f"use one of {sorted(SUPPORTED_SCHEDULES)} (ScheduleGPipe, Schedule1F1B); for a schedule that "
                "puts several stages on a rank (Interleaved1F1B, ZBVZeroBubble, ...): ClientConfig(stages_per_rank=N) "
                "and MultiStageClient",
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
        self.recorder.on_data_complete = self._ship.seal_own_data
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
        """Forget the stage, the schedule and the mesh's groups (after a failure), so that the
        process groups they hold can be destructed and their connections closed; build new ones
        (and ``set_mesh``) before the next ``step``."""
        self._stage = None
        self._schedule = None
        self._stepped = None
        self._groups.release()  # the mesh's groups too (set_mesh gives the next generation's)

    # ================================================================ per iteration
    def begin_iteration(self, iteration: int) -> None:
        """Start ``iteration`` (0-based, the number of iterations applied so far)."""
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
        self._iteration = iteration
        self._step_t0 = time.perf_counter()
        self._grad_ops.begin()
        self._watch.carried = []
        self._ship.begin()
        self.recorder.begin(iteration)

    def step(self, iteration: int, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """``begin_iteration(iteration)`` then ``schedule.step`` with what this stage needs.

        The same call works on every stage: inputs are passed only on the first stage and
        target/losses only on the last. With a data source and no inputs/target given, the
        batch of ``iteration`` is fetched from it. With ``dp_replicate > 1`` the gradients are
        then averaged over the replicas (the mesh's ``dp_replicate`` group, :meth:`set_mesh`), in
        the fixed layout a replay of lost replicas repeats. Returns what ``schedule.step`` returns.
        """
        if self._schedule is None:
            raise RuntimeError(
                "call client.schedule(...) before client.step(...) (under a ResilientLoop: the loop calls your "
                "rebuild(), which builds them, in loop.join() or in loop.run() without joined=True)"
            )
        if self._stepped is not None and self._stepped == iteration:
            raise RuntimeError(
                f"client.step({iteration}) again before client.commit({iteration}): a replay repeats exactly one "
                "schedule step per iteration, so gradients accumulated over several steps cannot be replayed; give "
                "the schedule more micro-batches (n_microbatches) instead, or commit each step as its own iteration "
                "with its own optimizer step"
            )
        self._begin_step(iteration)
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
        self._end_step(iteration)
        if c.dp_replicate > 1:
            if self._groups.dp_replicate is None:
                raise RuntimeError(
                    f"dp_replicate={c.dp_replicate}: call client.set_mesh(mesh) or set_groups(...) before client.step "
                    "(ResilientLoop does)"
                )
            if self.before_replica_average is not None:
                self.before_replica_average(iteration)
            self._grad_ops.average_replicas_(self._groups.dp_replicate, c.replica_bucket_bytes)
            self._watch.note_replayed_change()
        return out

    def _begin_step(self, iteration: int) -> None:
        """What precedes the schedule's step: the checks of the last one, then ``begin_iteration``."""
        self._watch.check_apply(iteration)
        if not self._declarations.checked:
            self._declarations.check()
        carried = self._watch.grads_carried()
        self.begin_iteration(iteration)
        self._watch.carried = carried

    def _end_step(self, iteration: int) -> None:
        self._stepped = iteration
        self._watch.after_schedule_step()  # what the coming optimizer step should find

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
        given to :meth:`pipeline_stage`; ``module`` only without one, a hand-written runtime's).
        The norm it used goes into the iteration's META record, so the replay clips with the same
        norm, bit for bit, without the other stages' gradients. Several calls in one iteration are
        replayed in order.
        Raises ValueError for a parameter not in the module, RuntimeError when called outside an
        iteration or after its commit. Never changes gradients other than by the torch clip.
        """
        if self._iteration is None or self._step_t0 is None:
            raise RuntimeError(
                "clip_grad_norm_ belongs between client.step(it) and client.commit(it); no iteration is in progress"
            )
        total = self._grad_ops.clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite, foreach, group=group, module=module
        )
        self._watch.note_replayed_change()
        return total

    def _clip_by(
        self, parameters: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None
    ) -> None:
        """``clip_grad_norm_`` by a norm the caller took (a multi-stage rank's, over its stages)."""
        if self._iteration is None or self._step_t0 is None:
            raise RuntimeError(
                "clip_grad_norm_ belongs between client.step(it) and client.commit(it); no iteration is in progress"
            )
        self._grad_ops.clip_grad_norm_(parameters, max_norm, 2.0, False, foreach, group=None, module=None, total=total)
        self._watch.note_replayed_change()

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
        ``group``, RuntimeError outside an iteration or after its commit. Never changes a gradient
        other than by the reduction.
        """
        if self._iteration is None or self._step_t0 is None:
            raise RuntimeError(
                "all_reduce_grads_ belongs between client.step(it) and client.commit(it); no iteration is in progress"
            )
        self._grad_ops.all_reduce_grads_(self._iteration, parameters, group=group, average=average, module=module)
        self._watch.note_replayed_change()

    def commit(self, iteration: int) -> CommitReport:
        """Finish ``iteration``'s logs and, with a decision store, agree with every stage to apply it.

        Call after the schedule's step and before ``optimizer.step()``. Queues the iteration's
        META record, asks the store to ship inputs/targets/META off the node (and, with a decision
        store, puts the META there too, in the request that reports this stage done), and reports the
        logging faults since the last report (logged as a warning, never raised). Raises
        IterationAbortedError when the decision is "abort" (zero the gradients, skip the
        optimizer step, recover) and ValueError if ``iteration`` is not the current one.
        """
        doc, meta, faults = self._seal(iteration)
        decision = None
        if self.coordinator is not None:
            decision = self._decide(iteration, meta)
        self._settle(iteration, doc)
        return CommitReport(iteration, decision, faults)

    def _decide(self, iteration: int, meta: torch.Tensor | None, also: Sequence[tuple[Any, Any]] = ()) -> Any:
        """The commit decision (this stage's done mark, and ``also`` the rank's other stages')."""
        assert self.coordinator is not None
        try:
            # META goes to the decision store too: it outlives this machine, unlike a log not yet shipped
            decision = self.coordinator.commit(
                iteration, meta=None if meta is None else meta.numpy().tobytes(), also=also
            )
        except IterationAbortedError:
            self._aborts += 1
            raise
        self._commits += 1
        self._commit_wait_s += decision.wait_s
        return decision

    def _seal(self, iteration: int) -> tuple[dict[str, Any] | None, torch.Tensor | None, list[Any]]:
        """The commit up to the decision: the iteration's META queued, its own data shipped (or
        waited for), the faults taken. Returns (META document, its encoded record, faults)."""
        if self._iteration is None or iteration != self._iteration:
            raise ValueError(
                f"commit({iteration}) but the current iteration is {self._iteration}; call begin_iteration/step first"
            )
        self._stepped = None
        rec = self.recorder
        rec.check_complete(iteration, self._schedule_info.get("n_microbatches"))
        own = self._ship.own_channels()
        self._watch.step_expect = None
        doc, meta, sealed = (None, None, None)
        if rec.enabled:
            doc = self._meta.build(
                iteration,
                schedule_info=self._schedule_info,
                step_t0=self._step_t0,
                stage_module=self.stage_module,
                steps={**self._grad_ops.meta_fields(), **self._watch.meta_fields()},
            )
            meta, sealed = self._meta.queue(iteration, doc, own, shipping=self._ship.shipping)
        ship_wait = self.config.commit.ship_wait
        if sealed is not None and own and ship_wait is not None:
            # the early seal covers the iteration's data, unless more was logged after it
            # (a schedule that ran more micro-batches)
            early = (
                self._ship.own_sealed if rec.data_count == rec.data_sealed_at and not self._grad_ops.reduces else None
            )
            self._ship.wait_shipped(iteration, own, early or sealed, ship_wait.total_seconds())
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
        return doc, meta, faults

    def _settle(self, iteration: int, doc: dict[str, Any] | None) -> None:
        """After a "commit" decision: the next iteration is current, the optimizer step is expected."""
        self._iteration = iteration + 1
        if doc is not None:
            self._meta.note_committed(iteration, doc)
            if doc["lrs"] is not None:  # the coming optimizer step is checked against it
                self._watch.step_expect = (iteration, doc)

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Record ``optimizer``'s learning rates and other hyperparameters in every META (what the
        coming step uses) and check its steps: a step that runs with other values than the
        iteration's META says (set between :meth:`commit` and ``optimizer.step()``), or on
        gradients changed since the schedule's step other than by :meth:`clip_grad_norm_`, amends
        the META (a replay then stops at that step, naming the change, instead of taking it for
        another) and is reported as a ``step_after_commit`` fault. :meth:`checkpoint` and
        ``ResilientLoop`` call it; one optimizer per client (the last one given). Never changes
        what the step does."""
        self._watch.track_optimizer(optimizer)

    def track_lr_scheduler(self, lr_scheduler: Any) -> None:
        """Count ``lr_scheduler``'s steps (its ``last_epoch``): META records it at every commit
        (``sched_epoch``), and when the loop does not step it exactly once between two iterations
        (a scheduler stepped per epoch), the next :meth:`step` amends the previous iteration's META
        with the number of steps made, which a replay then repeats. :meth:`checkpoint` calls it
        (and ``ResilientLoop`` when given one); one scheduler per client (the last one given). A
        composite without a ``last_epoch`` of its own (``ChainedScheduler``) is counted by its first
        part's. Never changes the scheduler (META's ``sched_next`` steps it and puts it back)."""
        self._watch.track_lr_scheduler(lr_scheduler)

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
        durable), in ``CheckpointConfig.format``: a ``torch.save`` file, or a DCP directory
        (``dcp.save``; with ``async_save`` only while the state is staged). Registration with the
        log store (which makes older logs garbage) and GC run in the background, registration only
        once the checkpoint is complete, GC only after every record older than ``iteration`` is
        written; faults there are reported like logging faults.
        """
        # taken between iterations: the previous one's optimizer / scheduler steps are made
        self._watch.check_apply(iteration)
        with self.progress.section_of("checkpoint"):
            uri = self._checkpoints.save(iteration, model, optimizer, lr_scheduler, extra)
            self._after_checkpoint(iteration, optimizer, lr_scheduler)
        return uri

    @property
    def progress(self) -> Progress:
        """The training thread's position (section, busy or waiting), which a heartbeat publishes."""
        return self.recorder.progress

    def checkpoint_uri(self, iteration: int) -> str:
        """Where this stage's checkpoint at ``iteration`` is, or goes, in the configured format
        (a DCP checkpoint: its pointer), e.g. to resume from it (``load_checkpoint``)."""
        return self._checkpoints.uri(self.config.stage, iteration)

    def register_checkpoint(
        self,
        iteration: int,
        path: str,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        *,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Register a DCP checkpoint of this stage at ``iteration`` that your own code wrote (e.g.
        a torchtitan-style checkpoint manager): ``path`` is its directory, with the keys
        ``model``, ``optimizer`` (``get_optimizer_state_dict``) and ``lr_scheduler``. Call it once
        the save is complete (for ``async_save``: its future completed). A pointer is written next
        to this client's checkpoints (so replacements and replays find it); registration and GC
        follow as for :meth:`checkpoint`; retention never deletes ``path``. ``optimizer`` and
        ``lr_scheduler``: the objects saved, so a load checks their classes and the scheduler's
        next rates. Returns the pointer's URI; CheckpointError when ``path`` has no ``.metadata``.
        """
        self._watch.check_apply(iteration)
        uri = self._checkpoints.register_dcp(iteration, path, optimizer, lr_scheduler, extra)
        self._after_checkpoint(iteration, optimizer, lr_scheduler)
        return uri

    def _after_checkpoint(self, iteration: int, optimizer: Any | None, lr_scheduler: Any | None) -> None:
        if optimizer is not None:  # from now on META records the learning rates each step uses
            self.track_optimizer(optimizer)
        if lr_scheduler is not None:  # and the scheduler's steps
            self.track_lr_scheduler(lr_scheduler)
        # the META copies below it too (cheap store requests)
        if self.coordinator is not None and self.config.checkpoints.gc_after:
            self.coordinator.forget_metas(iteration)

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
                "ship_wait_s": self._ship.wait_s,
                "ship_lagging": self._ship.lagging,
                "ship_lag_since": self._ship.lag_since if self._ship.lagging else None,
            },
            "checkpoints": self._maint.stats(),
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
        uploaded, error = upload_all(self.store, self.writer)
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

        if self._meta.committed is not None:  # the last iteration's optimizer / scheduler steps are made by now
            self._watch.check_apply(self._meta.committed[0] + 1)
        if not self._owns_store:  # a stage of a multi-stage rank: the rank's client closes the store
            return self._close_part(left())
        drained = self.writer.drain(left())
        self._maint.wait_idle(left())
        if self._maint.registered and self.config.checkpoints.gc_after:
            self._maint.submit(("gc",))
            self._maint.wait_idle(left())
        uploaded, error = 0, None
        if flush and self.store.cold is not None:
            uploaded, error = upload_all(self.store, self.writer, left())
            if uploaded and self._maint.registered and self.config.checkpoints.gc_after:
                # the flush sealed and shipped the open segments, older iterations among them:
                # garbage in the cold tier now
                self._maint.submit(("gc",))
                self._maint.wait_idle(left())
        self.writer.close(left())
        self._maint.close(left())
        faults = self.writer.take_faults()
        error = error or close_store(self.store, left())
        self._closed = True
        self._watch.close()
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

    def _close_part(self, timeout: float | None) -> FlushReport:
        """Close a stage of a multi-stage rank: its checkpoint work and GC, its step watch."""
        self._maint.wait_idle(timeout)
        if self._maint.registered and self.config.checkpoints.gc_after:
            self._maint.submit(("gc",))
            self._maint.wait_idle(timeout)
        self._maint.close(timeout)
        self._watch.close()
        self._closed = True
        return FlushReport(True, 0, None, [], 0)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of this client's Prometheus endpoint (``/metrics``); None when it is off."""
        return None if self.metrics is None else self.metrics.address

    def __enter__(self) -> SwiftlogClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stats_of(client: weakref.ref[SwiftlogClient]) -> dict[str, Any] | None:
    """The stats of ``client`` for a metrics scrape; None once it is gone or not yet built."""
    c = client()
    return c.stats() if c is not None and getattr(c, "_ready", False) else None
