"""Recovering a lost FSDP shard: its whole shard group replays, the live members in place.

A ``fully_shard``-ed stage gathers its parameters from every member of its shard group in each
forward and backward, and reduce-scatters its gradients over them. A lost shard has no copy
(without a replica, ``trainer_client.mesh.recovery_paths`` gives the path ``"shard"``), so the
group goes back to a checkpoint all its members have and replays together:

1. every member, live or replacement, publishes the checkpoints it has at or below the resume
   iteration, and all take the newest one common to them (:func:`shard_checkpoint`);
2. they meet in a process group of their own (the shard group's members in shard order,
   :func:`join_shard_group`); a live member loads its own shard of that checkpoint (DCP) into its
   live objects (:func:`replay_shard_in_place`), a replacement into the objects its factory builds
   over that group (``shard_mesh=``);
3. each replays its own pipeline's logs (what its neighbours sent it, its META), the FSDP
   collectives repeated over the group with the same participants in the same order
   (:func:`replay_shard_member`), and publishes its report; the replay counts only when every
   member's verified. The group is destroyed; the survivors' ``ResilientLoop`` forms the next
   generation, where ``client.pipeline_stage`` rebinds every module to its new shard group.

Every member computes what it computed live, from the same inputs, with collectives over the same
members: the recovered shards equal the failure-free run's bit for bit on CPU.

Never: lets a member keep a replay the group did not verify; waits without a deadline.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replay.checkpoints import _checkpoint_iterations
from replay.core import replay_stages
from replay.errors import ReplayError
from replay.job import DEFAULT_PREFETCH, SourceSpec, close_sources
from replay.report import ReplayReport
from replay.stage import StageState
from replay.survivors import (
    CountingSource,
    agreed_resume,
    committed_metas,
    sources_from_reports,
    survivor_reports,
)
from trainer_client import fsdp
from trainer_client.checkpoint import load_checkpoint
from trainer_client.config import ClientConfig
from trainer_client.errors import CheckpointError, RecoveryFailedError
from trainer_client.mesh import MeshLayout
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys

__all__ = [
    "ShardPlan",
    "ShardReplay",
    "join_shard_group",
    "plan_shard_replay",
    "replay_shard_group",
    "replay_shard_in_place",
    "replay_shard_member",
    "shard_checkpoint",
]

logger = logging.getLogger(__name__)


def _prefix(keys: RecoveryKeys, g: int, layout: MeshLayout, rank: int) -> str:
    c = layout.coord(rank)
    return f"{keys.base}/gen{g}/shards/{c.stage}.{c.replica}"


def shard_checkpoint(
    store: dist.Store,
    keys: RecoveryKeys,
    g: int,
    layout: MeshLayout,
    rank: int,
    base: str,
    resume: int,
    storage_options: dict[str, Any] | None,
    timeout: datetime.timedelta,
) -> tuple[int, str]:
    """Step 1: ``(iteration, URI)`` of this rank's checkpoint at the newest iteration every member
    of its shard group has at or below ``resume`` (its own are under ``base``). Raises ReplayError
    when they have none in common."""
    c, prefix = layout.coord(rank), _prefix(keys, g, layout, rank)
    its = _checkpoint_iterations(base, c.stage, storage_options)
    store.set(f"{prefix}/checkpoints/{c.shard}", json.dumps(sorted(i for i in its if i <= resume)))
    got = wait_for_keys(
        store,
        [f"{prefix}/checkpoints/{s}" for s in range(layout.dp_shard)],
        timeout=timeout,
        what=f"{layout.describe(rank)}: the checkpoints of its shard group's members",
    )
    common = set.intersection(*(set(json.loads(v)) for v in got.values()))
    if not common:
        raise ReplayError(
            f"the shard group of stage {c.stage} (replica {c.replica}) has no checkpoint at or below iteration "
            f"{resume} that every member has: { ({k: json.loads(v) for k, v in got.items()}) }"
        )
    return max(common), its[max(common)]


def join_shard_group(
    store: dist.Store, keys: RecoveryKeys, g: int, layout: MeshLayout, rank: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """Step 2: the default process group of this rank's shard group (its shard is its rank). The
    caller destroys it (``dist.destroy_process_group``) after the replay. Raises
    RecoveryFailedError when a default group exists (the failed one must be gone first)."""
    if dist.is_initialized():
        raise RecoveryFailedError(f"{layout.describe(rank)}: a process group is still up; the shard group cannot form")
    c = layout.coord(rank)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{_prefix(keys, g, layout, rank)}/pg", store),
        rank=c.shard,
        world_size=layout.dp_shard,
        timeout=timeout,
    )
    return dist.group.WORLD


def replay_shard_member(
    store: dist.Store,
    keys: RecoveryKeys,
    g: int,
    layout: MeshLayout,
    rank: int,
    state: StageState,
    sources: Sequence[Any],
    *,
    resume: int,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    timeout: datetime.timedelta,
) -> ReplayReport:
    """Step 3 in the shard group's process group (the default one): ``state`` (loaded from the
    agreed checkpoint) rebound to it and replayed to ``resume`` from ``sources`` (this rank's
    pipeline's logs). Returns this member's report once every member's is in and verified;
    raises ReplayError otherwise."""
    prefix = _prefix(keys, g, layout, rank)
    me = layout.coord(rank).shard
    fsdp.rebind(state.module, dist.group.WORLD)
    try:
        report = replay_stages(  # records fetched ahead, beside the compute, as a replacement's replay does
            [state],
            list(sources),
            num_stages=layout.num_stages,
            stop_iteration=resume,
            loss_fn=loss_fn,
            prefetch=DEFAULT_PREFETCH,
        )
        doc = {"ok": report.ok, "digests_checked": report.digests_checked, "why": report.unverified_reason}
    except Exception as e:
        store.set(f"{prefix}/report/{me}", json.dumps({"ok": False, "why": f"{type(e).__name__}: {e}"[:500]}))
        raise
    store.set(f"{prefix}/report/{me}", json.dumps(doc))
    got = wait_for_keys(
        store,
        [f"{prefix}/report/{s}" for s in range(layout.dp_shard)],
        timeout=timeout,
        what=f"{layout.describe(rank)}: the reports of its shard group's replay",
    )
    docs = {k: json.loads(v) for k, v in got.items()}
    bad = {k.rsplit("/", 1)[-1]: d.get("why") for k, d in docs.items() if not d.get("ok")}
    if bad:
        raise ReplayError(f"the shard group's replay did not verify: shard(s) {bad}")
    if sum(int(d.get("digests_checked") or 0) for d in docs.values()) == 0:
        raise ReplayError("the shard group's replay checked no send against a digest")
    return report


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What a member of a lost shard's group replays: from ``checkpoint_uri`` (at
    ``checkpoint_iteration``) to ``resume``, reading ``sources`` (its pipeline's survivors, its
    cold tier, the committed META), under the run ``log_run``."""

    resume: int
    checkpoint_iteration: int
    checkpoint_uri: str
    sources: list[SourceSpec]
    log_run: str

    def open(self) -> list[CountingSource]:
        """The sources opened for ``log_run``, counting what is read."""
        return [CountingSource(s.open(self.log_run)) for s in self.sources]


def plan_shard_replay(
    store: dist.Store,
    keys: RecoveryKeys,
    g: int,
    layout: MeshLayout,
    rank: int,
    docs: dict[int, dict[str, Any]],
    *,
    run_id: str,
    checkpoint_url: str,
    storage_options: dict[str, Any] | None,
    timeout: datetime.timedelta,
) -> ShardPlan:
    """Steps 1 for ``rank`` given the survivors' reports ``docs`` (by rank): the resume iteration,
    the agreed checkpoint, and the sources of its own pipeline."""
    resume = agreed_resume(docs, g)
    ck_it, uri = shard_checkpoint(store, keys, g, layout, rank, checkpoint_url, resume, storage_options, timeout)
    dp = layout.dp_index(rank)
    mine = {layout.coord(r).stage: d for r, d in docs.items() if layout.dp_index(r) == dp}
    sources = sources_from_reports(mine)
    metas = committed_metas(store, keys, [layout.coord(rank).stage], range(ck_it, resume), [rank])
    if metas is not None:
        sources = [metas, *sources]
    return ShardPlan(resume, ck_it, uri, sources, layout.log_run(run_id, rank))


@dataclass(slots=True)
class ShardReplay:
    """What :func:`replay_shard_group` did for one member: its plan, its replayed state, its report,
    the sources it read (closed; their counts stay), and when its objects were ready."""

    plan: ShardPlan
    state: StageState
    report: ReplayReport
    opened: list[CountingSource]
    t_built: float


def replay_shard_group(
    store: dist.Store,
    keys: RecoveryKeys,
    g: int,
    layout: MeshLayout,
    rank: int,
    docs: dict[int, dict[str, Any]],
    *,
    run_id: str,
    checkpoint_url: str,
    storage_options: dict[str, Any] | None,
    objects: Callable[[Any, Any], tuple[torch.nn.Module, torch.optim.Optimizer, Any]],
    loss_fn: Callable[..., torch.Tensor] | None,
    timeout: datetime.timedelta,
) -> ShardReplay:
    """Steps 1-3 for ``rank``, a member of a lost shard's group, live or replacement:
    ``objects(checkpoint, mesh)`` gives the stage's module, optimizer and scheduler (a live
    member's own; a replacement's built ``fully_shard``-ed over ``mesh``, the group's), into which
    the agreed checkpoint is loaded before the replay. The group is destroyed before returning.
    Raises what the plan, the load and the replay raise (ReplayError, CheckpointError, ...)."""
    plan = plan_shard_replay(
        store,
        keys,
        g,
        layout,
        rank,
        docs,
        run_id=run_id,
        checkpoint_url=checkpoint_url,
        storage_options=storage_options,
        timeout=timeout,
    )
    opened: list[CountingSource] = []
    group = join_shard_group(store, keys, g, layout, rank, timeout)
    try:
        ck = load_checkpoint(plan.checkpoint_uri, storage_options=storage_options)
        c = layout.coord(rank)
        state = StageState.from_checkpoint(
            ck, *objects(ck, fsdp.shard_mesh(layout.shard_group(c.stage, c.replica), group, rank))
        )
        t_built = time.monotonic()
        opened = plan.open()
        rep = replay_shard_member(
            store, keys, g, layout, rank, state, opened, resume=plan.resume, loss_fn=loss_fn, timeout=timeout
        )
    finally:
        close_sources([s.inner for s in opened])
        dist.destroy_process_group()
    return ShardReplay(plan, state, rep, opened, t_built)


def replay_shard_in_place(
    store: dist.Store,
    config: ClientConfig,
    generation: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=300),
) -> int:
    """A live member of a lost shard's group (``ResilientLoop(replay_shards=...)`` calls it once
    the failed group is down): load this rank's shard of the agreed checkpoint into ``module`` /
    ``optimizer`` / ``lr_scheduler`` and replay with the group (module docstring). Returns the
    iteration reached (the survivors' resume iteration). Raises RecoveryFailedError when it cannot:
    the caller's state is then not usable and the scheduler rolls every stage back."""
    layout, rank = config.layout, config.rank
    keys = RecoveryKeys(config.run_id, config.commit_prefix)
    t0 = time.monotonic()
    try:
        _, docs = survivor_reports(store, keys, generation, layout, timeout, who=layout.describe(rank))
        done = replay_shard_group(
            store,
            keys,
            generation,
            layout,
            rank,
            docs,
            run_id=config.run_id,
            checkpoint_url=config.resolved_checkpoint_url(),
            storage_options=config.checkpoint_options(),
            objects=lambda ck, mesh: (module, optimizer, lr_scheduler),
            loss_fn=loss_fn,
            timeout=timeout,
        )
    except (ReplayError, CheckpointError, OSError) as e:
        raise RecoveryFailedError(f"{layout.describe(rank)}: the in-place replay of its shard group failed: {e}") from e
    logger.warning(
        "%s: replayed in place with its shard group from checkpoint %d to %d in %.2f s (%d records, %d digests)",
        layout.describe(rank),
        done.plan.checkpoint_iteration,
        done.plan.resume,
        time.monotonic() - t0,
        done.report.records_fetched,
        done.report.digests_checked,
    )
    return done.plan.resume
