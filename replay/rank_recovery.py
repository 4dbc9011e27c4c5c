"""The replacement of a failed rank that held several pipeline stages (multi-stage schedules).

With Interleaved 1F1B or a V schedule a rank holds ``stages_per_rank`` stages
(``trainer_client.mesh.rank_stages``), so a lost rank loses all of them, and they are rarely
adjacent. :func:`recover_rank` is :func:`replay.recover_stage` for such a rank:

1. it waits for the survivors' reports (per rank, as with one stage per rank) and takes the
   resume iteration they agree on;
2. it turns the failed ranks into failed stages and cuts the rank's stages into replay units: a
   stage alone, or grown by the adjacent failed stages (a V schedule's last rank holds the two
   middle stages, whose exchange never left the rank and so was never logged: they replay
   together, their inner sends regenerated);
3. it replays the units one after another, each from the newest checkpoint its stages share, with
   ``workers`` processes each (SWIFT's parallel replay) or alone, every regenerated send verified
   against its receiver's digest;
4. it returns the recovered objects of every stage of the rank.

:func:`plan_rank` says the same without replaying: the units, their checkpoints and iterations.
Never: modifies the survivors' stores or the checkpoints; waits without a deadline.
"""

from __future__ import annotations

import datetime
import multiprocessing
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from replay.checkpoints import newest_common
from replay.engine import replay
from replay.errors import ReplacementFallback, ReplayError
from replay.job import ReplayJob, SourceSpec, close_sources
from replay.processes import forkserver_context, main_module_hidden
from replay.states import require_factory
from replay.survivors import (
    CountingSource,
    agreed_resume,
    committed_metas,
    record_rates,
    sources_from_reports,
    wait_for_survivors,
)
from replay.unit_recovery import RecoveredStage, recovered_objects, unit_of
from trainer_client.errors import CheckpointError
from trainer_client.mesh import MeshLayout, rank_stages
from trainer_client.recovery_keys import RecoveryKeys

__all__ = ["RankUnit", "RecoveredRank", "plan_rank", "recover_rank"]


@dataclass(frozen=True, slots=True)
class RankUnit:
    """Stages replayed together (``stages``), of which the rank keeps ``kept``, from the checkpoint
    at ``checkpoint_iteration`` to ``resume``."""

    stages: tuple[int, ...]
    kept: tuple[int, ...]
    checkpoint_iteration: int
    checkpoints: dict[int, str]
    resume: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": list(self.stages),
            "kept": list(self.kept),
            "checkpoint_iteration": self.checkpoint_iteration,
            "resume": self.resume,
        }


@dataclass(slots=True)
class RecoveredRank:
    """Every stage of a rank, recovered (by stage), the units it replayed, timings (s).

    ``replays``: per unit, what its replay fetched and how long its phases took (``setup_s``,
    ``fetch_s``, ``replay_s``, ``workers``, ``records``, ``bytes``, ``digests``)."""

    position: int
    resume: int
    stages: dict[int, RecoveredStage]
    units: list[RankUnit]
    replays: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: the units replayed at the same time (their phases overlap: the longest counts, not the sum)
    concurrent: bool = False

    def summary(self) -> dict[str, Any]:
        """What a replacement reports as ready: the rank's totals over its units (the fields of
        ``RecoveredStage.summary`` that a scheduler reads) and every stage's own summary."""
        over = max if self.concurrent else sum
        total = {k: over(r[k] for r in self.replays) for k in ("setup_s", "fetch_s", "replay_s")}
        return {
            "position": self.position,
            "resume": self.resume,
            "path": "replay",
            "why": f"every stage of the rank replayed, in units {[list(u.stages) for u in self.units]}",
            "checkpoint_iteration": min((u.checkpoint_iteration for u in self.units), default=self.resume),
            "verified": all(r.verified for r in self.stages.values()),
            "digests_checked": sum(r["digests"] for r in self.replays),
            "records_fetched": sum(r["records"] for r in self.replays),
            "bytes_fetched": sum(r["bytes"] for r in self.replays),
            "timings": {**self.timings, **total, "workers": max((r["workers"] for r in self.replays), default=0)},
            "warnings": [w for r in self.stages.values() for w in r.warnings],
            "stages": {s: r.summary() for s, r in self.stages.items()},
            "units": [u.to_dict() for u in self.units],
        }


