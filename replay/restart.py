"""A torchrun restart made cheap: survivors resume from their snapshots, only the lost ranks replay.

torchrun stops every worker when one fails and starts them all again (``--max-restarts``). With
``RecoveryConfig.snapshot_dir`` each survivor saved its state at the agreed resume iteration
before it went (``trainer_client.snapshots``). In the next attempt every rank calls
:func:`recover_on_restart` before it trains:

1. each rank says whether it found its own snapshot of the previous attempt (same run, same rank,
   same mesh coordinate) and the newest checkpoint every stage of its pipeline has;
2. if the snapshots agree on one (iteration, generation), the ranks without one (the lost rank,
   a survivor killed before its snapshot was written, a rank torchrun placed on another node)
   replay from their checkpoints to that iteration with :func:`replay.recover_stage`, reading the
   survivors' reports and logs of the previous attempt's failed generation; with
   ``replay_helpers=H``, H survivors per lost rank (they have nothing else to do until the replay
   ends) share its replay as SWIFT's parallel recovery does (``replay.helpers``);
3. every rank says whether that worked; all apply what they have, or (no snapshot, disagreeing
   snapshots, a replay that failed) every rank rolls back to the newest common checkpoint.

Where it does not hold: a snapshot lives as long as its directory (``/dev/shm`` dies with a
Kubernetes pod or the machine); a rank that torchrun moves to another node finds no snapshot and
replays; the lost rank's replay reads the survivors' store roots, so across nodes it needs a cold
tier (or ``swiftlog agent``, which serves hot tiers over HTTP).

Never: applies a snapshot unless every rank agreed on the same start; decides alone.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replay.checkpoints import common_checkpoint
from replay.errors import ReplacementFallback
from replay.helpers import serve_replay_helper
from replay.replacement import RecoveredStage, recover_stage
from trainer_client.checkpoint import checkpoint_uri, load_checkpoint
from trainer_client.config import ENV_RESTART_COUNT
from trainer_client.errors import RecoveryFailedError
from trainer_client.mesh import MeshLayout
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys
from trainer_client.snapshots import load_snapshot, snapshot_path

__all__ = ["RestartDecision", "recover_on_restart"]

logger = logging.getLogger(__name__)


@dataclass
class RestartDecision:
    """What this rank starts from in this attempt.

    ``how``: "fresh" (the first attempt: nothing to recover), "snapshot" (its own survivor
    snapshot), "replay" (replayed from its checkpoint to the survivors' iteration), "rollback"
    (every rank from the newest common checkpoint, ``start``; None: none, from scratch).
    ``start``: the iteration to train from. ``why``: a sentence for the log.
    """

    how: str
    start: int | None
    why: str
    checkpoint_url: str = ""
    stage: int = 0
    state: dict[str, Any] | None = None
    recovered: RecoveredStage | None = None

    def apply(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> int:
        """Load the decided state into the caller's objects; the iteration to start at (0: fresh)."""
        if self.how == "snapshot":
            assert self.state is not None
            _load(module, optimizer, lr_scheduler, self.state)
        elif self.how == "replay":
            assert self.recovered is not None
            rec = self.recovered
            state = {
                "model": rec.module.state_dict(),
                "optimizer": rec.optimizer.state_dict(),
                "lr_scheduler": rec.lr_scheduler.state_dict() if rec.lr_scheduler is not None else None,
            }
            _load(module, optimizer, lr_scheduler, state)
        elif self.how == "rollback" and self.start is not None:
            load_checkpoint(checkpoint_uri(self.checkpoint_url, self.stage, self.start)).apply(
                module, optimizer, lr_scheduler
            )
        return self.start or 0


def _load(module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, state: dict[str, Any]) -> None:
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # it aliases the tensors it is given
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])


def _prefix(run_id: str, attempt: int) -> str:
    return f"swiftlog/{run_id}" + (f"/restart{attempt}" if attempt else "")


