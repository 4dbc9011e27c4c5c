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
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from replay import shard_recovery as sr
from replay.checkpoints import newest_common
from replay.engine import replay
from replay.errors import ReplacementFallback, ReplayError, ReplayOrderError
from replay.helpers import release_helpers, replay_with_helpers
from replay.job import ReplayJob, ReplayResult, SourceSpec, close_sources
from replay.states import PreparedStates, build_states, require_factory, stage_factory
from replay.survivors import (
    CountingSource,
    agreed_resume,
    as_text,
    committed_metas,
    measured_rates,
    record_rates,
    report_fallback,
    report_ready,
    sources_from_reports,
    wait_for_survivors,
)
from trainer_client.checkpoint import load_checkpoint
from trainer_client.errors import CheckpointError, RecoveryFailedError
from trainer_client.mesh import MeshLayout, RankRecovery, recovery_paths
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys

__all__ = [
    "RecoveredStage",
    "measured_rates",
    "prepare_states",
    "recover_stage",
    "report_fallback",
    "report_ready",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RecoveredStage:
    """A replayed stage ready to join: live objects at ``resume``, where it came from, timings (s)."""

    #: None for a sharded stage copied from its replica (``path`` "replica", ``dp_shard`` > 1):
    #: its objects need the next generation's shard group, so the caller builds them after
    #: ``trainer_client.form_mesh`` (over ``client.shard_mesh``) and the loop's join copies into them
    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
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
    #: "replay" (the objects hold the replayed state) or "replica": fresh objects, into which
    #: ``ResilientLoop.join`` copies the state of ``donor``, a live replica, verified by digest
    path: str = "replay"
    donor: int | None = None
    why: str = ""
    #: what the replay read from each source, in the order asked: kind, location, records, bytes
    sources: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "path",
                "donor",
                "why",
                "resume",
                "checkpoint_iteration",
                "checkpoint_uri",
                "verified",
                "digests_checked",
                "records_fetched",
                "bytes_fetched",
                "timings",
                "warnings",
                "sources",
            )
        }


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
        members = _unit_of(stage, members, failed, group_in_place)
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
            try:
                mine = next(st for st in build_states(job, factory, prepared) if st.stage == stage)
            except (ReplayError, CheckpointError) as e:
                # a factory that does not fit the checkpoint: the same fallback as a replay's
                raise ReplacementFallback(
                    f"loading stage {stage}'s checkpoint at {ck_it} (nothing to replay) failed: {e}"
                ) from e
            return RecoveredStage(
                mine.module,
                mine.optimizer,
                mine.lr_scheduler,
                resume,
                ck_it,
                ck_uri,
                True,
                0,
                0,
                0,
                {"wait_survivors_s": t_survivors - t0, "fetch_s": time.monotonic() - t_survivors, "replay_s": 0.0},
                why=path.why,
            )
        if group_in_place and len(members) > 1:
            return _member_recovery(
                store, keys, generation, stage, failed, job, factory, loss_fn, timeout, t0, path.why, prepared
            )
        if workers > 1 and helpers <= 0:  # spawned workers: the recovered state comes back as a checkpoint
            job = job.replace(output=output or tempfile.mkdtemp(prefix=f"swiftlog-recovered-{stage}-"))
        opened = [CountingSource(s.open(log_run)) for s in job.sources]
        try:
            if len(path.replay_group) > 1:  # every replica lost: replayed together, their average repeated
                res = _replay_replicas(
                    store, keys, generation, layout, rank, ck_it, job, opened, factory, prepared, loss_fn
                )
            else:
                res = _replay_unit(
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
        st_mod, st_opt, st_sched = _recovered_objects(res, job, stage, model, model_args, factory)
        rep = res.report
        nbytes = sum(s.bytes for s in opened)
        timings = {
            "wait_survivors_s": t_survivors - t0,
            "find_checkpoint_s": t_ck - t_survivors,
            "setup_s": res.setup_seconds,  # checkpoint load + stage build (+ the replay workers' rendezvous)
            "build_s": res.build_seconds,  # of which the stage build (slowest worker; ~0 when built ahead)
            "fetch_s": rep.fetch_seconds,  # reading/decoding records (partly overlapped with compute by prefetch)
            "replay_s": res.replay_seconds,
            "reduce_s": rep.reduce_seconds,  # parallel replay: gradient exchange, waits included
            "step_s": rep.step_seconds,  # optimizer + lr-scheduler steps
            "workers": res.job.workers,  # processes that replayed (the replacement and its helpers)
            "total_s": time.monotonic() - t0,
        }
        record_rates(store, keys, job.sources, opened)  # for later plans' estimates
        return RecoveredStage(
            st_mod,
            st_opt,
            st_sched,
            resume,
            ck_it,
            ck_uri,
            True,
            rep.digests_checked,
            rep.records_fetched,
            nbytes,
            timings,
            list(rep.warnings),
            why=path.why,
            sources=_read_per_source(job.sources, opened),
        )
    finally:
        if helpers > 0:
            release_helpers(store, keys.replay_job(generation, stage))


def _member_recovery(
    store: dist.Store,
    keys: RecoveryKeys,
    generation: int,
    stage: int,
    failed: Sequence[int],
    job: ReplayJob,
    factory: Callable[..., Any] | None,
    loss_fn: Callable[..., Any] | None,
    timeout: datetime.timedelta,
    t0: float,
    why: str,
    prepared: PreparedStates | None,
) -> RecoveredStage:
    """This replacement replays only its own stage, as a member of its group with the live members
    (``replay.group_recovery``); the lowest failed member publishes the group's job. The objects
    built ahead are taken (or their build waited for): a build draws from torch's global RNG
    (a factory seeds it), which must not run beside the replay's seeded forwards."""
    from replay.group_recovery import replay_as_member

    lead = stage == min(k for k in failed if k in job.stages)
    mine = job.replace(stages=[stage], checkpoints={stage: job.checkpoints[stage]})
    opened: list[CountingSource] = []
    try:
        (state,) = build_states(mine, factory, prepared)
        t_built = time.monotonic()
        opened = [CountingSource(s.open(job.run)) for s in job.sources]
        rep = replay_as_member(
            store, keys, generation, state, job, lead=lead, loss_fn=loss_fn, timeout=timeout, sources=opened
        )
    except (ReplayError, CheckpointError) as e:
        raise ReplacementFallback(f"the in-place replay of group {job.stages} failed: {e}") from e
    finally:
        close_sources([s.inner for s in opened])
    record_rates(store, keys, job.sources, opened)
    ck_it = state.checkpoint.iteration if state.checkpoint is not None else job.stop_iteration
    timings = {"setup_s": t_built - t0, "replay_s": rep.seconds, "fetch_s": rep.fetch_seconds}
    return RecoveredStage(
        state.module,
        state.optimizer,
        state.lr_scheduler,
        job.stop_iteration,
        ck_it,
        job.checkpoints[stage],
        True,
        rep.digests_checked,
        rep.records_fetched,
        sum(s.bytes for s in opened),
        {**timings, "workers": 1, "total_s": time.monotonic() - t0},
        list(rep.warnings),
        why=f"{why}; replayed in place with group {job.stages}",
        sources=_read_per_source(job.sources, opened),
    )


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
        sources=_read_per_source(plan.sources, opened),
    )