def plan_rank(
    position: int,
    failed_positions: Sequence[int],
    *,
    num_stages: int,
    stages_per_rank: int,
    stage_style: str,
    resume: int,
    checkpoint_url: str,
    checkpoint_options: dict[str, Any] | None = None,
) -> list[RankUnit]:
    """The replay units of the rank at ``position`` when the ranks at ``failed_positions`` were
    lost (``num_stages``: the number of ranks), each with the newest checkpoint its stages share at
    or below ``resume``. Raises ReplacementFallback when a unit has no common checkpoint."""
    lost = sorted(s for p in failed_positions for s in rank_stages(p, num_stages, stages_per_rank, stage_style))
    units: list[RankUnit] = []
    for s in rank_stages(position, num_stages, stages_per_rank, stage_style):
        if any(s in u.stages for u in units):
            continue
        members = unit_of(s, [s], lost)
        found = newest_common(checkpoint_url, members, resume, checkpoint_options)
        if found is None:
            raise ReplacementFallback(
                f"stage(s) {members} have no common durable checkpoint at or below iteration {resume} under "
                f"{checkpoint_url}"
            )
        mine = rank_stages(position, num_stages, stages_per_rank, stage_style)
        kept = tuple(k for k in members if k in mine)
        units.append(RankUnit(tuple(members), kept, found[0], found[1], resume))
    return units


def recover_rank(
    store: dist.Store,
    *,
    run_id: str,
    stage: int,
    num_stages: int,
    stages_per_rank: int,
    stage_style: str = "loop",
    generation: int,
    checkpoint_url: str,
    sources: Sequence[SourceSpec] | None = None,
    factory: Callable[..., Any] | None = None,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
    workers: int = 1,
    concurrent: bool = False,
    threads: int | None = 1,
    output: str | None = None,
    checkpoint_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    commit_prefix: str | None = None,
) -> RecoveredRank:
    """Rebuild every stage of the rank at ``pp`` position ``stage`` (of ``num_stages`` ranks, each
    holding ``stages_per_rank`` stages in ``stage_style``) after generation ``generation`` failed.

    ``factory`` / ``model`` build a pipeline stage as for :func:`replay.recover_stage`
    (``factory(stage, num_pipeline_stages, checkpoint, **model_args)``). The units replay one
    after the other in this process, or with ``concurrent`` at the same time, each but the first
    in a process of its own, started while this process waits for the survivors (forked when this
    process runs one thread, else from a fork server: call it before starting threads or setting
    more torch threads); ``workers`` > 1 replays each unit with that many processes. State
    replayed elsewhere comes back through checkpoint files under ``output`` (default: a temporary
    directory); then ``factory`` and ``loss_fn`` must be picklable (module-level). ``sources``:
    where the records are (default: the survivors' reported store roots and cold tiers). Returns
    the recovered rank. Raises ReplacementFallback when a replay is impossible or does not
    verify, RecoveryTimeoutError when the survivors do not report within ``timeout``.
    """
    require_factory(model, factory)
    keys = RecoveryKeys(run_id, commit_prefix)
    t0 = time.monotonic()
    pool = _warm_pool(stages_per_rank - 1) if concurrent and stages_per_rank > 1 else None
    try:
        failed, docs = wait_for_survivors(store, keys, generation, MeshLayout(num_stages), stage, timeout)
        resume = agreed_resume(docs, generation)
        t_survivors = time.monotonic()
        units = plan_rank(
            stage,
            failed,
            num_stages=num_stages,
            stages_per_rank=stages_per_rank,
            stage_style=stage_style,
            resume=resume,
            checkpoint_url=checkpoint_url,
            checkpoint_options=checkpoint_options,
        )
        base = list(sources) if sources is not None else sources_from_reports(docs)
        jobs = []
        for unit in units:
            metas = committed_metas(store, keys, unit.stages, range(unit.checkpoint_iteration, resume), unit.stages)
            job = ReplayJob(
                run=run_id,
                num_stages=num_stages * stages_per_rank,
                stages=list(unit.stages),
                stop_iteration=resume,
                checkpoints=unit.checkpoints,
                sources=[metas, *base] if metas is not None else list(base),
                checkpoint_options=dict(checkpoint_options or {}),
                model=model,
                model_args=dict(model_args or {}),
                workers=workers,
                threads=threads,
            )
            elsewhere = job.workers > 1 or (pool is not None and unit is not units[0])
            if elsewhere:
                job = job.replace(output=output or tempfile.mkdtemp(prefix=f"swiftlog-recovered-{unit.stages[0]}-"))
            jobs.append((unit, job))
        runs = _replay_units(jobs, pool, factory, loss_fn)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    recovered: dict[int, RecoveredStage] = {}
    for (unit, job), run in zip(jobs, runs, strict=True):
        record_rates(store, keys, job.sources, run.read)
        recovered.update(_kept(unit, job, run, factory, model, model_args))
    timings = {"wait_survivors_s": t_survivors - t0, "total_s": time.monotonic() - t0}
    return RecoveredRank(stage, resume, recovered, units, [r.stats for r in runs], timings, pool is not None)


@dataclass(slots=True)
class _UnitRun:
    """What one unit's replay gives back (picklable: a unit replayed in another process). ``res``:
    the result, in the process that replayed it only; ``read``: per source, the bytes and seconds."""

    stats: dict[str, Any]
    warnings: list[str]
    outputs: dict[int, str]
    read: list[SimpleNamespace]
    res: Any = None