def recover_on_restart(
    store: dist.Store,
    *,
    run_id: str,
    stage: int,
    num_stages: int,
    checkpoint_url: str,
    snapshot_dir: str,
    replica: int = 0,
    dp_replicate: int = 1,
    timeout: datetime.timedelta = datetime.timedelta(seconds=600),
    replay_helpers: int = 0,
    **replay_kwargs: Any,
) -> RestartDecision:
    """Decide, with every other rank, where this rank starts in this torchrun attempt (module docstring).

    ``checkpoint_url``: this rank's resolved checkpoint base (``ClientConfig.resolved_checkpoint_url()``).
    ``replay_kwargs`` go to :func:`replay.recover_stage` for a rank that replays (``model`` or
    ``factory``, ``model_args``, ``data_source``, ``n_microbatches``...). Every rank must call it
    (it waits for all of them, at most ``timeout``). Raises RecoveryFailedError when the ranks do
    not all answer in time.
    """
    attempt = int(os.environ.get(ENV_RESTART_COUNT, "0").strip() or 0)
    if attempt == 0:
        return RestartDecision("fresh", None, "the first attempt", checkpoint_url, stage)
    layout = MeshLayout(num_stages, dp_replicate)
    rank, world = layout.rank(stage, replica), layout.world_size
    previous, here = _prefix(run_id, attempt - 1), _prefix(run_id, attempt)
    snap = load_snapshot(snapshot_dir, run_id, rank)
    if snap is not None and (snap["commit_prefix"] != previous or snap["stage"] != stage or snap["replica"] != replica):
        snap = None  # an older attempt's, or another coordinate's
    common = common_checkpoint(checkpoint_url, num_stages, 1 << 40)
    mine = {"snapshot": [snap["iteration"], snap["generation"]] if snap else None, "common": common}
    docs = _round(store, f"{here}/restart/have", rank, world, mine, timeout)
    holders = {r: tuple(d["snapshot"]) for r, d in docs.items() if d["snapshot"] is not None}
    commons = [d["common"] for d in docs.values()]
    rollback_to = None if any(c is None for c in commons) else min(commons)
    points = set(holders.values())
    if len(points) != 1:
        why = "no survivor left a snapshot" if not points else f"the snapshots disagree: {sorted(points)}"
        return _rollback(rollback_to, why, checkpoint_url, stage)
    (target, generation) = points.pop()
    lost = sorted(r for r in range(world) if r not in holders)
    outcome: dict[str, Any] = {"ok": True}
    decision: RestartDecision
    helping = helper_assignment(lost, sorted(holders), replay_helpers if dp_replicate == 1 else 0)
    if rank in holders:
        decision = RestartDecision(
            "snapshot", target, f"own snapshot at iteration {target}", checkpoint_url, stage, state=snap
        )
        if rank in helping:
            lost_rank, helper_rank = helping[rank]
            _help(store, run_id, previous, generation, lost_rank, helper_rank, timeout, replay_kwargs)
    else:
        replay_kwargs["helpers"] = sum(1 for lost_rank, _ in helping.values() if lost_rank == rank)
        decision, outcome = _replay(
            store,
            run_id,
            stage,
            num_stages,
            checkpoint_url,
            replica,
            dp_replicate,
            previous,
            generation,
            target,
            lost,
            rank,
            timeout,
            replay_kwargs,
        )
    outcomes = _round(store, f"{here}/restart/outcome", rank, world, outcome, timeout)
    failed = {r: o["why"] for r, o in outcomes.items() if not o["ok"]}
    if failed:
        return _rollback(rollback_to, f"the replay of rank(s) {sorted(failed)} failed: {failed}", checkpoint_url, stage)
    if snap is not None:
        snapshot_path(snapshot_dir, run_id, rank).unlink(missing_ok=True)  # used: not for a later attempt
    logger.warning("rank %d: restart %d: %s (lost: %s)", rank, attempt, decision.why, lost)
    return decision


