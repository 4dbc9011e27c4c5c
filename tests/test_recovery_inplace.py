"""In-place recovery end to end: survivors keep their state, the lost stage is replayed and rejoins,
and the final state of EVERY stage equals a failure-free run's bit for bit.

Matrix: first / middle / last stage x GPipe / 1F1B x forward / backward, then the other phases
(commit, optimizer step, checkpoint write), logged data instead of a data source, two failures
(one after the other; two stages at once), global rollback, and the fallback to a rollback when
the logs are gone. Iterations 0..5, checkpoints at 2 and 4, failures mid-interval at 3 or 5.
Each result is compared with a failure-free run of the same arguments, run once and shared
(the ``references`` fixture, :class:`tests._recovery_helpers.References`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replay.compare import states_equal
from replay.launcher import KillSpec, RecoveryRun, resumed_after_rollback
from tests._recovery_helpers import PG_TIMEOUT_S, References, assert_same_as, run


def _check_recovered(r: RecoveryRun, failed: list[int], resume: int) -> None:
    assert r.fallback is None
    assert [t["failed_stages"] for t in r.timings][:1] == [failed]
    t = r.timings[0]
    assert t["resume"] == resume
    assert t["verified"] is True
    assert t["detect_s"] < PG_TIMEOUT_S, t  # a communication error or the heartbeat: never the process group's timeout


#: the kill matrix's cases in the fast tier, one per schedule; the other ten are slow
FAST_KILLS = {("1f1b", 1, "forward"), ("gpipe", 3, "backward")}


@pytest.mark.parametrize(
    ("schedule", "stage", "phase"),
    [
        pytest.param(s, k, p, marks=() if (s, k, p) in FAST_KILLS else pytest.mark.slow, id=f"{p}-{k}-{s}")
        for s in ("gpipe", "1f1b")
        for k in (0, 1, 3)
        for p in ("forward", "backward")
    ],
)
def test_kill_stage_in_compute(
    references: References,
    tmp_path: Path,
    schedule: str,
    stage: int,
    phase: str,
) -> None:
    r = run(tmp_path, schedule, [KillSpec(stage, 3, 1, phase)])
    _check_recovered(r, [stage], 3)
    assert r.timings[0]["checkpoint_iteration"] == 2
    assert r.timings[0]["records_fetched"] > 0
    assert_same_as(r, references.get(schedule))


@pytest.mark.parametrize(
    "phase,resume",
    [
        ("commit", 3),
        pytest.param("optimizer", 4, marks=pytest.mark.slow),
        pytest.param("checkpoint", 4, marks=pytest.mark.slow),
    ],
)
def test_kill_stage_outside_compute(references: References, tmp_path: Path, phase: str, resume: int) -> None:
    """commit: dies before reporting done (others abort by the scheduler's / heartbeat's mark);
    optimizer: dies after "commit" was decided (survivors applied 3, fail in 4; replay to 4);
    checkpoint: dies before writing its checkpoint at 4 (replay from 2 to 4)."""
    it = 4 if phase == "checkpoint" else 3
    r = run(tmp_path, "1f1b", [KillSpec(2, it, 0, phase)])
    _check_recovered(r, [2], resume)
    assert r.timings[0]["checkpoint_iteration"] == 2
    assert_same_as(r, references.get("1f1b"))


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_logged_data_of_a_stage_that_dies_right_after_a_commit(
    references: References, tmp_path: Path, stage: int
) -> None:
    """Inputs (stage 0) or targets (the last stage) logged, no data source: only the dying stage has
    them, and it dies at its first forward after committing iteration 2, before its writer could
    have shipped them on its own. The commit waited until they were in the cold tier, so the
    replacement replays iteration 2 instead of a rollback."""
    r = run(tmp_path, "1f1b", [KillSpec(stage, 3, 0, "forward")], extra=())
    _check_recovered(r, [stage], 3)
    assert_same_as(r, references.get("1f1b"))


@pytest.mark.slow
def test_two_failures_one_after_the_other(references: References, tmp_path: Path) -> None:
    r = run(tmp_path, "gpipe", [KillSpec(1, 3, 0, "forward"), KillSpec(3, 5, 1, "backward")])
    assert [t["failed_stages"] for t in r.timings] == [[1], [3]]
    assert [t["resume"] for t in r.timings] == [3, 5]
    assert all(t["verified"] for t in r.timings)
    assert_same_as(r, references.get("gpipe"))


def test_two_stages_at_once(references: References, tmp_path: Path) -> None:
    """Both die after their step of iteration 3, before the commit (the same instant, as far as
    the scheduler can tell): they are replaced together, each replayed from its own checkpoint."""
    r = run(tmp_path, "1f1b", [KillSpec(0, 3, 0, "commit"), KillSpec(2, 3, 0, "commit")])
    assert r.timings[0]["failed_stages"] == [0, 2]
    # each one's, not the first's only
    assert r.timings[0]["verified"] and r.timings[0]["verified_by_stage"] == {0: True, 2: True}
    assert_same_as(r, references.get("1f1b"))


@pytest.mark.slow
def test_two_adjacent_stages_at_once(references: References, tmp_path: Path) -> None:
    """Stages 1 and 2 die together: each took with it the log of what it sent the other, so each
    replacement replays both as one unit (the 1|2 sends regenerated, verified at 0|1 and 2|3) and
    keeps its own stage."""
    r = run(tmp_path, "1f1b", [KillSpec(1, 3, 0, "commit"), KillSpec(2, 3, 0, "commit")])
    _check_recovered(r, [1, 2], 3)
    assert r.timings[0]["digests_checked"] > 0
    assert_same_as(r, references.get("1f1b"))


def test_global_rollback(references: References, tmp_path: Path) -> None:
    r = run(tmp_path, "1f1b", [KillSpec(1, 3, 1, "forward")], mode="rollback")
    assert any(e["what"] == "rollback" and e["checkpoint"] == 2 for e in r.timeline)
    assert resumed_after_rollback(r, 3) is not None
    assert_same_as(r, references.get("1f1b"))


def test_logs_gone_fall_back_to_rollback(references: References, tmp_path: Path) -> None:
    """Nothing logged: the replacement cannot replay, says so, and every stage restarts from 2."""
    r = run(
        tmp_path,
        "1f1b",
        [KillSpec(1, 3, 1, "forward")],
        extra=("--data-source", "--no-logging"),
    )
    assert r.fallback is not None and "replay of stage 1" in r.fallback, r.fallback
    assert any(e["what"] == "rollback" and e["checkpoint"] == 2 for e in r.timeline)
    assert_same_as(r, references.get("1f1b"))


def test_parallel_replay_replacement(references: References, tmp_path: Path) -> None:
    """The replacement replays as rank 0 with a helper the scheduler started with it (exact
    gradient reduction order), and keeps the recovered state in memory."""
    r = run(tmp_path, "1f1b", [KillSpec(1, 3, 1, "forward")], replay_workers=2)
    _check_recovered(r, [1], 3)
    assert_same_as(r, references.get("1f1b"))
    assert r.returncodes["stage1-g1-helper1"] == 0
    assert '"took_part": true' in r.outputs["stage1-g1-helper1"], r.outputs["stage1-g1-helper1"]
    assert r.timings[0]["replay_workers"] == 2


@pytest.mark.slow
def test_in_place_recovery_with_batchnorm_autocast_and_a_global_clip(references: References, tmp_path: Path) -> None:
    """A job whose stages update BatchNorm statistics, run under bf16 autocast and clip to a global
    norm over all stages: the replacement (with a helper: shadow forwards and the logged clip norms)
    ends bit-exact with a failure-free run of the same job, buffers included."""
    extra = ("--data-source", "--mlp-norm", "batch", "--autocast", "bf16", "--clip-grad-norm", "0.05")
    ref = references.get("1f1b", extra=extra)
    r = run(tmp_path / "kill", "1f1b", [KillSpec(1, 3, 1, "backward")], extra=extra, replay_workers=2)
    _check_recovered(r, [1], 3)
    assert any("running_mean" in name for name in r.results[1]["model"])
    assert_same_as(r, ref)


@pytest.mark.slow
def test_a_stage_whose_backward_changes_buffers_is_replayed_alone_in_its_live_order(
    references: References, tmp_path: Path
) -> None:
    """BatchNorm inside activation recomputation: the statistics also change in the backward, so
    only the live interleaving of forwards and backwards reproduces them. The replacement was
    given a helper; the parallel replay stops at its first backward (it cannot follow that order),
    and the replacement replays alone instead of rolling the job back: bit-exact, buffers included."""
    extra = ("--data-source", "--mlp-norm", "batch", "--recompute")
    ref = references.get("1f1b", extra=extra)
    r = run(tmp_path / "kill", "1f1b", [KillSpec(1, 3, 1, "backward")], extra=extra, replay_workers=2)
    _check_recovered(r, [1], 3)
    assert "replaying alone" in r.outputs["stage1-g1"], r.outputs["stage1-g1"][-3000:]
    assert_same_as(r, ref)


@pytest.mark.slow
def test_weights_tied_across_stages_recover_in_place_bit_for_bit(references: References, tmp_path: Path) -> None:
    """The first stage's embedding is tied to the last stage's head (their gradients summed over
    the two stages by ``client.all_reduce_grads_`` every iteration, then clipped to the global
    norm). The first stage dies in a backward: its replacement replays with the sums its
    predecessor logged (from the cold tier: its node is gone), checks its own half of each, and the
    job, its tie group made again in the new generation, ends bit-exact with a failure-free run."""
    extra = ("--data-source", "--tie-embeddings", "client", "--clip-grad-norm", "0.05")
    ref = references.get("1f1b", extra=extra)
    r = run(tmp_path / "kill", "1f1b", [KillSpec(0, 3, 1, "backward")], extra=extra)
    _check_recovered(r, [0], 3)
    # still one weight
    assert torch.equal(r.results[0]["model"]["tok.weight"], r.results[max(r.results)]["model"]["head.weight"])
    assert_same_as(r, ref)


@pytest.mark.slow
def test_the_failed_stages_meta_comes_from_the_commit_store(references: References, tmp_path: Path) -> None:
    """The failed stage's own META of its last iterations never left its machine (not shipped: its
    segment was still open when it died), yet the replay needs it: this job runs under bf16
    autocast, which only the stage's META records. The commit step stored every committed META in
    the decision store; the replacement reads it there and the recovery is exact."""
    extra = ("--data-source", "--autocast", "bf16", "--no-ship-data")
    ref = references.get("1f1b", extra=extra)
    r = run(tmp_path / "kill", "1f1b", [KillSpec(1, 3, 1, "backward")], extra=extra)
    _check_recovered(r, [1], 3)
    assert not [w for w in r.timings[0]["warnings"] if "META" in w], r.timings[0]
    assert_same_as(r, ref)


@pytest.mark.slow
def test_parallel_helpers_when_replay_is_impossible(references: References, tmp_path: Path) -> None:
    """Nothing logged: the replay fails in the replacement and in its helper alike (naming the
    missing record), nobody hangs, and the scheduler rolls back."""
    r = run(tmp_path, "1f1b", [KillSpec(1, 3, 1, "forward")], extra=("--data-source", "--no-logging"), replay_workers=2)
    assert r.fallback is not None and "replay of stage 1" in r.fallback, r.fallback
    helper = r.outputs["stage1-g1-helper1"]
    assert r.returncodes["stage1-g1-helper1"] == 3 and "ReplayInputMissingError: no record of act_0_1" in helper, helper
    assert_same_as(r, references.get("1f1b"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("micro_batch", [0, 3])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_sweep_every_stage_and_edge_micro_batches(
    references: References,
    tmp_path: Path,
    stage: int,
    micro_batch: int,
    phase: str,
) -> None:
    """Longer sweep: every stage, first and last micro-batch, at iteration 5 (checkpoint 4)."""
    r = run(tmp_path, "1f1b", [KillSpec(stage, 5, micro_batch, phase)])
    _check_recovered(r, [stage], 5)
    assert r.timings[0]["checkpoint_iteration"] == 4
    assert_same_as(r, references.get("1f1b"))


@pytest.mark.slow
def test_logging_groups_replay_the_whole_group(references: References, tmp_path: Path) -> None:
    """Groups [2, 2]: only the 1|2 boundary is logged. Stage 1 dies; its group mate stage 0 is taken
    down too, and both are replayed together from checkpoint 2 (verified at the logged boundary)."""
    ref = references.get("1f1b", extra=("--data-source", "--groups", "2,2"), groups=[2, 2])
    r = run(
        tmp_path / "kill",
        "1f1b",
        [KillSpec(1, 3, 1, "backward")],
        extra=("--data-source", "--groups", "2,2"),
        groups=[2, 2],
    )
    assert r.timings[0]["failed_stages"] == [0, 1]
    assert r.timings[0]["verified"] and r.timings[0]["digests_checked"] > 0
    assert_same_as(r, ref)
    assert_same_as(ref, references.get("1f1b"))  # logging groups do not change training


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "groups", "kill"),
    [("1f1b", "2,2", KillSpec(1, 3, 1, "backward")), ("gpipe", "1,3", KillSpec(2, 3, 0, "forward"))],
    ids=["1f1b-2,2", "gpipe-1,3"],
)
def test_a_group_recovers_in_place_without_killing_its_live_members(
    references: References, tmp_path: Path, schedule: str, groups: str, kill: KillSpec
) -> None:
    """In-place group recovery: only the failed stage is replaced; its live group members reload
    their checkpoint in their own processes and the group replays as a pipeline, each member its
    own stage, the group's edges from the logs (GPipe: a member in the middle of the group)."""
    sizes = [int(x) for x in groups.split(",")]
    extra = ("--data-source", "--groups", groups)
    r = run(tmp_path, schedule, [kill], extra=extra, groups=sizes, group_recovery="in_place")
    assert r.timings[0]["failed_stages"] == [kill.stage], r.timings
    assert not [e for e in r.timeline if e["what"] == "kill_group_member"]
    first = 0 if groups == "2,2" else 1
    members = list(range(first, first + sizes[0 if first == 0 else 1]))
    for k in members:
        if k != kill.stage:  # a live member: same process, replayed with the group
            ev = r.results[k]["events"][0]
            assert ev["replayed_in_place"] == members and ev["replaced"] == [kill.stage], ev
    rec = r.results[kill.stage]["recovered"]  # the replacement read the group's edges from the logs
    assert rec["bytes_fetched"] > 0 and sum(s["records"] for s in rec["sources"]) == rec["records_fetched"] > 0
    assert_same_as(r, references.get(schedule, extra=extra, groups=sizes))


