"""What a replay is asked to do and what it returns, as plain values: jobs, sources, progress, results.

A :class:`ReplayJob` says everything a replay needs in plain, JSON-able values, so the same job
runs in this process, in spawned worker processes or under torchrun:

- which stages (one, or a logging group) of which run, up to which iteration;
- the checkpoint of each stage (URIs; loaded with ``trainer_client.load_checkpoint``, applied
  without aliasing);
- where the records are (:class:`SourceSpec`: a node's store root, a node server's URL, or the
  cold tier), tried in order;
- how to rebuild the stage objects (``model``: ``"module:function"`` or
  ``"path/to/file.py:function"`` (:func:`replay.user_code.load_object`) called as
  ``factory(stage, num_stages, checkpoint, **model_args) -> (module, optimizer, lr_scheduler)``),
  the loss function and, if the run used one, the deterministic data source;
- how: ``workers`` (1: sequential in this process; K > 1: ``replay.parallel``), ``exact``,
  ``verify``, ``prefetch`` depth;
- where to write the recovered state (``output``: a directory or fsspec URL; one checkpoint per
  stage in the ``trainer_client.checkpoint`` format, named like training's, at the stop iteration).

:func:`jobs_from_plan` turns a :class:`~replay.plan.RecoveryPlan` into one job per replay unit.
A replay (``replay.engine.replay``) returns a :class:`ReplayResult`; its progress is a
:class:`ReplayProgress`, computed by a :class:`ProgressTracker` and logged at INFO every
``progress_every_s``.

Never: opens a source or loads anything when a job is built (``SourceSpec.open`` does, when asked).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from logstore import LogStore, validate_run
from replay.errors import ReplayError
from replay.reader import RecordSource
from replay.report import ReplayReport
from replay.stage import StageState

__all__ = [
    "DEFAULT_PREFETCH",
    "DYNAMIC_SHARE_MIN_S",
    "ProgressTracker",
    "ReplayJob",
    "ReplayProgress",
    "ReplayResult",
    "SourceSpec",
    "StageFactory",
    "close_sources",
    "jobs_from_plan",
    "log_outcome",
    "open_sources",
]

logger = logging.getLogger(__name__)

#: iterations a replay fetches ahead by default (ReplayJob.prefetch None)
DEFAULT_PREFETCH = 2
#: ReplayJob.dynamic_share_min_s's default: below 20 ms a micro-batch is not worth a claim
DYNAMIC_SHARE_MIN_S = 0.02

#: ``factory(stage, num_stages, checkpoint, **model_args) -> (module, optimizer, lr_scheduler | None)``
StageFactory = Callable[..., tuple[torch.nn.Module, torch.optim.Optimizer, Any]]


# ====================================================================== sources
@dataclass(kw_only=True, slots=True)
class SourceSpec:
    """Where records can be read, as plain values.

    kind "store": ``location`` is a node's store root (every writer's hot tier there), plus the
    cold tier ``cold_url`` if given. kind "cold": ``location`` is the cold tier URL
    (``file://`` or ``s3://``) alone. kind "http": ``location`` is a node server's base URL, with
    ``token`` if its reads need one. kind "metas": ``docs`` holds META documents
    (``"stage/iteration"`` -> JSON text) read from the commit store, ``location`` says where
    from (:class:`~replay.reader.MetaDocSource`). ``options``: fsspec storage options of the cold tier.
    """

    kind: str
    location: str
    cold_url: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    token: str | None = None
    docs: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("store", "cold", "http", "metas"):
            raise ValueError(f"source kind must be store, cold, http or metas, got {self.kind!r}")
        if (self.kind == "metas") != (self.docs is not None):
            raise ValueError("a source of kind 'metas' (and only one) carries docs")
        if not self.location:
            raise ValueError("source location is empty")

    @classmethod
    def parse(
        cls,
        text: str,
        *,
        cold_url: str | None = None,
        options: Mapping[str, Any] | None = None,
        token: str | None = None,
    ) -> SourceSpec:
        """``http(s)://...`` -> a server; ``s3://`` / ``file://`` / ``gs://`` ... -> the cold tier alone;
        anything else -> a store root (with ``cold_url`` as its cold tier)."""
        if text.startswith(("http://", "https://")):
            return cls(kind="http", location=text, token=token)
        if "://" in text:
            return cls(kind="cold", location=text, options=dict(options or {}))
        return cls(kind="store", location=text, cold_url=cold_url, options=dict(options or {}))

    @classmethod
    def from_commit_store(
        cls,
        store: Any,
        prefix: str,
        stages: Sequence[int],
        iterations: range,
        *,
        where: str = "the commit store",
        ranks: Sequence[int] | None = None,
    ) -> SourceSpec | None:
        """The META documents of ``stages`` over ``iterations`` that the commit step put into
        ``store`` (a ``torch.distributed.Store``; keys under ``prefix``, by default
        ``swiftlog/{run}``) as a "metas" source, or None when it holds none. ``ranks``: the mesh
        ranks the stages' documents were committed by (default: the stages, a mesh of one
        replica). Raises what the store client raises when it cannot be reached."""
        from trainer_client.commit import stored_metas

        ranks = list(stages) if ranks is None else list(ranks)
        docs = {
            f"{k}/{it}": b.decode()
            for k, r in zip(stages, ranks, strict=True)
            for it, b in stored_metas(store, prefix, r, iterations).items()
        }
        return cls(kind="metas", location=where, docs=docs) if docs else None

    @classmethod
    def from_store(cls, store: Any) -> SourceSpec:
        """The spec that reopens ``store``: a LogStore (its root and cold tier; a cold-tier-only
        one as the cold tier) or a node server (``replay.remote.HttpRecordSource``)."""
        if hasattr(store, "base_url"):
            return cls(kind="http", location=store.base_url, token=getattr(store, "token", None))
        if store.is_cold_only() and store.config.cold_url:  # plan.cold_only_store(...)
            return cls(kind="cold", location=store.config.cold_url, options=dict(store.config.cold_options))
        return cls(
            kind="store",
            location=str(store.root),
            cold_url=store.config.cold_url,
            options=dict(store.config.cold_options),
        )

    def open(self, run: str) -> RecordSource:
        """A record source for ``run``; the caller closes it (``close()``)."""
        if self.kind == "http":
            from replay.remote import HttpRecordSource

            return HttpRecordSource(self.location, run, token=self.token)
        if self.kind == "cold":
            from replay.plan import cold_only_store

            return cold_only_store(self.location, run, self.options)
        if self.kind == "metas":
            from replay.reader import MetaDocSource

            return MetaDocSource(self.docs or {})
        return LogStore.open(self.location, run, cold_url=self.cold_url, cold_options=dict(self.options))

    def describe(self) -> str:
        if self.kind == "http":
            return f"server {self.location}"
        if self.kind == "cold":
            return f"cold tier {self.location}"
        if self.kind == "metas":
            return f"{len(self.docs or {})} META document(s) from {self.location}"
        return f"store root {self.location}" + (f" + cold tier {self.cold_url}" if self.cold_url else "")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SourceSpec:
        return cls(**dict(d))


def open_sources(specs: Sequence[SourceSpec], run: str) -> list[RecordSource]:
    """Open every spec for ``run`` (in order); close them with ``close()`` when done."""
    return [s.open(run) for s in specs]


def close_sources(sources: Sequence[Any]) -> None:
    for s in sources:
        close = getattr(s, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # closing a source must not hide the replay's outcome
                logger.debug("closing %r failed", s, exc_info=True)


# ====================================================================== the job
@dataclass(kw_only=True, slots=True)
class ReplayJob:
    """Everything a replay needs, JSON-able (``to_dict``/``from_dict``); see the module docstring.

    run: run id. num_stages: pipeline size. stages: consecutive stages replayed together.
    stop_iteration: first iteration not replayed. checkpoints: stage -> checkpoint URI (all at
    the same iteration). checkpoint_options: fsspec options to read them (s3).
    sources: where the records are, tried in order. model / model_args: the stage factory (see
    :data:`StageFactory`; ``"module:function"`` or ``"/path/file.py:function"``, see
    :func:`replay.user_code.load_object`); required unless the caller passes ``factory=`` in
    process. loss: ``"module:attr"`` of the loss function for a replay of the last stage (None:
    the one its META names, see ``replay.user_code.logged_loss``). data_source:
    ``"module:function"`` called as ``fn(seed, **model_args)`` for runs that did not log stage-0
    inputs / targets; None = logged.
    workers: 1 = sequential here; K > 1 = parallel (``replay.parallel``). exact: parallel replay
    reduces gradients in the live order (bit-identical to sequential; default True); False sums
    them in any order (faster on many workers, within the bound in ``replay.parallel``).
    dynamic_share_min_s: parallel workers claim part of an iteration's micro-batches as they go, so
    a worker slowed down in that iteration hands micro-batches to its partner, when a micro-batch
    took at least this many seconds (measured ``fetch_ahead + 1`` iterations before; smaller ones do
    not pay for the claims) or nothing was measured yet (the first iterations); 0: in every
    iteration; None: never (every share is fixed before the iteration from the measured speeds).
    shared_memory: exact parallel replay whose workers share a host forms the gradient chain's
    running sums in one shared-memory file (only small "ready" flags go over gloo); False, or
    workers that cannot all map the file: the sums themselves go over gloo.
    verify / compare_logged: see ``replay.core.replay_stages``. prefetch: iterations fetched
    ahead by a background thread; None (default): ``DEFAULT_PREFETCH`` (2), except parallel
    workers that leave no core of the host spare and read only local sources, which fetch each
    record when they need it (``replay.parallel.worker_prefetch``). n_microbatches / scale_grads: overrides when META
    is missing. output / output_options: where to write the recovered checkpoints (None: not
    written). threads: torch intra-op threads for workers (default: the live value from META).
    progress_every_s: INFO log period. dump_gradients: directory where parallel replay writes
    each iteration's reduced gradients (diagnostics; None = off). device: where the stages are
    replayed (``"cpu"``, ``"cuda"``, ``"cuda:1"``; the factory's modules are moved there before
    the checkpoint is loaded); None = where the factory builds them. Parallel replay is CPU-only.
    """

    run: str
    num_stages: int
    stages: list[int]
    stop_iteration: int
    checkpoints: dict[int, str]
    sources: list[SourceSpec]
    checkpoint_options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    loss: str | None = None
    data_source: str | None = None
    workers: int = 1
    exact: bool = True
    dynamic_share_min_s: float | None = DYNAMIC_SHARE_MIN_S
    shared_memory: bool = True
    verify: bool = True
    compare_logged: bool = False
    prefetch: int | None = None
    n_microbatches: int | None = None
    scale_grads: bool | None = None
    output: str | None = None
    output_options: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None
    progress_every_s: float = 5.0
    dump_gradients: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        validate_run(self.run)
        self.stages = [int(s) for s in self.stages]
        self.checkpoints = {int(k): v for k, v in self.checkpoints.items()}
        self.sources = [s if isinstance(s, SourceSpec) else SourceSpec.from_dict(s) for s in self.sources]
        if not self.stages or self.stages != list(range(self.stages[0], self.stages[0] + len(self.stages))):
            raise ValueError(f"stages must be consecutive and ascending, got {self.stages}")
        if self.num_stages < 1 or self.stages[-1] >= self.num_stages or self.stages[0] < 0:
            raise ValueError(f"stages {self.stages} do not fit a pipeline of {self.num_stages} stages")
        missing = [k for k in self.stages if k not in self.checkpoints]
        if missing:
            raise ValueError(f"no checkpoint URI for stage(s) {missing}")
        if self.dynamic_share_min_s is not None and not self.dynamic_share_min_s >= 0:
            raise ValueError(f"dynamic_share_min_s must be None or >= 0, got {self.dynamic_share_min_s}")
        if not self.sources:
            raise ValueError("a replay needs at least one record source")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.prefetch is not None and self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.stop_iteration < 0:
            raise ValueError(f"stop_iteration must be >= 0, got {self.stop_iteration}")
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
            if self.workers > 1 and dev.type != "cpu":
                raise ValueError(
                    f"device {self.device!r} with workers={self.workers}: parallel replay exchanges gradients over "
                    "gloo and runs on CPU"
                )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["sources"] = [s.to_dict() for s in self.sources]
        d["checkpoints"] = {str(k): v for k, v in self.checkpoints.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplayJob:
        return cls(**dict(d))

    def replace(self, **changes: Any) -> ReplayJob:
        return dataclasses.replace(self, **changes)

    @property
    def fetch_ahead(self) -> int:
        """``prefetch``, or its default when None."""
        return DEFAULT_PREFETCH if self.prefetch is None else self.prefetch

    def replay_options(self) -> dict[str, Any]:
        """The keyword arguments of ``replay_stages`` that this job fixes, for every worker alike."""
        return {
            "num_stages": self.num_stages,
            "stop_iteration": self.stop_iteration,
            "n_microbatches": self.n_microbatches,
            "scale_grads": self.scale_grads,
            "verify": self.verify,
            "compare_logged": self.compare_logged,
        }


def jobs_from_plan(plan: Any, *, sources: Sequence[Any] | None = None, **fields: Any) -> list[ReplayJob]:
    """One job per replay unit of a possible :class:`~replay.plan.RecoveryPlan`.

    ``sources`` (required): where the workers read the records: the stores the plan read (as
    LogStore or HttpRecordSource objects, reopened from their roots and cold tiers or URLs, or
    SourceSpecs), or node servers / the cold tier when the workers run elsewhere. Other keyword
    arguments are :class:`ReplayJob` fields. Raises ReplayError if the plan is not possible,
    ValueError without sources.
    """
    if not plan.possible:
        raise ReplayError(
            f"the recovery plan of run {plan.run!r} is not possible: {'; '.join(plan.reasons)}",
            hint=f"fallback: {plan.fallback.get('note')}",
        )
    specs = [s if isinstance(s, SourceSpec) else SourceSpec.from_store(s) for s in (sources or [])]
    if not specs:
        raise ValueError("jobs_from_plan needs sources= (SourceSpec, LogStore or HttpRecordSource objects)")
    out = []
    for u in plan.units:
        ck = {k: v for k, v in u.checkpoints.items()}
        if any(v is None for v in ck.values()):
            raise ReplayError(f"stages {u.stages}: a registered checkpoint has no URI: {ck}")
        out.append(
            ReplayJob(
                run=plan.run,
                num_stages=plan.num_stages,
                stages=list(u.stages),
                stop_iteration=u.stop_iteration,
                checkpoints=ck,
                sources=list(specs),
                **fields,
            )
        )
    return out


# ====================================================================== progress
@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """Where a replay stands: iterations ``done`` of ``total``, rate (iterations/s), ETA (s)."""

    stages: tuple[int, ...]
    iteration: int
    done: int
    total: int
    elapsed_s: float
    rate: float
    eta_s: float | None
    micro_batches: int
    workers: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ProgressTracker:
    """``on_iteration`` adapter: computes rate and ETA, calls the user's callback, logs periodically."""

    def __init__(
        self, job: ReplayJob, start: int, on_progress: Callable[[ReplayProgress], None] | None, workers: int = 1
    ) -> None:
        self.job, self.start, self.on_progress, self.workers = job, start, on_progress, workers
        self.total = max(0, job.stop_iteration - start)
        self.t0 = time.perf_counter()
        self._last_log = self.t0

    def __call__(self, it: int, report: ReplayReport, micro_batches: int | None = None) -> ReplayProgress:
        """Iteration ``it`` is done: report it (``micro_batches``: done so far by every worker;
        default ``report.micro_batches * workers``) and return the progress."""
        now = time.perf_counter()
        done = it - self.start + 1
        elapsed = now - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else None
        mbs = report.micro_batches * self.workers if micro_batches is None else micro_batches
        p = ReplayProgress(tuple(self.job.stages), it, done, self.total, elapsed, rate, eta, mbs, self.workers)
        if self.on_progress is not None:
            self.on_progress(p)
        if now - self._last_log >= self.job.progress_every_s or done == self.total:
            self._last_log = now
            logger.info(
                "replay run=%s stages=%s iteration=%d: %d/%d done, %.2f it/s, eta %s s",
                self.job.run,
                self.job.stages,
                it,
                done,
                self.total,
                rate,
                "-" if eta is None else f"{eta:.1f}",
            )
        return p