def helper_assignment(lost: list[int], survivors: list[int], per_lost: int) -> dict[int, tuple[int, int]]:
    """survivor rank -> (the lost rank it helps, its helper rank 1..): ``per_lost`` survivors per
    lost rank, in order, while survivors last (a pure function: every rank computes the same)."""
    out: dict[int, tuple[int, int]] = {}
    it = iter(survivors)
    for lost_rank in lost:
        for helper_rank in range(1, per_lost + 1):
            survivor = next(it, None)
            if survivor is None:
                return out
            out[survivor] = (lost_rank, helper_rank)
    return out


def _help(
    store: dist.Store,
    run_id: str,
    previous: str,
    generation: int,
    lost_rank: int,
    helper_rank: int,
    timeout: datetime.timedelta,
    replay_kwargs: dict[str, Any],
) -> None:
    """Serve as replay helper ``helper_rank`` of ``lost_rank`` (a stage: no replicas here); a failure
    is logged, never raised (the lost rank then replays alone). The caller's torch thread count
    and random generators are as they were before."""
    threads = torch.get_num_threads()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            serve_replay_helper(
                store,
                run_id,
                generation,
                lost_rank,
                helper_rank,
                factory=replay_kwargs.get("factory"),
                loss_fn=replay_kwargs.get("loss_fn"),
                timeout=timeout,
                commit_prefix=previous,
            )
    except Exception as e:  # the replacement replays alone when its helpers fail
        logger.warning("replay helper %d of rank %d failed: %s: %s", helper_rank, lost_rank, type(e).__name__, e)
    finally:
        torch.set_num_threads(threads)


def _replay(
    store: dist.Store,
    run_id: str,
    stage: int,
    num_stages: int,
    checkpoint_url: str,
    replica: int,
    dp_replicate: int,
    previous: str,
    generation: int,
    target: int,
    lost: list[int],
    rank: int,
    timeout: datetime.timedelta,
    replay_kwargs: dict[str, Any],
) -> tuple[RestartDecision, dict[str, Any]]:
    """This lost rank replays to ``target`` as the replacement of the previous attempt's failed generation."""
    keys = RecoveryKeys(run_id, previous)
    if rank == lost[0]:  # what a scheduler writes in place: which ranks the replacements stand for
        store.set(keys.failed_stages(generation), json.dumps(lost))
    try:
        rec = recover_stage(
            store,
            run_id=run_id,
            stage=stage,
            num_stages=num_stages,
            generation=generation,
            checkpoint_url=checkpoint_url,
            sources=replay_kwargs.pop("sources", None),
            commit_prefix=previous,
            replica=replica,
            dp_replicate=dp_replicate,
            timeout=timeout,
            **replay_kwargs,
        )
    except (ReplacementFallback, RecoveryFailedError) as e:
        why = f"{type(e).__name__}: {e}"
        return RestartDecision("rollback", None, why, checkpoint_url, stage), {"ok": False, "why": why[:500]}
    if rec.resume != target:
        why = f"replayed to {rec.resume}, the snapshots are at {target}"
        return RestartDecision("rollback", None, why, checkpoint_url, stage), {"ok": False, "why": why}
    why = f"replayed from checkpoint {rec.checkpoint_iteration} to {target} ({rec.path})"
    return RestartDecision("replay", target, why, checkpoint_url, stage, recovered=rec), {"ok": True}


def _rollback(to: int | None, why: str, checkpoint_url: str, stage: int) -> RestartDecision:
    where = f"checkpoint {to}" if to is not None else "scratch (no common checkpoint)"
    return RestartDecision("rollback", to, f"global rollback to {where}: {why}", checkpoint_url, stage)


def _round(
    store: dist.Store, prefix: str, rank: int, world: int, mine: dict[str, Any], timeout: datetime.timedelta
) -> dict[int, dict[str, Any]]:
    """Publish ``mine`` under ``prefix`` and wait for every rank's; rank -> document."""
    store.set(f"{prefix}/{rank}", json.dumps(mine))
    got = wait_for_keys(
        store,
        [f"{prefix}/{r}" for r in range(world)],
        timeout=timeout,
        what=f"rank {rank}: waiting for every rank at {prefix}",
    )
    return {r: json.loads(got[f"{prefix}/{r}"]) for r in range(world)}