@pytest.mark.slow
def test_a_group_of_the_whole_pipeline_rolls_back_at_once_in_place(references: References, tmp_path: Path) -> None:
    """Groups [4]: nothing between stages is logged, so in place there is nothing to replay
    between: the replacement says so at once and every stage rolls back."""
    extra = ("--data-source", "--groups", "4")
    r = run(tmp_path, "1f1b", [KillSpec(1, 3, 1, "forward")], extra=extra, groups=[4], group_recovery="in_place")
    assert r.fallback is not None and "whole pipeline" in r.fallback, r.fallback
    assert_same_as(r, references.get("1f1b", extra=extra, groups=[4]))


@pytest.mark.slow
def test_kill_during_log_upload(references: References, tmp_path: Path) -> None:
    """SIGKILL in the uploader thread while a segment goes to the cold tier (iteration 3 or 4,
    depending on when the background upload runs): recovery is still exact."""
    r = run(tmp_path, "gpipe", [KillSpec(1, 3, 0, "upload")])
    assert r.timings[0]["failed_stages"] == [1] and r.timings[0]["verified"]
    assert r.timings[0]["resume"] in (3, 4)
    assert_same_as(r, references.get("gpipe"))


@pytest.mark.slow
def test_parallel_helpers_released_when_nothing_to_replay(references: References, tmp_path: Path) -> None:
    """A failure right at a checkpoint (iteration 4): the replacement loads it, replays nothing and
    releases its helper, which exits without taking part."""
    r = run(tmp_path, "1f1b", [KillSpec(1, 4, 0, "forward")], replay_workers=2)
    assert r.fallback is None and r.timings[0]["resume"] == 4, r.timings
    helper = r.outputs["stage1-g1-helper1"]
    assert r.returncodes["stage1-g1-helper1"] == 0 and '"took_part": false' in helper, helper
    assert_same_as(r, references.get("1f1b"))


