"""Recovering a logging group in place: its live members replay with the replacement, nobody is killed.

When a stage of a logging group fails, the group must go back to its checkpoint (its inside sends
were not logged). With in-place group recovery the scheduler replaces only the failed stage; the
group's live members stay in their processes:

1. the replacement (the lowest failed stage of the group leads) plans as any replacement does
   (the group's newest common checkpoint, the records of the group's edges, the committed META)
   and publishes the group's job (``RecoveryKeys.group_job``);
2. every member, live or replacement, loads its own stage's checkpoint (a live member into its own
   objects: :func:`replay_in_place`), meets the others in a process group of the members, and
   replays its stage as one member of the group's pipeline (``replay.group_replay.replay_member``);
3. each member publishes its report; the group's replay counts as verified when no member found a
   mismatch and the group's edge sends were checked (:func:`group_verified`). A live member then
   rejoins with the survivors; the replacement reports ready as usual.

Never: lets a member apply a replay the group did not verify.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replay.errors import ReplacementFallback, ReplayError
from replay.group_replay import member_group, replay_member
from replay.job import ReplayJob, close_sources, open_sources
from replay.report import ReplayReport
from replay.stage import StageState
from replay.states import loss_and_data
from trainer_client.checkpoint import load_checkpoint
from trainer_client.errors import CheckpointError, RecoveryFailedError
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys

__all__ = ["group_verified", "replay_as_member", "replay_in_place"]

logger = logging.getLogger(__name__)


def replay_as_member(
    store: dist.Store,
    keys: RecoveryKeys,
    generation: int,
    state: StageState,
    job: ReplayJob,
    *,
    lead: bool,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    timeout: datetime.timedelta,
    sources: Sequence[Any] | None = None,
) -> ReplayReport:
    """Step 2 and 3 for ``state`` (loaded from ``job``'s checkpoint): replay it as a member of the
    group ``job.stages``; ``lead`` publishes the job first. ``sources``: ``job.sources`` opened by
    the caller (who closes them), e.g. to count what is read; default: opened and closed here.
    Returns this member's report once every member's is in and the group verified; raises
    ReplayError otherwise."""
    members, first = list(job.stages), job.stages[0]
    if lead:
        store.set(keys.group_job(generation, first), json.dumps(job.to_dict()))
    group = member_group(
        store, keys.group_rendezvous(generation, first), members.index(state.stage), len(members), timeout
    )
    mine = sources is None
    if sources is None:
        sources = open_sources(job.sources, job.run)
    seed = state.checkpoint.seed if state.checkpoint is not None else 0
    loss_fn, data_source = loss_and_data(job, seed, loss_fn, None)
    try:
        report = replay_member(
            state,
            members,
            sources,
            group=group,
            num_stages=job.num_stages,
            stop_iteration=job.stop_iteration,
            loss_fn=loss_fn,
            data_source=data_source,
            timeout=timeout,
        )
        doc = {"ok": report.ok, "digests_checked": report.digests_checked, "why": report.unverified_reason}
    except Exception as e:
        store.set(keys.group_report(generation, state.stage), json.dumps({"ok": False, "why": f"{e}"[:500]}))
        raise
    finally:
        if mine:
            close_sources(sources)
    store.set(keys.group_report(generation, state.stage), json.dumps(doc))
    ok, why = group_verified(store, keys, generation, members, timeout)
    if not ok:
        raise ReplayError(f"the in-place replay of group {members} did not verify: {why}")
    return report


def group_verified(
    store: dist.Store, keys: RecoveryKeys, generation: int, members: Sequence[int], timeout: datetime.timedelta
) -> tuple[bool, str]:
    """Whether every member's replay was clean and the group's edge sends were checked (waits for
    every member's report, at most ``timeout``)."""
    got = wait_for_keys(
        store,
        [keys.group_report(generation, k) for k in members],
        timeout=timeout,
        what=f"the reports of group {list(members)}'s in-place replay",
    )
    docs = {k: json.loads(got[keys.group_report(generation, k)]) for k in members}
    bad = {k: d.get("why") for k, d in docs.items() if not d.get("ok")}
    if bad:
        return False, f"member(s) failed: {bad}"
    if sum(int(d.get("digests_checked") or 0) for d in docs.values()) == 0:
        return False, "no send at the group's edges was checked against a digest"
    return True, ""


def replay_in_place(
    store: dist.Store,
    run_id: str,
    generation: int,
    stage: int,
    members: Sequence[int],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    *,
    commit_prefix: str | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=300),
) -> int:
    """A live member of a failed logging group: load its checkpoint into ``module``/``optimizer``/
    ``lr_scheduler`` and replay with the group (module docstring). Returns the iteration reached
    (the survivors' resume iteration). Raises RecoveryFailedError when it cannot (the job never
    came, the checkpoint does not load, the group's replay failed or did not verify): the caller's
    state is then not usable and the scheduler rolls every stage back."""
    keys = RecoveryKeys(run_id, commit_prefix)
    first = members[0]
    got = wait_for_keys(
        store,
        [keys.group_job(generation, first)],
        timeout=timeout,
        what=f"stage {stage}: the job of group {list(members)}'s in-place replay",
        abort_keys=[keys.fallback(generation)],
    )
    job = ReplayJob.from_dict(json.loads(got[keys.group_job(generation, first)]))
    t0 = time.monotonic()
    try:
        ck = load_checkpoint(job.checkpoints[stage], storage_options=dict(job.checkpoint_options))
        state = StageState.from_checkpoint(ck, module, optimizer, lr_scheduler)
        rep = replay_as_member(store, keys, generation, state, job, lead=False, loss_fn=loss_fn, timeout=timeout)
        report_note = (
            f"replay {rep.seconds:.2f} s, compute {rep.compute_seconds:.2f} s, fetch {rep.fetch_seconds:.2f} s, "
            + "; ".join(rep.warnings[-1:])
        )
    except (ReplayError, CheckpointError, ReplacementFallback, OSError) as e:
        raise RecoveryFailedError(f"stage {stage}: the in-place replay of group {list(members)} failed: {e}") from e
    logger.warning(
        "stage %d: replayed in place with group %s from checkpoint %d to %d in %.2f s (%s)",
        stage,
        list(members),
        ck.iteration,
        job.stop_iteration,
        time.monotonic() - t0,
        report_note,
    )
    return job.stop_iteration