def _read_per_source(specs: Sequence[SourceSpec], opened: Sequence[CountingSource]) -> list[dict[str, Any]]:
    """What a replay read from each source, in the order asked: kind, location, records, bytes, seconds."""
    return [
        {"kind": spec.kind, "location": spec.location, "records": s.records, "bytes": s.bytes, "seconds": s.seconds}
        for spec, s in zip(specs, opened, strict=True)
    ]


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


def _unit_of(stage: int, members: list[int], failed: list[int], in_place: bool = False) -> list[int]:
    """The stages replayed together with ``stage``: its logging group, grown by the adjacent failed
    stages (a failed neighbour took the records of what it sent this stage with it, and vice versa:
    the whole run of adjacent failed stages replays together, its inner sends regenerated).
    ``in_place``: the group's live members replay with it (they need not be replaced); a group
    grown by failed neighbours is then not supported (ReplacementFallback)."""
    if in_place:
        if members[0] - 1 in failed or members[-1] + 1 in failed:
            raise ReplacementFallback(
                f"replacement of stage {stage}: a stage next to group {members} failed too; in-place group "
                "recovery covers one group at a time"
            )
        return members
    while members[0] - 1 in failed or members[-1] + 1 in failed:
        members = [members[0] - 1, *members] if members[0] - 1 in failed else [*members, members[-1] + 1]
    if members != list(range(members[0], members[-1] + 1)) or any(k not in failed for k in members):
        raise RecoveryFailedError(
            f"replacement of stage {stage}: group {members} must be consecutive and all replaced (failed: {failed})"
        )
    return members


