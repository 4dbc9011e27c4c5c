"""A logging group replayed as a pipeline across its members' processes (``replay.group_replay``):
each member replays its own stage in its own process, the group-internal sends going member to
member over gloo, the group's edges read from the logs. Real processes, bit-exact against the
live run, for 1F1B (groups [2, 2]: both groups, one of them holding the loss) and GPipe (group
[1, 2, 3]: a middle member with a neighbour on each side)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replay import plan_recovery
from replay.compare import states_equal
from replay.job import ReplayJob, jobs_from_plan, open_sources
from tests._replay_helpers import ITERS, NUM_STAGES

pytest_plugins = ["tests._replay_fixtures"]


def _member(index: int, port: int, job_doc: dict[str, Any], out: str) -> None:
    from replay.group_replay import member_group, replay_member
    from replay.states import build_states

    job = ReplayJob.from_dict(job_doc)
    stage = job.stages[index]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = member_group(store, "group", index, len(job.stages), datetime.timedelta(seconds=60))
    (state,) = build_states(job.replace(stages=[stage], checkpoints={stage: job.checkpoints[stage]}))
    report = replay_member(
        state,
        job.stages,
        open_sources(job.sources, job.run),
        group=group,
        num_stages=job.num_stages,
        stop_iteration=job.stop_iteration,
    )
    torch.save(
        {
            "model": state.module.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "lr_scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
            "report": report.to_dict(),
        },
        Path(out) / f"stage{stage}.pt",
    )


def _replay_group(run: Any, failed: int, tmp_path: Path) -> tuple[ReplayJob, dict[int, dict[str, Any]]]:
    from trainer_client import loopback_store

    with run.store() as st:
        plan = plan_recovery(st, [failed])
    (job,) = jobs_from_plan(plan, sources=[run.spec()], **run.job_fields())
    host = loopback_store()
    mp.start_processes(
        _member, args=(host.port, job.to_dict(), str(tmp_path)), nprocs=len(job.stages), start_method="spawn"
    )
    return job, {k: torch.load(tmp_path / f"stage{k}.pt", weights_only=False) for k in job.stages}


@pytest.mark.slow
@pytest.mark.parametrize(("failed", "group"), [(1, [0, 1]), (2, [2, 3])], ids=["first-group", "last-group"])
def test_a_1f1b_group_replays_as_a_pipeline_of_its_members(groups_run, tmp_path: Path, failed, group) -> None:
    job, got = _replay_group(groups_run, failed, tmp_path)
    assert job.stages == group and job.stop_iteration == ITERS
    for k in group:
        live = {p: groups_run.results[k][p] for p in ("model", "optimizer", "lr_scheduler")}
        assert states_equal({p: got[k][p] for p in live}, live) == [], f"stage {k}"
    edge = group[-1] if group[-1] < NUM_STAGES - 1 else group[0]  # the member whose sends leave the group
    assert got[edge]["report"]["digests_checked"] > 0 and not got[edge]["report"]["digest_mismatches"]


@pytest.mark.slow
def test_a_gpipe_group_of_three_replays_with_a_middle_member(groups_gpipe_run, tmp_path: Path) -> None:
    job, got = _replay_group(groups_gpipe_run, 2, tmp_path)
    assert job.stages == [1, 2, 3]
    for k in job.stages:
        live = {p: groups_gpipe_run.results[k][p] for p in ("model", "optimizer", "lr_scheduler")}
        assert states_equal({p: got[k][p] for p in live}, live) == [], f"stage {k}"
