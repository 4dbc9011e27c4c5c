"""MultiStageClient: SWIFT logging for a rank that holds several pipeline stages.

Schedules such as ``ScheduleInterleaved1F1B`` or ``ScheduleZBVZeroBubble`` put ``stages_per_rank``
stages on every rank (``ClientConfig.stages_per_rank``, placed in torch's "loop" or "v" style).
Each stage is logged as a stage of its own: a :class:`~trainer_client.SwiftlogClient` per stage
(``ClientConfig.stage_view``) with its recorder, META, digests, checkpoints and shipping, all
writing through the rank's one log store and writer. What is per rank: the schedule's step, the
commit (one request reports every stage of the rank done, with every stage's META), the process
group and the failure: in-place recovery replaces a rank, and its replacement rebuilds all its
stages (``replay.recover_rank``).

Usage (one client per process, as with one stage per rank)::

    config = ClientConfig(run_id=..., stage=pp_rank, num_stages=pp, stages_per_rank=2, ...)
    client = MultiStageClient(config, commit_store=store)
    stages = [client.pipeline_stage(modules[s], "cpu", stage=s, input_args=..., output_args=...)
              for s in client.stages]
    client.schedule(stages, "interleaved1f1b", n_microbatches=8, loss_fn=loss)
    client.step(it, x, target=y); client.commit(it); optimizer steps ...

Per-stage operations (a checkpoint, a logged clip, the explicit logging API) go through
:meth:`MultiStageClient.part`. Never: logs anything the stages' own clients would not, or
changes what the schedule computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from logstore import LogStore
from logstore.errors import ConfigError, SwiftlogError
from trainer_client._grad_ops import group_norm
from trainer_client._store_io import close_store, upload_all
from trainer_client.client import SwiftlogClient
from trainer_client.config import ClientConfig
from trainer_client.errors import UnsupportedScheduleError
from trainer_client.meta import importable_name, script_name
from trainer_client.progress import Progress
from trainer_client.reports import CommitReport, FlushReport
from trainer_client.stage import LoggingPipelineStage
from trainer_client.writer import AsyncLogWriter

__all__ = ["MULTI_STAGE_SCHEDULES", "MultiStageClient"]

#: the multi-stage schedules a MultiStageClient builds by name, with the stage style each places
MULTI_STAGE_SCHEDULES: dict[str, tuple[type, str]] = {
    "interleaved1f1b": (ScheduleInterleaved1F1B, "loop"),
    "loopedbfs": (ScheduleLoopedBFS, "loop"),
    "interleavedzerobubble": (ScheduleInterleavedZeroBubble, "loop"),
    "zbvzerobubble": (ScheduleZBVZeroBubble, "v"),
    "dualpipev": (ScheduleDualPipeV, "v"),
}


#: the schedules that split a backward into input- and weight-gradient passes
SPLIT_BACKWARD = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)


def _backward_hooked(module: torch.nn.Module) -> str | None:
    """The name of the first submodule with a full backward (pre-)hook; None without."""
    for name, m in module.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            return name or type(m).__name__
    return None


class MultiStageClient:
    """Asynchronous SWIFT logging for one rank holding ``config.stages_per_rank`` stages.

    Args:
        config: the rank's :class:`ClientConfig` (``stage``: its ``pp`` position).
        commit_store: the decision store (as for :class:`SwiftlogClient`).
    """

    def __init__(self, config: ClientConfig, *, commit_store: dist.Store | None = None) -> None:
        if config.stages_per_rank < 2:
            raise ConfigError(
                f"MultiStageClient needs stages_per_rank >= 2, got {config.stages_per_rank}",
                hint="with one stage per rank use SwiftlogClient",
            )
        if config.metrics.port is not None:
            raise ConfigError("MetricsConfig.port is not supported by MultiStageClient yet")
        if not config.log_data:
            raise ConfigError(
                "log_data=False is not supported by MultiStageClient yet: a replay of its first or last stage "
                "would need a data source it cannot be given",
                hint="log the data (log_data=True, the default)",
            )
        self.config = config
        self.store = LogStore(config.store_config())
        self.writer = AsyncLogWriter(self.store, config.writer, name=f"swiftlog-{config.writer_name}")
        self.parts: dict[int, SwiftlogClient] = {}
        try:
            for s in config.stages:
                self.parts[s] = SwiftlogClient._part(config.stage_view(s), commit_store, self.store, self.writer)
        except BaseException:
            self.writer.close(10.0)
            self.store.close(timeout=10.0)
            raise
        self.progress = Progress()  # the rank's one training thread: a heartbeat publishes it
        for part in self.parts.values():
            part.recorder.progress = self.progress
        self._schedule: Any = None
        self._closed = False

    # ================================================================ the stages
    @property
    def stages(self) -> tuple[int, ...]:
        """The pipeline stages of this rank, ascending."""
        return self.config.stages

    def part(self, stage: int) -> SwiftlogClient:
        """The client of ``stage`` (its checkpoints, logged clip, explicit logging API). It logs
        through this client's store, which only this client closes. KeyError for another stage."""
        if stage not in self.parts:
            raise KeyError(f"this rank holds stages {list(self.parts)}, not {stage}")
        return self.parts[stage]

    @property
    def coordinator(self) -> Any:
        """The commit coordinator of the rank's first stage (the rank's aborts and decisions)."""
        return self.parts[self.stages[0]].coordinator

    @property
    def stage_modules(self) -> dict[int, torch.nn.Module]:
        """The modules of the stages built so far, by stage."""
        return {s: p.stage_module for s, p in self.parts.items() if p.stage_module is not None}

    @property
    def stage_module(self) -> torch.nn.Module | None:
        """The built stages' modules as one ``ModuleList`` (their buffers, for ``ResilientLoop``);
        None before :meth:`pipeline_stage`."""
        mods = list(self.stage_modules.values())
        return torch.nn.ModuleList(mods) if mods else None

    def pipeline_stage(
        self, module: torch.nn.Module, device: torch.device | str, *, stage: int, **kwargs: Any
    ) -> LoggingPipelineStage:
        """``SwiftlogClient.pipeline_stage`` of ``stage`` (one of :attr:`stages`)."""
        return self.part(stage).pipeline_stage(module, device, **kwargs)

    def schedule(
        self,
        stages: Sequence[LoggingPipelineStage],
        schedule: str | type = "interleaved1f1b",
        *,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        scale_grads: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Build a multi-stage schedule over this rank's ``stages`` (one per stage, built by
        :meth:`pipeline_stage`), whose loss function also logs targets: a name of
        :data:`MULTI_STAGE_SCHEDULES` or one of those classes. Raises UnsupportedScheduleError for
        any other schedule, for stages that are not this rank's, and when the schedule places
        stages otherwise than ``config.stage_style`` says."""
        cls, style = self._schedule_class(schedule)
        if style != self.config.stage_style:
            raise UnsupportedScheduleError(
                f"{cls.__name__} places stages in the {style!r} style, the config says {self.config.stage_style!r}",
                hint=f"ClientConfig(..., stage_style={style!r})",
            )
        built = sorted(st.stage_index for st in stages)
        if built != list(self.stages) or any(st.recorder is not self.parts[st.stage_index].recorder for st in stages):
            raise UnsupportedScheduleError(
                f"schedule() needs the stages {list(self.stages)} built by this client's pipeline_stage(), got {built}"
            )
        if loss_fn is None:
            raise UnsupportedScheduleError("loss_fn is required on every rank")
        last = self.config.num_pipeline_stages - 1
        recorder = self.parts[last].recorder if last in self.parts else None

        def logged_loss(output: Any, target: Any, **kw: Any) -> torch.Tensor:
            if recorder is not None:
                recorder.on_loss(target)
            return loss_fn(output, target, **kw)

        ordered = sorted(stages, key=lambda st: st.stage_index)
        if cls in SPLIT_BACKWARD:
            for st in ordered:
                hooked = _backward_hooked(st.submod)
                if hooked is not None:
                    raise UnsupportedScheduleError(
                        f"{cls.__name__} splits backward, which fails under the full backward hook of stage "
                        f"{st.stage_index}'s module {hooked!r}",
                        hint="hook tensors (output.register_hook in a forward hook) instead of module backwards",
                    )
        self._schedule = cls(
            ordered, n_microbatches=n_microbatches, loss_fn=logged_loss, scale_grads=scale_grads, **kwargs
        )
        placed = {s: self._schedule.stage_index_to_group_rank[s] for s in self.stages}
        if any(r != self.config.stage for r in placed.values()):
            raise UnsupportedScheduleError(
                f"{cls.__name__} puts stages on ranks {placed}, not all on {self.config.stage}"
            )
        loss_name = importable_name(loss_fn)
        info = {
            "schedule": cls.__name__,
            "n_microbatches": n_microbatches,
            "scale_grads": scale_grads,
            "grad_scale_factor": n_microbatches if scale_grads else 1,
            "loss": loss_name,
            "loss_repr": repr(loss_fn)[:200],
            "loss_script": None if loss_name else script_name(loss_fn),
            "stages_per_rank": self.config.stages_per_rank,
            "stage_style": self.config.stage_style,
        }
        for part in self.parts.values():
            part._schedule = self._schedule
            part._schedule_info = dict(info)
            part.recorder.n_microbatches = n_microbatches
            part.recorder.on_data_complete = part._ship.seal_own_data
        return self._schedule

    @staticmethod
    def _schedule_class(schedule: str | type) -> tuple[type, str]:
        if isinstance(schedule, str):
            found = MULTI_STAGE_SCHEDULES.get(schedule.lower().replace("schedule", "").replace("_", ""))
        else:
            found = next((v for v in MULTI_STAGE_SCHEDULES.values() if v[0] is schedule), None)
        if found is None:
            raise UnsupportedScheduleError(
                f"schedule {schedule!r} is not supported on a rank with several stages",
                hint=f"use one of {sorted(MULTI_STAGE_SCHEDULES)}",
            )
        return found

    def release_pipeline(self) -> None:
        """Forget the stages and the schedule (after a failure): see ``SwiftlogClient.release_pipeline``."""
        self._schedule = None
        for part in self.parts.values():
            part.release_pipeline()

    # ================================================================ per iteration
    def step(self, iteration: int, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """The schedule's step for ``iteration`` over every stage of the rank: inputs are passed
        only to a rank holding stage 0, target / losses only to the one holding the last stage.
        Returns what ``schedule.step`` returns."""
        if self._schedule is None:
            raise RuntimeError("call client.schedule(...) before client.step(...)")
        for part in self.parts.values():
            if part._stepped is not None and part._stepped == iteration:
                raise RuntimeError(f"client.step({iteration}) again before client.commit({iteration})")
        for part in self.parts.values():
            part._begin_step(iteration)
        if 0 not in self.parts:
            args = ()
        if self.config.num_pipeline_stages - 1 not in self.parts:
            target, losses = None, None
        out = self._schedule.step(*args, target=target, losses=losses, **kwargs)
        for part in self.parts.values():
            part._end_step(iteration)
        return out

    def commit(self, iteration: int) -> CommitReport:
        """Finish ``iteration``'s logs on every stage of the rank and, with a decision store,
        report them all done in one request and wait for the decision (as ``SwiftlogClient.commit``:
        IterationAbortedError when it is "abort")."""
        sealed = [(part, *part._seal(iteration)) for part in self.parts.values()]
        faults = [f for *_, fs in sealed for f in fs]
        decision = None
        first, *rest = sealed
        if first[0].coordinator is not None:
            also = [(p.coordinator, None if meta is None else meta.numpy().tobytes()) for p, _, meta, _ in rest]
            decision = first[0]._decide(iteration, first[2], also)
        for part, doc, _, _ in sealed:
            part._settle(iteration, doc)
        return CommitReport(iteration, decision, faults)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of every stage of the rank by one norm, of all of them (and, with
        ``group``, of every rank of the group: e.g. ``dist.group.WORLD`` for the whole pipeline's
        global norm), as ``torch.nn.utils.clip_grad_norm_`` would over all those parameters.
        Each stage's META records the norm, so a replay of any stage clips the same, bit for
        bit. Call it between :meth:`step` and :meth:`commit`; returns the total norm. Raises
        RuntimeError outside an iteration."""
        params = {s: list(p.stage_module.parameters()) for s, p in self.parts.items() if p.stage_module is not None}
        if len(params) != len(self.parts):
            raise RuntimeError("clip_grad_norm_ before every stage was built (client.pipeline_stage)")
        grads = [p.grad for ps in params.values() for p in ps if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        total = group_norm(total, norm_type, group)
        for s, part in self.parts.items():
            part._clip_by(params[s], max_norm, total, foreach)
        return total

    def abort(self, iteration: int, reason: str = "") -> str:
        """This rank saw a failure in ``iteration`` (see ``SwiftlogClient.abort``)."""
        decisions = [part.abort(iteration, reason) for part in self.parts.values()]
        return decisions[0]

    def set_generation(self, generation: int) -> None:
        for part in self.parts.values():
            part.set_generation(generation)

    def set_mesh(self, mesh: Any) -> None:
        raise ConfigError("a MultiStageClient runs one pipeline: no data-parallel mesh (dp_replicate = dp_shard = 1)")

    def track_optimizer(self, optimizer: Sequence[torch.optim.Optimizer]) -> None:
        """Track one optimizer per stage, in the order of :attr:`stages` (see
        ``SwiftlogClient.track_optimizer``). Raises ValueError for anything but one per stage:
        a replay rebuilds a stage with its own optimizer, whose steps must be the live ones."""
        for part, opt in zip(self.parts.values(), self._per_stage(optimizer, "optimizer"), strict=True):
            part.track_optimizer(opt)

    def track_lr_scheduler(self, lr_scheduler: Sequence[Any] | None) -> None:
        """Count the steps of one scheduler per stage, in the order of :attr:`stages` (or None)."""
        if lr_scheduler is None:
            return
        for part, sched in zip(self.parts.values(), self._per_stage(lr_scheduler, "lr_scheduler"), strict=True):
            part.track_lr_scheduler(sched)

    def _per_stage(self, objs: Any, what: str) -> list[Any]:
        if not isinstance(objs, (list, tuple)) or len(objs) != len(self.parts):
            got = f"{len(objs)} {what}s" if isinstance(objs, (list, tuple)) else f"one {type(objs).__name__}"
            raise ValueError(
                f"{got} for the {len(self.parts)} stages {list(self.parts)}: give one {what} per stage, in the "
                "order of client.stages (a replay rebuilds each stage with its own)"
            )
        return list(objs)

    def checkpoint(
        self,
        iteration: int,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer | None] | None = None,
        lr_schedulers: Sequence[Any] | None = None,
    ) -> list[str]:
        """Checkpoint every stage of the rank at ``iteration`` (``SwiftlogClient.checkpoint`` of
        each; the objects in the order of :attr:`stages`). Returns their URIs."""
        n = len(self.parts)
        opts = list(optimizers) if optimizers is not None else [None] * n
        scheds = list(lr_schedulers) if lr_schedulers is not None else [None] * n
        if not len(models) == len(opts) == len(scheds) == n:
            raise ValueError(f"checkpoint: one model, optimizer and scheduler per stage of {list(self.parts)}")
        return [
            part.checkpoint(iteration, m, o, sc)
            for part, m, o, sc in zip(self.parts.values(), models, opts, scheds, strict=True)
        ]

    # ================================================================ reporting and lifecycle
    def stats(self, *, include_store: bool = False) -> dict[str, Any]:
        """The stats of every stage (``SwiftlogClient.stats``), by stage, and the rank's writer."""
        out: dict[str, Any] = {
            "run_id": self.config.run_id,
            "stages": {s: p.stats() for s, p in self.parts.items()},
            "writer": self.writer.stats().to_dict(),
        }
        if include_store:
            try:
                out["store"] = self.store.stats()
            except SwiftlogError as e:
                out["store"] = {"error": str(e)}
        return out

    def flush(self, timeout: float | None = 60.0) -> FlushReport:
        """Write what is queued, finish every stage's checkpoint work, upload to the cold tier."""
        drained = self.writer.drain(timeout)
        for part in self.parts.values():
            part._maint.wait_idle(timeout)
        uploaded, error = upload_all(self.store, self.writer)
        return FlushReport(drained, uploaded, error, self.writer.take_faults(), self.writer.stats().faults)

    def close(self, *, flush: bool = True, timeout: float | None = 60.0) -> FlushReport:
        """Close every stage (its checkpoint work and GC), then write, upload and close the
        rank's store as ``SwiftlogClient.close`` does. Idempotent; never raises a logging fault."""
        if self._closed:
            return FlushReport(True, 0, None, [], self.writer.stats().faults)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        drained = self.writer.drain(left())
        uploaded, error = (
            upload_all(self.store, self.writer, left()) if flush and self.store.cold is not None else (0, None)
        )
        for part in self.parts.values():  # GC after the upload: what it shipped is garbage in both tiers
            part.close(timeout=left())
        self.writer.close(left())
        faults = self.writer.take_faults()
        error = error or close_store(self.store, left())
        self._closed = True
        return FlushReport(drained, uploaded, error, faults, self.writer.stats().faults)

    def __enter__(self) -> MultiStageClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