@pytest.mark.parametrize(
    ("stage", "iteration", "phase", "cold", "workers"),
    [
        (1, 5, "forward", True, 1),
        pytest.param(2, 6, "forward", True, 2, marks=pytest.mark.slow),
        pytest.param(0, 6, "forward", False, 1, marks=pytest.mark.slow),
        pytest.param(1, 6, "optimizer", True, 1, marks=pytest.mark.slow),
    ],
)
def test_a_script_of_your_own_recovers_in_place_through_the_public_api(
    references: References, tmp_path: Path, stage: int, iteration: int, phase: str, cold: bool, workers: int
) -> None:
    """``trainer_client/examples/minimal_resilient.py``, the template for a script of one's own
    (its own MLP, SGD with momentum, StepLR, loss; nothing of the example GPT), run by the launcher:
    the killed stage (a middle one; the last one, whose loss function the replay takes from META)
    is replayed (the last one with a replay helper beside the replacement) and rejoins, and every
    stage ends as in a failure-free run, bit for bit. Without a
    cold tier the first stage's logged inputs die with it: the replacement reports the fallback
    (exit code 3) and the launcher restarts every stage from the checkpoint, to the same end. A
    stage lost in the optimizer step of the last iteration (committed: the others applied it and
    finished) is replaced too: the others wait at the end-of-run barrier, report ``resume = 7``
    and finish once it is replayed to the end."""
    from replay.launcher import run_with_failures

    script = "trainer_client.examples.minimal_resilient"

    def args(base: Path) -> list[str]:
        return ["--iters", "7", "--ckpt-at", "0,4"] + (["--cold-url", f"file://{base / 'cold'}"] if cold else [])

    ref = references.failure_free(args, run_id="mine", num_stages=3, script=script, timeout_s=120)
    base = tmp_path / "kill"
    base.mkdir()
    r = run_with_failures(
        args(base),
        run_id="mine",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=3,
        kills=[KillSpec(stage, iteration, 0, phase)],
        timeout_s=120,
        replay_workers=workers,
        script=script,
    )
    assert r.ok, r.describe()
    assert {k: states_equal(r.results[k], ref.results[k]) for k in range(3)} == {0: [], 1: [], 2: []}
    resume = iteration + (phase == "optimizer")  # a kill after the commit: the iteration was applied
    if not cold:
        assert r.fallback is not None and "no record of input_0 at iteration 4" in r.fallback
        assert [e["what"] for e in r.timeline].count("rollback") == 1
        return
    assert r.fallback is None and [t["failed_stages"] for t in r.timings] == [[stage]]
    t = r.timings[0]
    assert (t["verified"], t["checkpoint_iteration"], t["resume"], t["replay_workers"]) == (True, 4, resume, workers)
    assert r.results[stage]["recovered"]["resume"] == resume