# ====================================================================== the result
@dataclass(slots=True)
class ReplayResult:
    """Outcome of :func:`replay`.

    ``report``: the merged report of every worker. ``states``: the recovered live objects
    (sequential replay in this process only; None for parallel). ``outputs``: stage -> URI of
    the written checkpoint. ``seconds``: end to end (including worker start-up and output);
    ``replay_seconds``: from the first replayed iteration to the last step (slowest worker);
    ``setup_seconds``: loading checkpoints and building stages (slowest worker), and for parallel
    replay the workers' rendezvous; ``build_seconds``: the part that built the stages (slowest
    worker; near 0 when they were built ahead, see :class:`PreparedStates`).
    ``grad_error_bound``: approximate parallel mode only: the largest elementwise bound on how far
    any reduced gradient may be from the sequential one (see ``replay.parallel``).
    ``cpu_seconds``: CPU time of each worker's process during the replay proper (all its threads);
    on a machine shared with other work, ``replay_seconds`` over these shows the contention.
    ``split``: parallel replay only: iteration -> micro-batches each worker replayed (the slices
    follow the workers' measured speeds, see ``replay.parallel``). ``chain``: exact parallel replay
    only: how the gradient chain's running sums travelled (``"shared memory"`` or ``"gloo"``).
    """

    job: ReplayJob
    report: ReplayReport
    outputs: dict[int, str] = field(default_factory=dict)
    states: list[StageState] | None = None
    seconds: float = 0.0
    replay_seconds: float = 0.0
    setup_seconds: float = 0.0
    grad_error_bound: float | None = None
    cpu_seconds: list[float] = field(default_factory=list)
    build_seconds: float = 0.0
    split: dict[int, list[int]] | None = None
    chain: str | None = None

    @property
    def verified(self) -> bool:
        """Every regenerated send was checked against a receiver's digest and matched."""
        return self.report.verified

    @property
    def first_mismatch(self) -> dict[str, Any] | None:
        return self.report.first_mismatch

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.job.run,
            "stages": list(self.job.stages),
            "workers": self.job.workers,
            "exact": self.job.exact,
            "verified": self.verified,
            "first_mismatch": self.first_mismatch,
            "outputs": {str(k): v for k, v in self.outputs.items()},
            "seconds": self.seconds,
            "replay_seconds": self.replay_seconds,
            "setup_seconds": self.setup_seconds,
            "build_seconds": self.build_seconds,
            "grad_error_bound": self.grad_error_bound,
            "cpu_seconds": list(self.cpu_seconds),
            "split": None if self.split is None else {str(k): v for k, v in self.split.items()},
            "chain": self.chain,
            "report": self.report.to_dict(),
        }


def log_outcome(res: ReplayResult) -> None:
    r = res.report
    if r.verified:
        logger.info(
            "replay run=%s stages=%s verified: %d sends matched their digests (%.2f s)",
            res.job.run,
            r.stages,
            r.digests_checked,
            res.seconds,
        )
    elif r.diverged:
        logger.error("replay run=%s stages=%s DIVERGED: %s", res.job.run, r.stages, r.unverified_reason)
    else:
        logger.warning(
            "replay run=%s stages=%s not verified: %d of %d sends checked, %d digests missing",
            res.job.run,
            r.stages,
            r.digests_checked,
            r.sends_generated,
            len(r.digests_missing),
        )
