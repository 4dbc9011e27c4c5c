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
   a directory; elsewhere a node server's URL or the cold tier after a flush), verifying every
   regenerated send against its receiver's digest. The failed stage's META documents (its
   autocast regions, clip norms, learning rates) come from the commit store, where the commit step
   put them (``trainer_client.commit``): its own log may not have shipped the last ones. Parallel
   replay (SWIFT's parallel recovery) comes in two forms: ``helpers=H`` - the scheduler started H
   helper processes together with the replacement (``replay.helpers.serve_replay_helper``; on a
   cluster: on spare capacity or on the survivors' nodes, whose devices idle while they wait); the
   replacement publishes the job (``RecoveryKeys.replay_job``), is rank 0 of the replay group
   itself and keeps the recovered state in memory. Helpers cost nothing to start when the
   scheduler starts them with the replacement. Or ``workers=K``: the replacement spawns K fresh
   worker processes (:func:`replay.replay`; they import torch first and hand the state back
   through a checkpoint file);
4. returns the recovered objects; the caller reports ready (:func:`report_ready`) and joins the
   new process-group generation like the survivors.

When the replay cannot be done (records gone, digest mismatch) :func:`recover_stage` raises
:class:`~replay.errors.ReplacementFallback`; the caller writes the fallback key (:func:`report_fallback`) so the
survivors stop waiting and the scheduler rolls every stage back to a common checkpoint instead.
Never: modifies the survivors' stores or the checkpoints; waits without a deadline.
"""

from __future__ import annotations

import datetime
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from replay import shard_recovery as sr
from replay.checkpoints import newest_common
from replay.errors import ReplacementFallback, ReplayError
from replay.helpers import release_helpers
from replay.job import ReplayJob, SourceSpec, close_sources
from replay.states import PreparedStates, require_factory, stage_factory
from replay.survivors import (
    CountingSource,
    agreed_resume,
    committed_metas,
    measured_rates,
    record_rates,
    report_fallback,
    report_ready,
    sources_from_reports,
    wait_for_survivors,
)
from replay.unit_recovery import (
    RecoveredStage,
    checkpoint_alone,
    member_recovery,
    read_per_source,
    replay_replicas,
    replay_unit,
    replayed,
    unit_of,
)
from trainer_client.errors import CheckpointError
from trainer_client.mesh import MeshLayout, RankRecovery, recovery_paths
from trainer_client.recovery_keys import RecoveryKeys

__all__ = [
    "RecoveredStage",
    "measured_rates",
    "prepare_states",
    "recover_stage",
    "report_fallback",
    "report_ready",
]


def prepare_states(
    checkpoint_url: str,
    *,
    run_id: str,
    stages: Sequence[int],
    num_stages: int,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    checkpoint_options: dict[str, Any] | None = None,
    factory: Callable[..., Any] | None = None,
) -> PreparedStates:
    """Start building ``stages`` from their newest common checkpoint under ``checkpoint_url``, ahead
    of the job (a background thread; see :class:`~replay.states.PreparedStates`).

    The failed stages write no more checkpoints, so their newest one is final when the
    replacement starts; the job uses it unless the survivors resume below it (then the objects
    are not used and the job's own checkpoint is built instead).
    """

    def guess() -> dict[int, str] | None:
        found = newest_common(checkpoint_url, stages, None, checkpoint_options)
        return found[1] if found else None

    return PreparedStates(
        run=run_id,
        num_stages=num_stages,
        stages=stages,
        checkpoints=guess,
        checkpoint_options=checkpoint_options,
        model=model,
        model_args=model_args,
        factory=factory,
    )


def recover_stage(
    store: dist.Store,
    *,
    run_id: str,
    stage: int,
    num_stages: int,
    generation: int,
    checkpoint_url: str,
    sources: Sequence[SourceSpec] | None,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    data_source: str | None = None,
    loss: str | None = None,
    loss_fn: Callable[..., Any] | None = None,
    n_microbatches: int | None = None,
    threads: int | None = 1,
    workers: int = 1,
    factory: Callable[..., Any] | None = None,
    checkpoint_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    commit_prefix: str | None = None,
    output: str | None = None,
    group: Sequence[int] | None = None,
    helpers: int = 0,
    replica: int = 0,
    dp_replicate: int = 1,
    group_in_place: bool = False,
    shard: int = 0,
    dp_shard: int = 1,
) -> RecoveredStage:
    """Rebuild ``stage`` after generation ``generation`` failed (steps 1-3 of the module docstring).

    In a mesh with replicas (``dp_replicate`` > 1; this process is ``replica``), a stage that
    still has a live replica is not replayed: the result's ``path`` is "replica", its objects are
    fresh from the factory, and the donor's state reaches them when the caller's
    ``ResilientLoop`` joins the next generation. ``checkpoint_url`` is then this replica's own
    (``ClientConfig.resolved_checkpoint_url``), and the logs are those of its run
    (``f"{run_id}.dp{replica}"``).

    With sharding (``dp_shard`` > 1, FSDP2; this process is ``shard``), a lost shard without a
    live replica is replayed by its whole shard group (``replay.shard_recovery``): the factory is
    called with ``shard_mesh=``, the ``DeviceMesh`` of that group to ``fully_shard`` over, and the
    checkpoint must be this rank's own (DCP); the live members replay in place meanwhile.

    Returns the recovered stage. Raises ReplacementFallback when the replay is impossible or does
    not verify, RecoveryTimeoutError when the survivors do not report within ``timeout``,
    ConfigError when neither ``model`` (``"module:function"``) nor ``factory`` names the stage
    factory.
    ``workers`` > 1 replays with parallel helpers (:mod:`replay.parallel`); their recovered state
    is written to ``output`` (default: a temporary directory) and loaded back here. ``group``: the
    logging group of ``stage`` (only its boundaries were logged): the whole group is replayed
    from the newest checkpoint all its members have, and this stage's state is kept (each member's
    replacement does the same; the scheduler must replace every member). Adjacent failed stages
    are replayed together the same way: each took with it the records of what it sent the other. ``sources``: where to
    read the records; None: the store roots the survivors reported (and their cold tier), which
    works when this process can reach them (one machine, a shared filesystem); on a cluster pass
    the survivors' node servers (``SourceSpec("http", url)``) and the cold tier. ``helpers``: how
    many helper processes the scheduler started for this replacement (``serve_replay_helper``,
    ranks 1..helpers); they are always told the outcome (the job, or a cancellation when the
    replay is not needed or impossible), so none waits in vain. ``group_in_place``: the group's
    live members were not killed; they replay with this replacement, each its own stage
    (``replay.group_recovery``). When the helpers fail (one dies,
    the rendezvous times out) the replacement replays alone instead. ``loss`` (``"module:attr"``)
    or ``loss_fn`` (picklable when ``workers`` > 1 without helpers): the loss function for a
    replay of the last stage; default: the one the live schedule used, as its META names it.
    """
    require_factory(model, factory)  # a usage error, not a reason to roll every stage back
    keys = RecoveryKeys(run_id, commit_prefix)
    layout = MeshLayout(num_stages, dp_replicate, dp_shard)
    rank = layout.rank(stage, replica, shard)
    log_run = layout.log_run(run_id, rank)
    members = sorted(set(group or [stage]) | {stage})

    def prepare() -> PreparedStates:
        return prepare_states(
            checkpoint_url,
            run_id=log_run,
            stages=[stage] if group_in_place else members,  # in place: each member builds its own
            num_stages=num_stages,
            model=model,
            model_args=model_args,
            checkpoint_options=checkpoint_options,
            factory=factory,
        )

    # the checkpoint load and model build overlap the wait for the survivors (and the checkpoint
    # listing); with replicas, a copy from a live one is likelier: built once the path is known
    prepared = prepare() if layout.dp_size == 1 else None
    try:
        t0 = time.monotonic()
        failed, docs = wait_for_survivors(store, keys, generation, layout, rank, timeout)
        resume = agreed_resume(docs, generation)
        t_survivors = time.monotonic()
        try:
            path = recovery_paths(layout, failed)[rank]
        except ValueError as e:
            raise ReplacementFallback(f"replacement of {layout.describe(rank)}: {e}") from e
        if path.path == "shard":
            return _recover_shard(
                store,
                keys,
                generation,
                layout,
                rank,
                docs,
                path,
                run_id=run_id,
                checkpoint_url=checkpoint_url,
                checkpoint_options=checkpoint_options,
                builder=lambda ck, mesh: stage_factory(model, factory)(
                    stage, num_stages, ck, shard_mesh=mesh, **(model_args or {})
                ),
                loss_fn=loss_fn,
                timeout=timeout,
                t0=t0,
            )
        if path.path == "replica":
            built = (
                (None, None, None)  # sharded: built by the caller over the next generation's shard group
                if dp_shard > 1
                else stage_factory(model, factory)(stage, num_stages, None, **(model_args or {}))
            )
            return _for_copy(built, path, resume, t_survivors - t0)
        if prepared is None:
            prepared = prepare()
        dp = layout.dp_index(rank)
        docs = {layout.coord(r).stage: d for r, d in docs.items() if layout.dp_index(r) == dp}
        failed = [layout.coord(r).stage for r in failed if layout.dp_index(r) == dp]
        if sources is None:
            sources = sources_from_reports(docs)
        members = unit_of(stage, members, failed, group_in_place)
        if group_in_place and len(members) == num_stages:
            raise ReplacementFallback(
                f"replacement of stage {stage}: the group is the whole pipeline: nothing logged to replay "
                "between, every stage rolls back"
            )
        # a logging group restarts from one iteration: the newest checkpoint every member has
        found = newest_common(checkpoint_url, members, resume, checkpoint_options)
        if found is None:
            raise ReplacementFallback(
                f"stage(s) {members} have no common durable checkpoint at or below iteration {resume} under "
                f"{checkpoint_url}"
            )
        ck_it, ck_uris = found
        ck_uri = ck_uris[stage]
        metas = committed_metas(
            store, keys, members, range(ck_it, resume), [layout.rank(k, replica, shard) for k in members]
        )
        if metas is not None:  # first: the dead stage's own log may not have shipped its last META
            sources = [metas, *sources]
        t_ck = time.monotonic()
        job = ReplayJob(
            run=log_run,
            num_stages=num_stages,
            stages=members,
            stop_iteration=resume,
            checkpoints=ck_uris,
            sources=list(sources),
            checkpoint_options=dict(checkpoint_options or {}),
            model=model,
            model_args=dict(model_args or {}),
            data_source=data_source,
            loss=loss,
            workers=workers,
            n_microbatches=n_microbatches,
            scale_grads=True if n_microbatches else None,
            threads=threads,
        )
        if ck_it == resume:  # nothing to replay: the checkpoint is the state
            return checkpoint_alone(job, stage, factory, prepared, ck_uri, t0, t_survivors, path.why)
        if group_in_place and len(members) > 1:
            return member_recovery(
                store, keys, generation, stage, failed, job, factory, loss_fn, timeout, t0, path.why, prepared
            )
        if workers > 1 and helpers <= 0:  # spawned workers: the recovered state comes back as a checkpoint
            job = job.replace(output=output or tempfile.mkdtemp(prefix=f"swiftlog-recovered-{stage}-"))
        opened = [CountingSource(s.open(log_run)) for s in job.sources]
        try:
            if len(path.replay_group) > 1:  # every replica lost: replayed together, their average repeated
                res = replay_replicas(
                    store, keys, generation, layout, rank, ck_it, job, opened, factory, prepared, loss_fn
                )
            else:
                res = replay_unit(
                    store, keys, generation, stage, job, helpers, output, opened, factory, timeout, prepared, loss_fn
                )
        except (ReplayError, CheckpointError) as e:
            raise ReplacementFallback(f"replay of stage {stage} over [{ck_it}, {resume}) failed: {e}") from e
        finally:
            close_sources([s.inner for s in opened])
        if not res.verified:
            raise ReplacementFallback(
                f"replay of stage {stage} over [{ck_it}, {resume}) did not verify: {res.report.unverified_reason}"
            )
        record_rates(store, keys, job.sources, opened)  # for later plans' estimates
        marks = {"wait_survivors_s": t_survivors - t0, "find_checkpoint_s": t_ck - t_survivors}
        return replayed(res, job, stage, opened, ck_it, ck_uri, marks, t0, path.why, model, model_args, factory)
    finally:
        if helpers > 0:
            release_helpers(store, keys.replay_job(generation, stage))


def _recover_shard(
    store: dist.Store,
    keys: RecoveryKeys,
    generation: int,
    layout: MeshLayout,
    rank: int,
    docs: dict[int, dict[str, Any]],
    path: RankRecovery,
    *,
    run_id: str,
    checkpoint_url: str,
    checkpoint_options: dict[str, Any] | None,
    builder: Callable[[Any, Any], Any],
    loss_fn: Callable[..., Any] | None,
    timeout: datetime.timedelta,
    t0: float,
) -> RecoveredStage:
    """A lost shard's replacement: its shard group agrees on a checkpoint, meets, and replays, the
    live members in place (``replay.shard_recovery``); ``builder(checkpoint, mesh)`` builds the
    stage's objects ``fully_shard``-ed over the group's mesh."""
    try:
        done = sr.replay_shard_group(
            store,
            keys,
            generation,
            layout,
            rank,
            docs,
            run_id=run_id,
            checkpoint_url=checkpoint_url,
            storage_options=checkpoint_options,
            objects=builder,
            loss_fn=loss_fn,
            timeout=timeout,
        )
    except (ReplayError, CheckpointError) as e:
        raise ReplacementFallback(f"the replay of {layout.describe(rank)}'s shard group failed: {e}") from e
    plan, rep, opened = done.plan, done.report, done.opened
    record_rates(store, keys, plan.sources, opened)
    timings = {
        "setup_s": done.t_built - t0,  # the survivors, the agreed checkpoint, the group, the load and build
        "replay_s": rep.seconds,
        "fetch_s": rep.fetch_seconds,
        "workers": 1,
        "total_s": time.monotonic() - t0,
    }
    return RecoveredStage(
        done.state.module,
        done.state.optimizer,
        done.state.lr_scheduler,
        plan.resume,
        plan.checkpoint_iteration,
        plan.checkpoint_uri,
        True,
        rep.digests_checked,
        rep.records_fetched,
        sum(s.bytes for s in opened),
        timings,
        list(rep.warnings),
        path="shard",
        why=path.why,
        sources=read_per_source(plan.sources, opened),
    )


def _for_copy(built: Any, path: RankRecovery, resume: int, waited_s: float) -> RecoveredStage:
    """The fresh objects of a stage copied from a live replica (``path.donor``): its state reaches
    them when the caller's ``ResilientLoop`` joins the next generation."""
    module, optimizer, lr_scheduler = built
    timings = {"wait_survivors_s": waited_s, "fetch_s": 0.0, "replay_s": 0.0}
    return RecoveredStage(
        module,
        optimizer,
        lr_scheduler,
        resume,
        resume,
        "",
        True,
        0,
        0,
        0,
        timings,
        path="replica",
        donor=path.donor,
        why=path.why,
    )