def _replay_replicas(
    store: dist.Store,
    keys: RecoveryKeys,
    generation: int,
    layout: MeshLayout,
    rank: int,
    ck_it: int,
    job: ReplayJob,
    opened: Sequence[Any],
    factory: Callable[..., Any] | None,
    prepared: PreparedStates | None,
    loss_fn: Callable[..., Any] | None,
) -> ReplayResult:
    """The replay of one of a stage's replicas, all lost: each replacement replays its own
    pipeline's logs, and the live average over the replicas is repeated over a process group of
    the replacements (same world size, replica order and bucket layout: the same bits). They must
    start from checkpoints of one iteration (a ReplayError otherwise). The group is destroyed
    before returning (the caller's ``ResilientLoop`` forms the next generation's)."""
    c = layout.coord(rank)
    base = f"{keys.base}/gen{generation}/replicas/{c.stage}"
    store.set(f"{base}/checkpoint/{c.replica}", str(ck_it))
    others = wait_for_keys(
        store,
        [f"{base}/checkpoint/{r}" for r in range(layout.dp_replicate)],
        timeout=datetime.timedelta(seconds=120),
        what=f"replacement of {layout.describe(rank)}: the other lost replicas' checkpoints",
    )
    its = sorted({int(as_text(v)) for v in others.values()})
    if its != [ck_it]:
        raise ReplayError(f"the lost replicas of stage {c.stage} have checkpoints at different iterations: {its}")
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"{base}/pg", store), rank=c.replica, world_size=layout.dp_replicate
    )
    try:
        return replay(
            job.replace(workers=1),
            factory=factory,
            loss_fn=loss_fn,
            sources=opened,
            prepared=prepared,
            replica_group=dist.group.WORLD,
        )
    finally:
        dist.destroy_process_group()


def _replay_unit(
    store: dist.Store,
    keys: RecoveryKeys,
    generation: int,
    stage: int,
    job: ReplayJob,
    helpers: int,
    output: str | None,
    opened: Sequence[Any],
    factory: Callable[..., Any] | None,
    timeout: datetime.timedelta,
    prepared: PreparedStates,
    loss_fn: Callable[..., Any] | None,
) -> ReplayResult:
    """Step 3: the replay, with the helpers the scheduler started, with spawned workers, or alone (a
    helper that fails, or a stage that needs its live order, means replaying alone)."""
    res = None
    if helpers > 0:
        try:
            res = replay_with_helpers(
                store,
                keys,
                generation,
                stage,
                job.replace(output=output),
                helpers,
                opened,
                factory,
                timeout,
                prepared,
                loss_fn,
            )
        except ReplayOrderError as e:  # the stage needs its live order, which only a replay alone follows
            logger.warning("stage %d: %s; replaying alone", stage, e.message)
        except (ReplayError, CheckpointError):
            raise
        except Exception as e:  # a helper died or never came: the replacement can still replay alone
            logger.warning(
                "stage %d: replay with %d helper(s) failed (%s: %s); replaying alone",
                stage,
                helpers,
                type(e).__name__,
                e,
            )
    if res is None and helpers <= 0 and job.workers > 1:
        try:
            res = replay(job, factory=factory, loss_fn=loss_fn, sources=opened, prepared=prepared)
        except ReplayOrderError as e:
            logger.warning("stage %d: %s; replaying alone", stage, e.message)
    if res is None:
        res = replay(job.replace(workers=1), factory=factory, loss_fn=loss_fn, sources=opened, prepared=prepared)
    return res


def _recovered_objects(
    res: ReplayResult,
    job: ReplayJob,
    stage: int,
    model: str | None,
    model_args: dict[str, Any] | None,
    factory: Callable[..., Any] | None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """``stage``'s recovered module, optimizer and scheduler: kept in memory by a replay in this
    process, else loaded from the checkpoint the spawned workers wrote."""
    if res.states is not None:
        mine = next(st for st in res.states if st.stage == stage)
        return mine.module, mine.optimizer, mine.lr_scheduler
    rck = load_checkpoint(res.outputs[stage], storage_options=job.output_options or None)
    st_mod, st_opt, st_sched = stage_factory(model, factory)(stage, job.num_stages, rck, **(model_args or {}))
    rck.apply(st_mod, st_opt, st_sched)
    return st_mod, st_opt, st_sched