def _warm_pool(n: int) -> ProcessPoolExecutor:
    """``n`` processes for units replayed elsewhere, started now. Forked from this process (they
    start in milliseconds, torch loaded) while it runs one thread, one torch thread included (a
    fork of a process whose other threads hold locks, OpenMP's among them, can hang the child);
    else from a fork server that imports torch and the replay first (seconds)."""
    if threading.active_count() == 1 and torch.get_num_threads() == 1:
        ctx = multiprocessing.get_context("fork")
    else:
        ctx = forkserver_context(["torch", "replay.rank_recovery"])
    pool = ProcessPoolExecutor(n, mp_context=ctx)
    with main_module_hidden():  # the processes start with the first tasks; none needs our __main__
        for _ in range(n):
            pool.submit(_noop)
    return pool


def _noop() -> None:
    return None


def _replay_units(
    jobs: list[tuple[RankUnit, ReplayJob]],
    pool: ProcessPoolExecutor | None,
    factory: Callable[..., Any] | None,
    loss_fn: Callable[..., Any] | None,
) -> list[_UnitRun]:
    """Every unit's replay: the first here, the others in ``pool`` at the same time (None: here,
    one after the other). Raises ReplacementFallback for the first unit that failed."""
    if pool is None:
        return [_replay_unit(job, unit, factory, loss_fn) for unit, job in jobs]
    futures = [pool.submit(_replay_unit_elsewhere, job.to_dict(), unit, factory, loss_fn) for unit, job in jobs[1:]]
    first, job = jobs[0]
    runs = [_replay_unit(job, first, factory, loss_fn)]
    for f in futures:
        run = f.result()
        if isinstance(run, str):  # the other process's ReplacementFallback, as its message
            raise ReplacementFallback(run)
        runs.append(run)
    return runs


def _replay_unit_elsewhere(
    job_doc: dict[str, Any], unit: RankUnit, factory: Callable[..., Any] | None, loss_fn: Callable[..., Any] | None
) -> _UnitRun | str:
    """:func:`_replay_unit` in a pool's process: the state goes to the job's output files."""
    try:
        run = _replay_unit(ReplayJob.from_dict(job_doc), unit, factory, loss_fn)
    except ReplacementFallback as e:
        return str(e)
    run.res = None  # the live objects stay here; the outputs hold their state
    return run


def _replay_unit(
    job: ReplayJob, unit: RankUnit, factory: Callable[..., Any] | None, loss_fn: Callable[..., Any] | None
) -> _UnitRun:
    """One unit's replay (alone, or with ``job.workers`` spawned workers), verified. Raises
    ReplacementFallback when it is impossible or does not verify."""
    t0 = time.monotonic()
    opened = [CountingSource(s.open(job.run)) for s in job.sources]
    where = f"stage(s) {list(unit.stages)} over [{unit.checkpoint_iteration}, {unit.resume})"
    try:
        res = replay(job, factory=factory, loss_fn=loss_fn, sources=opened)
    except (ReplayError, CheckpointError) as e:
        raise ReplacementFallback(f"replay of {where} failed: {e}") from e
    finally:
        close_sources([s.inner for s in opened])
    if not res.verified:
        raise ReplacementFallback(f"replay of {where} did not verify: {res.report.unverified_reason}")
    rep = res.report
    stats = {
        "setup_s": res.setup_seconds,
        "fetch_s": rep.fetch_seconds,
        "replay_s": res.replay_seconds,
        "workers": res.job.workers,
        "unit_s": time.monotonic() - t0,
        "records": rep.records_fetched,
        "bytes": sum(o.bytes for o in opened),
        "digests": rep.digests_checked,
    }
    read = [SimpleNamespace(bytes=o.bytes, seconds=o.seconds) for o in opened]
    return _UnitRun(stats, list(rep.warnings), dict(res.outputs), read, res)


def _kept(
    unit: RankUnit,
    job: ReplayJob,
    run: _UnitRun,
    factory: Callable[..., Any] | None,
    model: str | None,
    model_args: dict[str, Any] | None,
) -> dict[int, RecoveredStage]:
    """The recovered stages the rank keeps of ``unit``: its objects in memory, or loaded from the
    output files of a replay in other processes."""
    res = run.res if run.res is not None else SimpleNamespace(states=None, outputs=run.outputs)
    timings = {k: run.stats[k] for k in ("setup_s", "fetch_s", "replay_s", "workers", "unit_s")}
    out = {}
    for s in unit.kept:
        mod, opt, sched = recovered_objects(res, job, s, model, model_args, factory)
        out[s] = RecoveredStage(
            mod,
            opt,
            sched,
            unit.resume,
            unit.checkpoint_iteration,
            unit.checkpoints[s],
            True,
            run.stats["digests"],
            run.stats["records"],
            run.stats["bytes"],
            timings,
            list(run.warnings),
            why=f"replayed with stage(s) {list(unit.stages)}",
        )
    return out