@pytest.mark.slow
def test_a_survivor_lost_during_the_recovery_makes_the_scheduler_roll_back(
    references: References, tmp_path: Path
) -> None:
    """Stage 1 dies in iteration 3; stage 3 reports as a survivor and dies too, while the
    replacement replays. In-place recovery cannot finish (the new group would miss stage 3): the
    scheduler restarts every stage from the checkpoint at 2, and the run ends as a failure-free one."""
    r = run(tmp_path, "1f1b", [KillSpec(1, 3, 0, "forward"), KillSpec(3, 0, 0, "recovering")])
    rollbacks = [e for e in r.timeline if e["what"] == "rollback"]
    assert (
        len(rollbacks) == 1
        and rollbacks[0]["checkpoint"] == 2
        and "during the recovery of generation 0" in rollbacks[0]["reason"]
    ), r.timeline
    # the reason in-place recovery was abandoned
    assert r.fallback == "stage 3 died (rc=-9) during the recovery of generation 0", r.fallback
    assert_same_as(r, references.get("1f1b"))


def test_two_kills_of_one_stage_are_refused_not_dropped(tmp_path: Path) -> None:
    """A stage's first process takes its KillSpec; a second one for the same stage was dropped
    silently (the run then showed one failure where two were asked for)."""
    from replay.launcher import run_with_failures

    with pytest.raises(ValueError, match=r"more than one KillSpec for stage\(s\) \[1\]"):
        run_with_failures(
            [],
            run_id="twice",
            base_dir=str(tmp_path),
            checkpoint_url=f"file://{tmp_path}/ckpt",
            kills=[KillSpec(1, 2), KillSpec(1, 6), KillSpec(2, 3)],
        )
    assert not (tmp_path / "out").exists()  # refused before anything started


