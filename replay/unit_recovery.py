"""What a replacement replays, and what it hands back: the unit replays of :func:`replay.recover_stage`.

- :class:`RecoveredStage`: a replayed (or copied) stage ready to join, where it came from, timings.
- :func:`unit_of`: the stages replayed together with a failed one (its logging group, grown by the
  adjacent failed stages, whose sends to each other are lost with them).
- :func:`replay_unit`: the replay of a unit with the helpers the scheduler started, with spawned
  workers, or alone; :func:`replay_replicas`: a stage's replicas, all lost, replayed together;
  :func:`member_recovery`: one member of a logging group replaying with its live members.
- :func:`replayed` / :func:`checkpoint_alone` / :func:`recovered_objects`: the recovered stage
  from a verified replay, from a checkpoint at the resume iteration, or from a replay's files.

Never: modifies the survivors' stores or the checkpoints.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from replay.engine import replay
from replay.errors import ReplacementFallback, ReplayError, ReplayOrderError
from replay.helpers import replay_with_helpers
from replay.job import ReplayJob, ReplayResult, SourceSpec, close_sources
from replay.states import PreparedStates, build_states, stage_factory
from replay.survivors import CountingSource, as_text, record_rates
from trainer_client.checkpoint import load_checkpoint
from trainer_client.errors import CheckpointError, RecoveryFailedError
from trainer_client.mesh import MeshLayout
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys

__all__ = [
    "RecoveredStage",
    "checkpoint_alone",
    "member_recovery",
    "read_per_source",
    "recovered_objects",
    "replay_replicas",
    "replay_unit",
    "replayed",
    "unit_of",
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


def checkpoint_alone(
    job: ReplayJob,
    stage: int,
    factory: Callable[..., Any] | None,
    prepared: PreparedStates | None,
    ck_uri: str,
    t0: float,
    t_survivors: float,
    why: str,
) -> RecoveredStage:
    """Nothing to replay (the checkpoint is at the resume iteration): ``stage`` loaded from it."""
    try:
        mine = next(st for st in build_states(job, factory, prepared) if st.stage == stage)
    except (ReplayError, CheckpointError) as e:
        # a factory that does not fit the checkpoint: the same fallback as a replay's
        raise ReplacementFallback(
            f"loading stage {stage}'s checkpoint at {job.stop_iteration} (nothing to replay) failed: {e}"
        ) from e
    resume = job.stop_iteration
    timings = {"wait_survivors_s": t_survivors - t0, "fetch_s": time.monotonic() - t_survivors, "replay_s": 0.0}
    return RecoveredStage(
        mine.module, mine.optimizer, mine.lr_scheduler, resume, resume, ck_uri, True, 0, 0, 0, timings, why=why
    )


def replayed(
    res: ReplayResult,
    job: ReplayJob,
    stage: int,
    opened: Sequence[CountingSource],
    ck_it: int,
    ck_uri: str,
    marks: dict[str, float],
    t0: float,
    why: str,
    model: str | None,
    model_args: dict[str, Any] | None,
    factory: Callable[..., Any] | None,
) -> RecoveredStage:
    """``stage`` as a verified replay left it, with what the replay read and how long each phase
    took (``marks``: the phases before it)."""
    st_mod, st_opt, st_sched = recovered_objects(res, job, stage, model, model_args, factory)
    rep = res.report
    timings = {
        **marks,
        "setup_s": res.setup_seconds,  # checkpoint load + stage build (+ the replay workers' rendezvous)
        "build_s": res.build_seconds,  # of which the stage build (slowest worker; ~0 when built ahead)
        "fetch_s": rep.fetch_seconds,  # reading/decoding records (partly overlapped with compute by prefetch)
        "replay_s": res.replay_seconds,
        "reduce_s": rep.reduce_seconds,  # parallel replay: gradient exchange, waits included
        "step_s": rep.step_seconds,  # optimizer + lr-scheduler steps
        "workers": res.job.workers,  # processes that replayed (the replacement and its helpers)
        "total_s": time.monotonic() - t0,
    }
    return RecoveredStage(
        st_mod,
        st_opt,
        st_sched,
        job.stop_iteration,
        ck_it,
        ck_uri,
        True,
        rep.digests_checked,
        rep.records_fetched,
        sum(s.bytes for s in opened),
        timings,
        list(rep.warnings),
        why=why,
        sources=read_per_source(job.sources, opened),
    )


def member_recovery(
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
        sources=read_per_source(job.sources, opened),
    )


def read_per_source(specs: Sequence[SourceSpec], opened: Sequence[CountingSource]) -> list[dict[str, Any]]:
    """What a replay read from each source, in the order asked: kind, location, records, bytes, seconds."""
    return [
        {"kind": spec.kind, "location": spec.location, "records": s.records, "bytes": s.bytes, "seconds": s.seconds}
        for spec, s in zip(specs, opened, strict=True)
    ]


def unit_of(stage: int, members: list[int], failed: list[int], in_place: bool = False) -> list[int]:
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


def replay_replicas(
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


def replay_unit(
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


def recovered_objects(
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
