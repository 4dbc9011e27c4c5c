"""The replacement of a failed stage: learn what to rebuild, replay it, verify, hand it to training.

A cluster scheduler starts the replacement on a fresh machine when it sees a stage's machine die
(in this repository: :mod:`replay.launcher`; in production the job controller, e.g. a Kubernetes
operator or a Slurm ``--requeue`` hook, starts the same training command with ``--replacement
--generation G --sources ...``). The scheduler first writes which stages it replaces
(``RecoveryKeys.failed_stages(g)``), then starts one replacement per stage. Each replacement:

1. waits until every survivor reported (``RecoveryKeys.survivor``): each survivor drained its log
   writer before reporting, so every record it sent is in its node's store; checks that the
   survivors agree on the resume iteration (the commit step guarantees it) and takes it;
2. finds the failed stage's latest checkpoint at or below that iteration under the durable
   checkpoint URL (a shared directory or the cold tier's object store: never the dead node);
3. replays the stage from there to the resume iteration with :func:`replay.replay` from the
   survivors' node stores (read directly: in this single-machine setup each node's store root is
   a directory; elsewhere a node server's URL or the cold tier after a flush) with optional
   parallel helpers (``workers``), verifying every regenerated send against its receiver's digest;
4. returns the recovered objects; the caller reports ready (:func:`report_ready`) and joins the
   new process-group generation like the survivors.

When the replay cannot be done (records gone, digest mismatch) :func:`recover_stage` raises
:class:`ReplacementFallback`; the caller writes the fallback key (:func:`report_fallback`) so the
survivors stop waiting and the scheduler rolls every stage back to a common checkpoint instead.
Never: modifies the survivors' stores or the checkpoints; waits without a deadline.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from replay.core import ReplayError
from replay.engine import ReplayJob, SourceSpec, load_object, replay
from trainer_client.checkpoint import checkpoint_uri, load_checkpoint
from trainer_client.errors import CheckpointError
from trainer_client.survivor import RecoveryFailedError, RecoveryKeys, wait_for_keys

__all__ = [
    "RecoveredStage",
    "ReplacementFallback",
    "common_checkpoint",
    "latest_checkpoint",
    "recover_stage",
    "report_fallback",
    "report_ready",
]

logger = logging.getLogger(__name__)

_IT_RE = re.compile(r"it(\d{12})\.pt$")


class ReplacementFallback(RecoveryFailedError):
    """The failed stage cannot be replayed; every stage must restart from a checkpoint."""


@dataclass(slots=True)
class RecoveredStage:
    """A replayed stage ready to join: live objects at ``resume``, where it came from, timings (s)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    resume: int
    checkpoint_iteration: int
    checkpoint_uri: str
    verified: bool
    digests_checked: int
    records_fetched: int
    bytes_fetched: int
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("resume", "checkpoint_iteration", "checkpoint_uri", "verified", "digests_checked",
                                               "records_fetched", "bytes_fetched", "timings", "warnings")}  # fmt: skip


def _checkpoint_iterations(
    base: str, stage: int, storage_options: dict[str, Any] | None = None
) -> dict[int, str]:
    fs, path = fsspec.core.url_to_fs(
        base.rstrip("/") + f"/stage{stage:05d}", **(storage_options or {})
    )
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return {}
    its = [int(m.group(1)) for m in (_IT_RE.search(str(n)) for n in names) if m]
    return {i: checkpoint_uri(base, stage, i) for i in its}