def test_a_stage_that_raises_the_same_error_again_is_not_replaced_in_a_loop(tmp_path):
    """A QA check: a script whose stage raised (a bug: a wrong shape, a wrong dtype) was taken for a
    machine failure and replaced until ``max_restarts``, each replacement failing alike, and the
    cause sat in a log. A replacement that raises the error its predecessor raised ends the run at
    once, naming the error."""
    from replay.launcher import run_with_failures

    r = run_with_failures(
        ["--iters", "3", "--ckpt-at", "0"],
        run_id="bug",
        base_dir=str(tmp_path),
        checkpoint_url=f"file://{tmp_path / 'ckpt'}",
        num_stages=3,
        timeout_s=120,
        script="tests._raising_script",
    )
    assert not r.ok and not r.timed_out
    assert (
        r.error is not None
        and "stage 1 raised the same error again" in r.error
        and "RuntimeError: a bug in stage 1's own code" in r.error
    ), r.describe()
    assert [e["name"] for e in r.timeline if e["what"] == "start" and e["stage"] == 1] == ["stage1-g0", "stage1-g1"]
    assert "error=stage 1 raised" in r.describe()


def test_a_bug_every_stage_meets_ends_the_run_at_once(tmp_path):
    """A QA check: a script every stage of which raised the same error as it started (a forgotten
    set-up call) was taken for machine failures: replacements, a rollback for want of survivors,
    and more generations, the cause in no result field. Every stage raising, the same error twice
    and none killed, is a bug, and so is a process raising what an earlier one of its stage
    raised: the run ends without a rollback, naming it."""
    from replay.launcher import run_with_failures

    r = run_with_failures(
        ["--iters", "3", "--ckpt-at", "0"],
        run_id="bugs",
        base_dir=str(tmp_path),
        checkpoint_url=f"file://{tmp_path / 'ckpt'}",
        num_stages=3,
        timeout_s=120,
        script="tests._raising_everywhere",
    )
    assert not r.ok and not r.timed_out and r.fallback is None
    assert r.error is not None and "a bug in the script" in r.error and "call client.schedule(...)" in r.error, (
        r.describe()
    )
    # the exits seen at once, or the first one's replacement raising it again: never a rollback
    assert (
        not [e for e in r.timeline if e["what"] == "rollback"]
        and len([e for e in r.timeline if e["what"] == "start"]) <= 6
    ), r.timeline


