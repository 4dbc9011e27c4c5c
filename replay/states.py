"""The stage objects of a replay and its output: built from the factory and the checkpoints, written back.

:func:`build_states` loads every replayed stage's checkpoint into fresh objects from the stage
factory (:func:`stage_factory`: the one the job names, or one given in process; there is no
default, :func:`require_factory`). :class:`PreparedStates` builds them ahead, on a thread, from a
guess of the checkpoints, while a replacement waits for its job. :func:`write_outputs` writes the
recovered states as checkpoints; :func:`checkpoint_of` reads one back.

The recovered checkpoint is written, not registered with the log store: registering it would make
logs garbage while the pipeline has not re-formed yet.

Never: modifies a source checkpoint (``Checkpoint.apply`` copies); writes the state of a replay
that diverged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from logstore.errors import ConfigError
from replay.errors import ReplayError
from replay.job import ReplayJob, ReplayResult, StageFactory
from replay.report import ReplayReport
from replay.stage import StageState
from replay.user_code import load_object
from trainer_client.checkpoint import Checkpoint, checkpoint_uri, load_checkpoint, save_checkpoint
from trainer_client.errors import CheckpointError

__all__ = [
    "PreparedStates",
    "build_states",
    "checkpoint_of",
    "loss_and_data",
    "require_factory",
    "stage_factory",
    "write_outputs",
]

logger = logging.getLogger(__name__)


def build_states(
    job: ReplayJob, factory: StageFactory | None = None, prepared: PreparedStates | None = None
) -> list[StageState]:
    """Load every stage's checkpoint into fresh objects from the factory (no aliasing).

    ``prepared``: objects built ahead (:class:`PreparedStates`); used when they were built for
    exactly this job's stages, checkpoints and model, otherwise built here. Raises ReplayError
    when a checkpoint is of another run, stage or iteration than the others.
    """
    if prepared is not None:
        states = prepared.take(job)
        if states is not None:
            return states
    return _build(
        job.run,
        job.num_stages,
        job.stages,
        job.checkpoints,
        job.checkpoint_options,
        job.model,
        job.model_args,
        factory,
        job.device,
    )


def require_factory(model: str | None, factory: StageFactory | None = None) -> None:
    """Raise ConfigError naming the ``model`` argument when neither ``model`` nor ``factory`` names
    the stage factory: a replay rebuilds the stages the training built, and there is no default."""
    if factory is None and not model:
        raise ConfigError(
            "a replay needs the stage factory the training used, and none was given (model is None)",
            hint="pass model='module:function' (ReplayJob.model, recover_stage(model=...), swiftlog replay "
            "--model) or factory=...; the example GPT's is trainer_client.examples.factories:gpt_stage",
        )


def stage_factory(model: str | None, factory: StageFactory | None = None) -> StageFactory:
    """The stage factory of a replay: ``factory`` when given, else the one ``model`` names
    (``"module:function"`` or ``"path/to/file.py:function"``); see :func:`require_factory`."""
    require_factory(model, factory)
    return factory if factory is not None else load_object(str(model))


#: ``checkpoint`` is None when the objects are copied from a live replica (their values are replaced)
_FACTORY_FORM = (
    "a stage factory is fn(stage, num_stages, checkpoint, **model_args) -> (module, optimizer, lr_scheduler or None)"
)


def _shape_of(obj: Any) -> str:
    if isinstance(obj, tuple | list):
        return f"a {type(obj).__name__} of {len(obj)} ({', '.join(type(x).__name__ for x in obj)})"
    return f"a {type(obj).__name__}"


def _build(
    run: str,
    num_stages: int,
    stages: Sequence[int],
    checkpoints: Mapping[int, str],
    checkpoint_options: Mapping[str, Any],
    model: str | None,
    model_args: Mapping[str, Any],
    factory: StageFactory | None,
    device: str | None = None,
) -> list[StageState]:
    fac: StageFactory = stage_factory(model, factory)
    by = "the given stage factory" if factory is not None else f"the stage factory {model!r}"
    states = []
    for k in stages:
        ck = load_checkpoint(checkpoints[k], storage_options=dict(checkpoint_options) or None)
        if ck.run_id != run or ck.stage != k:
            raise ReplayError(
                f"checkpoint {checkpoints[k]} is of run {ck.run_id!r} stage {ck.stage}, not run {run!r} stage {k}"
            )
        try:
            built = fac(k, num_stages, ck, **model_args)
        except TypeError as e:  # a signature that does not fit (or a TypeError inside it: its text says which)
            raise ReplayError(f"stage {k}: calling {by} failed: {type(e).__name__}: {e}", hint=_FACTORY_FORM) from e
        if (
            not isinstance(built, tuple | list)
            or len(built) != 3
            or not isinstance(built[0], torch.nn.Module)
            or not isinstance(built[1], torch.optim.Optimizer)
        ):
            raise ReplayError(
                f"stage {k}: {by} returned {_shape_of(built)}, not (module, optimizer, lr_scheduler or None)",
                hint=_FACTORY_FORM,
            )
        module, optimizer, sched = built
        if device is not None:
            module.to(device)  # in place: the optimizer keeps the same parameter objects (its state is still empty)
        try:
            states.append(StageState.from_checkpoint(ck, module, optimizer, sched))
        except CheckpointError as e:
            raise ReplayError(
                f"stage {k}: {e.message}",
                hint=f"{by} must build the stage the training built: pass yours (swiftlog replay --model "
                "module:function or path/to/file.py:function, with --model-arg KEY=VALUE for its arguments)",
            ) from None
    its = {s.checkpoint.iteration for s in states if s.checkpoint is not None}
    if len(its) != 1:
        raise ReplayError(
            f"checkpoints of stages {list(stages)} are at different iterations {sorted(its)}; a group restarts from one"
        )
    return states


class PreparedStates:
    """A job's stage objects, built ahead on a background thread from a guess of its checkpoints.

    A replacement (or a replay helper) knows which stages it rebuilds, from which checkpoint
    directory and with which factory before it knows the job: the iteration to replay up to comes
    with the survivors' reports, and the checkpoint is the newest one at or below it, which is
    nearly always simply the newest. Building from that guess while waiting hides the checkpoint
    load and the model construction. ``checkpoints``: stage -> URI, or a callable that returns
    that mapping (run on the thread, e.g. a listing of the checkpoint directory) or None when
    there is nothing to guess from.

    :meth:`take` hands the objects out only for a job with exactly these run, stages,
    checkpoints, checkpoint options, model, model arguments and device, and only once. Never: raises the
    speculative build's error (it is logged; the caller's own build then raises its own), or
    hands the same objects to two replays.
    """

    def __init__(
        self,
        *,
        run: str,
        num_stages: int,
        stages: Sequence[int],
        checkpoints: Mapping[int, str] | Callable[[], Mapping[int, str] | None],
        checkpoint_options: Mapping[str, Any] | None = None,
        model: str | None = None,
        model_args: Mapping[str, Any] | None = None,
        factory: StageFactory | None = None,
        device: str | None = None,
    ) -> None:
        self.run, self.num_stages, self.stages = run, num_stages, [int(k) for k in stages]
        self.device = device
        self.checkpoint_options = dict(checkpoint_options or {})
        self.model, self.model_args = model, dict(model_args or {})
        self.checkpoints: dict[int, str] | None = None
        self._states: list[StageState] | None = None
        self._taken = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._build, args=(checkpoints, factory), name="swiftlog-prepare-states", daemon=True
        )
        self._thread.start()

    def _build(
        self, checkpoints: Mapping[int, str] | Callable[[], Mapping[int, str] | None], factory: StageFactory | None
    ) -> None:
        try:
            cks = checkpoints() if callable(checkpoints) else checkpoints
            if cks is None:
                return
            self.checkpoints = {int(k): v for k, v in cks.items()}
            self._states = _build(
                self.run,
                self.num_stages,
                self.stages,
                self.checkpoints,
                self.checkpoint_options,
                self.model,
                self.model_args,
                factory,
                self.device,
            )
        except Exception as e:  # noqa: BLE001 - a guess; the real build reports its own error
            logger.info(
                "building stages %s ahead failed (they are built when the job is known): %s: %s",
                self.stages,
                type(e).__name__,
                e,
            )
            self._states = None

    def matches(self, job: ReplayJob) -> bool:
        """Whether these objects are what ``build_states(job)`` would build (waits for the build)."""
        self._thread.join()
        return (
            self._states is not None
            and job.run == self.run
            and job.num_stages == self.num_stages
            and list(job.stages) == self.stages
            and dict(job.checkpoints) == self.checkpoints
            and dict(job.checkpoint_options) == self.checkpoint_options
            and job.model == self.model
            and dict(job.model_args) == self.model_args
            and job.device == self.device
        )

    def take(self, job: ReplayJob) -> list[StageState] | None:
        """The objects built for ``job`` (once), or None when they were built for something else,
        their build failed, or they were taken already. Waits for the build to finish."""
        ok = self.matches(job)
        with self._lock:
            if not ok or self._taken:
                return None
            self._taken = True
            states, self._states = self._states, None
        logger.debug("stages %s: using the objects built ahead from %s", self.stages, self.checkpoints)
        return states


def loss_and_data(
    job: ReplayJob, seed: int, loss_fn: Callable[..., Any] | None, data_source: Callable[[int], Any] | None
) -> tuple[Any, Any]:
    if loss_fn is None and job.loss and job.stages[-1] == job.num_stages - 1:
        loss_fn = load_object(job.loss)
    if data_source is None and job.data_source:
        data_source = load_object(job.data_source)(seed, **job.model_args)
    return loss_fn, data_source


def write_outputs(
    job: ReplayJob, states: Sequence[StageState], report: ReplayReport, *, extra: Mapping[str, Any] | None = None
) -> dict[int, str]:
    """Write each stage's recovered state as a trainer_client checkpoint at ``job.stop_iteration``.

    Returns stage -> URI ({} when ``job.output`` is None). The checkpoint's ``extra["recovered"]``
    records where it came from and whether the replay was verified (False also when digests were
    missing or verification was off). Never writes the state of a replay that diverged (a
    regenerated send or a step's gradients differed from the live ones: the state is wrong), so it
    cannot be loaded as, or overwrite, a recovered checkpoint: returns {} (the states stay in the result).
    """
    if not job.output:
        return {}
    if report.diverged:
        logger.error(
            "replay run=%s stages=%s diverged (%s): no checkpoint written to %s",
            job.run,
            job.stages,
            report.unverified_reason,
            job.output,
        )
        return {}
    out = {}
    for st in states:
        ck = st.checkpoint
        assert ck is not None
        rec = {
            "from_iteration": ck.iteration,
            "from_checkpoint": ck.uri,
            "stages": list(job.stages),
            "verified": report.verified,
            "digests_checked": report.digests_checked,
            "workers": job.workers,
            "exact": job.exact,
            **dict(extra or {}),
        }
        uri = checkpoint_uri(job.output, st.stage, job.stop_iteration)
        out[st.stage] = save_checkpoint(
            uri,
            run_id=job.run,
            stage=st.stage,
            num_stages=job.num_stages,
            iteration=job.stop_iteration,
            seed=ck.seed,
            model=st.module,
            optimizer=st.optimizer,
            lr_scheduler=st.lr_scheduler,
            extra={**ck.extra, "recovered": rec},
            storage_options=job.output_options or None,
        )
    return out


def checkpoint_of(result: ReplayResult, stage: int) -> Checkpoint:
    """Read back the recovered checkpoint of ``stage`` that ``result`` wrote."""
    return load_checkpoint(result.outputs[stage], storage_options=result.job.output_options or None)