class _CountingSource:
    """A record source that counts what is read through it (decoded tensor bytes)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes = 0
        self.records = 0

    def get(self, key: Any) -> torch.Tensor:
        t = self.inner.get(key)
        self.records += 1
        self.bytes += t.numel() * t.element_size()
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def latest_checkpoint(
    base: str, stage: int, at_most: int, storage_options: dict[str, Any] | None = None
) -> tuple[int, str] | None:
    """(iteration, URI) of the newest checkpoint of ``stage`` under ``base`` with iteration <= ``at_most``.

    Checkpoints are written atomically (temporary name, rename), so a listed one is complete.
    """
    its = {
        i: u
        for i, u in _checkpoint_iterations(base, stage, storage_options).items()
        if i <= at_most
    }
    if not its:
        return None
    i = max(its)
    return i, its[i]


def common_checkpoint(
    base: str,
    num_stages: int,
    at_most: int,
    storage_options: dict[str, Any] | None = None,
) -> int | None:
    """The newest iteration <= ``at_most`` at which every stage has a checkpoint (global rollback)."""
    sets = [
        {i for i in _checkpoint_iterations(base, k, storage_options) if i <= at_most}
        for k in range(num_stages)
    ]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def recover_stage(
    store: dist.Store,
    *,
    run_id: str,
    stage: int,
    num_stages: int,
    generation: int,
    checkpoint_url: str,
    sources: Sequence[SourceSpec],
    model: str = "replay.examples:gpt_stage",
    model_args: dict[str, Any] | None = None,
    data_source: str | None = None,
    n_microbatches: int | None = None,
    threads: int | None = 1,
    workers: int = 1,
    factory: Callable[..., Any] | None = None,
    checkpoint_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    commit_prefix: str | None = None,
    output: str | None = None,
    group: Sequence[int] | None = None,
) -> RecoveredStage:
    """Rebuild ``stage`` after generation ``generation`` failed (steps 1-3 of the module docstring).

    Returns the recovered stage. Raises ReplacementFallback when the replay is impossible or does
    not verify, RecoveryTimeoutError when the survivors do not report within ``timeout``.
    ``workers`` > 1 replays with parallel helpers (:mod:`replay.parallel`); their recovered state
    is written to ``output`` (default: a temporary directory) and loaded back here. ``group``: the
    logging group of ``stage`` (only its boundaries were logged): the whole group is replayed
    from the newest checkpoint all its members have, and this stage's state is kept (each member's
    replacement does the same; the scheduler must replace every member).
    """
    keys = RecoveryKeys(run_id, commit_prefix)
    g = generation
    t0 = time.monotonic()
    v = wait_for_keys(
        store,
        [keys.failed_stages(g)],
        timeout=timeout,
        what=f"replacement of stage {stage}: waiting for the failed-stage list",
    )
    failed = sorted(int(x) for x in json.loads(v[keys.failed_stages(g)]))
    if stage not in failed:
        raise RecoveryFailedError(
            f"replacement of stage {stage}: the scheduler replaces stages {failed}, not {stage}"
        )
    survivors = [k for k in range(num_stages) if k not in failed]
    reports = wait_for_keys(store, [keys.survivor(g, k) for k in survivors], timeout=timeout,
                            what=f"replacement of stage {stage}: waiting for the survivors' reports")  # fmt: skip
    resumes = {k: json.loads(reports[keys.survivor(g, k)])["resume"] for k in survivors}
    if len(set(resumes.values())) > 1:
        raise RecoveryFailedError(
            f"survivors disagree on the resume iteration: {resumes} (was the commit step disabled?)"
        )
    resume = next(iter(resumes.values())) if resumes else None
    if resume is None:
        raise ReplacementFallback(
            f"no survivor of generation {g}: nothing to replay against"
        )
    t_survivors = time.monotonic()
    members = sorted(set(group or [stage]) | {stage})
    if members != list(range(members[0], members[-1] + 1)) or any(
        k not in failed for k in members
    ):
        raise RecoveryFailedError(
            f"replacement of stage {stage}: group {members} must be consecutive and all replaced (failed: {failed})"
        )
    # a logging group restarts from one iteration: the newest checkpoint every member has
    per_stage = [
        _checkpoint_iterations(checkpoint_url, k, checkpoint_options) for k in members
    ]
    common = set.intersection(*({i for i in its if i <= resume} for its in per_stage))
    if not common:
        raise ReplacementFallback(
            f"stage(s) {members} have no common durable checkpoint at or below iteration {resume} under {checkpoint_url}"
        )
    ck_it = max(common)
    ck_uris = {k: its[ck_it] for k, its in zip(members, per_stage)}
    ck_uri = ck_uris[stage]
    t_ck = time.monotonic()
    if ck_it == resume:
        ck = load_checkpoint(ck_uri, storage_options=checkpoint_options)
        fac = factory or load_object(model)
        mod, opt, sched = fac(stage, num_stages, ck, **(model_args or {}))
        ck.apply(mod, opt, sched)
        return RecoveredStage(mod, opt, sched, resume, ck_it, ck_uri, True, 0, 0, 0,
                              {"wait_survivors_s": t_survivors - t0, "fetch_s": time.monotonic() - t_survivors, "replay_s": 0.0})  # fmt: skip
    job = ReplayJob(run=run_id, num_stages=num_stages, stages=members, stop_iteration=resume, checkpoints=ck_uris,
                    sources=list(sources), checkpoint_options=dict(checkpoint_options or {}), model=model, model_args=dict(model_args or {}),
                    data_source=data_source, workers=workers, n_microbatches=n_microbatches, scale_grads=True if n_microbatches else None,
                    threads=threads)  # fmt: skip
    if (
        workers > 1
    ):  # helpers run in their own processes: the recovered state comes back as a checkpoint
        job = job.replace(
            output=output or tempfile.mkdtemp(prefix=f"swiftlog-recovered-{stage}-")
        )
    opened = [_CountingSource(s.open(run_id)) for s in job.sources]
    try:
        res = replay(job, factory=factory, sources=opened)
    except (ReplayError, CheckpointError) as e:
        raise ReplacementFallback(
            f"replay of stage {stage} over [{ck_it}, {resume}) failed: {e}"
        ) from e
    finally:
        for s in opened:
            try:
                s.inner.close()
            except Exception:
                logger.debug("closing a source failed", exc_info=True)
    if not res.verified:
        raise ReplacementFallback(f"replay of stage {stage} did not verify: first mismatch {res.first_mismatch}, "
                                  f"missing digests {res.report.digests_missing[:3]}")  # fmt: skip
    if res.states is not None:
        mine = next(st for st in res.states if st.stage == stage)
        st_mod, st_opt, st_sched = mine.module, mine.optimizer, mine.lr_scheduler
    else:
        rck = load_checkpoint(
            res.outputs[stage], storage_options=job.output_options or None
        )
        st_mod, st_opt, st_sched = (factory or load_object(model))(
            stage, num_stages, rck, **(model_args or {})
        )
        rck.apply(st_mod, st_opt, st_sched)
    rep = res.report
    nbytes = sum(s.bytes for s in opened)
    timings = {
        "wait_survivors_s": t_survivors - t0,
        "find_checkpoint_s": t_ck - t_survivors,
        "setup_s": res.setup_seconds,  # checkpoint load + stage build
        "fetch_s": rep.fetch_seconds,  # reading/decoding records (partly overlapped with compute by prefetch)
        "replay_s": res.replay_seconds,
        "total_s": time.monotonic() - t0,
    }
    return RecoveredStage(st_mod, st_opt, st_sched, resume, ck_it, ck_uri, True, rep.digests_checked,
                          rep.records_fetched, nbytes, timings, list(rep.warnings))  # fmt: skip


def report_ready(
    store: dist.Store,
    run_id: str,
    generation: int,
    stage: int,
    info: dict[str, Any],
    commit_prefix: str | None = None,
) -> None:
    """Tell the survivors that ``stage`` is recovered (they then join generation + 1)."""
    store.set(
        RecoveryKeys(run_id, commit_prefix).ready(generation, stage),
        json.dumps({"t": time.time(), **info}, default=str),
    )


def report_fallback(
    store: dist.Store,
    run_id: str,
    generation: int,
    reason: str,
    commit_prefix: str | None = None,
) -> None:
    """Tell the survivors and the scheduler that in-place recovery is impossible (global rollback)."""
    store.set(RecoveryKeys(run_id, commit_prefix).fallback(generation), reason)