def test_a_failure_free_reference_runs_once_and_comes_back_from_the_cache_bit_for_bit(tmp_path: Path) -> None:
    """A reference is run once per arguments: a second session (another References on the same
    cache) takes it from the disk, bit for bit; other arguments are run."""

    def args(iters: int) -> Callable[[Path], list[str]]:
        return lambda base: ["--iters", str(iters), "--ckpt-at", "0", "--cold-url", f"file://{base / 'cold'}"]

    script = "trainer_client.examples.minimal_resilient"
    first = References(tmp_path / "work1", tmp_path / "cache")
    ref = first.failure_free(args(3), run_id="mine", num_stages=3, script=script, timeout_s=120)
    assert len(first.ran) == 1 and first.failure_free(args(3), run_id="mine", num_stages=3, script=script) is ref
    second = References(tmp_path / "work2", tmp_path / "cache")
    again = second.failure_free(args(3), run_id="mine", num_stages=3, script=script)
    assert second.ran == [] and again is not ref
    assert {k: states_equal(again.results[k], ref.results[k]) for k in range(3)} == {0: [], 1: [], 2: []}
    other = second.failure_free(args(4), run_id="mine", num_stages=3, script=script, timeout_s=120)
    assert len(second.ran) == 1 and second.ran[0] != first.ran[0]
    assert {k: states_equal(other.results[k], ref.results[k]) != [] for k in range(3)} == {0: True, 1: True, 2: True}
