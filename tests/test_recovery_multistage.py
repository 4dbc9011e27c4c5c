"""In-place recovery of ranks that hold several stages (multi-stage schedules), real processes.

The template ``trainer_client.examples.multi_stage_resilient`` runs 2 ranks of 2 stages each
under :mod:`replay.launcher` with each accepted schedule: Interleaved 1F1B and LoopedBFS (rank r
holds stages r and r + 2), interleaved zero-bubble (the same, every backward split into input- and
weight-gradient passes), ZBV zero-bubble and DualPipeV (a V: rank 0 holds stages 0 and 3, rank 1
the middle stages 1 and 2, whose exchange never leaves it; split backwards too, DualPipeV's mixed
with whole ones). A rank is SIGKILLed in a
phase; its replacement replays all its stages (``replay.recover_rank``) while the other rank keeps
its state. Every stage's final state must equal a failure-free run's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.compare import states_equal
from replay.launcher import KillSpec, RecoveryRun, run_with_failures

SCRIPT = "trainer_client.examples.multi_stage_resilient"
ITERS = 7


def _args(schedule: str, workers: int = 1, concurrent: bool = False, clip: float | None = None) -> object:
    def args(base: Path) -> list[str]:
        extra = (["--replay-workers", str(workers)] if workers > 1 else []) + (
            ["--replay-concurrent"] if concurrent else []
        )
        extra += ["--clip", str(clip)] if clip is not None else []
        return ["--iters", str(ITERS), "--ckpt-at", "0,3", "--cold-url", f"file://{base / 'cold'}", "--schedule",
                schedule, *extra]  # fmt: skip

    return args


def _run(
    tmp_path: Path,
    schedule: str,
    kills: list[KillSpec],
    workers: int = 1,
    concurrent: bool = False,
    clip: float | None = None,
) -> RecoveryRun:
    base = tmp_path / "kill"
    base.mkdir()
    r = run_with_failures(
        _args(schedule, workers, concurrent, clip)(base),  # type: ignore[operator]
        run_id="multi",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=2,
        kills=kills,
        timeout_s=200,
        script=SCRIPT,
    )
    assert r.ok, r.describe()
    return r


def _same_as_failure_free(references: object, r: RecoveryRun, schedule: str, clip: float | None = None) -> None:
    ref = references.failure_free(  # type: ignore[attr-defined]
        _args(schedule, clip=clip), run_id="multi", num_stages=2, script=SCRIPT, timeout_s=200
    )
    for k in (0, 1):
        got, want = r.results[k]["stages"], ref.results[k]["stages"]
        assert sorted(got) == sorted(want)
        diffs = {s: states_equal(got[s], want[s]) for s in want}
        assert not any(diffs.values()), {s: v[:5] for s, v in diffs.items() if v}


#: every accepted schedule: each rank killed in each phase (the W pass where the schedule splits backward)
PHASES = {
    "interleaved1f1b": ("forward", "backward", "commit", "optimizer"),
    "loopedbfs": ("forward", "backward", "commit", "optimizer"),
    "interleavedzerobubble": ("forward", "backward", "weight", "commit", "optimizer"),
    "zbvzerobubble": ("forward", "backward", "weight", "commit", "optimizer"),
    "dualpipev": ("forward", "backward", "weight", "commit", "optimizer"),
}
FAST = {("interleaved1f1b", 0, "backward"), ("zbvzerobubble", 1, "weight"), ("loopedbfs", 1, "forward")}
CASES = [
    pytest.param(
        sched,
        rank,
        phase,
        id=f"{sched}-rank{rank}-{phase}",
        marks=() if (sched, rank, phase) in FAST else pytest.mark.slow,
    )  # fmt: skip
    for sched, phases in PHASES.items()
    for rank in (0, 1)
    for phase in phases
]

#: the stages each rank holds, and the replay units of its replacement
STAGES = {"interleaved1f1b": {0: [0, 2], 1: [1, 3]}, "zbvzerobubble": {0: [0, 3], 1: [1, 2]}}
STAGES["interleavedzerobubble"] = STAGES["loopedbfs"] = STAGES["interleaved1f1b"]
STAGES["dualpipev"] = STAGES["zbvzerobubble"]
UNITS = {(v, 1): [[1, 2]] for v in ("zbvzerobubble", "dualpipev")}  # the V's middle stages: never logged between


@pytest.mark.parametrize(("schedule", "rank", "phase"), CASES)
def test_a_lost_rank_replays_every_stage_it_held(
    references: object, tmp_path: Path, schedule: str, rank: int, phase: str
) -> None:
    """Only the killed rank is replaced; its replacement replays each of its stages (the V's middle
    stages together) from the checkpoint at 3 to the resume iteration; bit-exact everywhere."""
    r = _run(tmp_path, schedule, [KillSpec(rank, 4, 1, phase)])
    _same_as_failure_free(references, r, schedule)
    assert r.fallback is None and [t["failed_stages"] for t in r.timings] == [[rank]]
    rec = r.results[rank]["recovered"]
    resume = 4 + (phase == "optimizer")
    assert (rec["resume"], rec["verified"]) == (resume, True)
    mine = STAGES[schedule][rank]
    assert sorted(rec["stages"]) == mine
    units = UNITS.get((schedule, rank), [[s] for s in mine])
    assert [u["stages"] for u in rec["units"]] == units
    assert all(u["checkpoint_iteration"] == 3 for u in rec["units"])
    assert all(st["digests_checked"] > 0 for st in rec["stages"].values())
    (ev,) = r.results[1 - rank]["events"]  # the other rank kept its state and resumed there
    assert ev["resume"] == resume


@pytest.mark.slow
def test_a_lost_rank_replays_with_parallel_workers(references: object, tmp_path: Path) -> None:
    """Each stage of the lost rank is replayed by 2 worker processes (SWIFT's parallel replay)."""
    r = _run(tmp_path, "interleaved1f1b", [KillSpec(1, 5, 0, "backward")], workers=2)
    _same_as_failure_free(references, r, "interleaved1f1b")
    rec = r.results[1]["recovered"]
    assert [st["timings"]["workers"] for st in rec["stages"].values()] == [2, 2]


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbvzerobubble"])
def test_a_lost_rank_replays_its_units_at_the_same_time(references: object, tmp_path: Path, schedule: str) -> None:
    """``concurrent``: rank 0's two units (stages 0 and 2 or 0 and 3) replay at once, the second in a
    process of its own whose state comes back through a checkpoint file; bit-exact."""
    r = _run(tmp_path, schedule, [KillSpec(0, 5, 1, "backward")], concurrent=True)
    _same_as_failure_free(references, r, schedule)
    rec = r.results[0]["recovered"]
    assert [u["stages"] for u in rec["units"]] == [[s] for s in STAGES[schedule][0]] and rec["verified"]


def test_the_plan_of_a_lost_rank_names_every_stage_it_held(tmp_path: Path) -> None:
    """A ZBV run's logs: planning rank 1's loss replays its stages 1 and 2 as one unit (their
    exchange never left the rank); rank 0's, stages 0 and 3 apart. The CLI says the same."""
    from logstore import LogStore, StoreConfig
    from replay import plan_recovery
    from tests._cli_helpers import ok, swiftlog

    base = tmp_path / "run"
    base.mkdir()
    r = run_with_failures(
        _args("zbvzerobubble")(base),  # type: ignore[operator]
        run_id="multi",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=2,
        timeout_s=200,
        script=SCRIPT,
    )
    assert r.ok, r.describe()
    roots = sorted((base / "nodes").iterdir())
    stores = [LogStore(StoreConfig(root=str(p), run="multi", cold_url=f"file://{base / 'cold'}")) for p in roots]
    try:
        plan = plan_recovery(stores, failed_ranks=[1], stages_per_rank=2, stage_style="v", target_iteration=ITERS)
        assert plan.possible and plan.failed_stages == [1, 2] and plan.failed_ranks == {1: [1, 2]}
        assert [u.stages for u in plan.units] == [[1, 2]]
        plan = plan_recovery(stores, failed_ranks=[0], stages_per_rank=2, stage_style="v", target_iteration=ITERS)
        assert plan.failed_ranks == {0: [0, 3]} and [u.stages for u in plan.units] == [[0], [3]]
        with pytest.raises(ValueError, match="failed ranks \\[2\\] are outside the 2 ranks"):
            plan_recovery(stores, failed_ranks=[2], stages_per_rank=2, stage_style="v")
    finally:
        for st in stores:
            st.close()
    cold = f"file://{base / 'cold'}"
    p = ok(swiftlog("plan", "--root", roots[0], "--cold-url", cold, "--run", "multi", "--rank", "1",
                    "--stages-per-rank", "2", "--stage-style", "v", "-t", str(ITERS)))  # fmt: skip
    assert "rank 1 held stages [1, 2]" in p.stdout and "stages [1, 2]: replay [3, 7)" in p.stdout
    # and replayed offline from the survivor's node root and the cold tier: stages 0 and 3, each alone
    out = tmp_path / "recovered"
    p = ok(swiftlog("replay", "--root", roots[1], "--cold-url", cold, "--run", "multi", "--rank", "0",
                    "--stages-per-rank", "2", "--stage-style", "v", "-t", str(ITERS),
                    "--model", f"{SCRIPT}:factory", "-o", out))  # fmt: skip
    assert p.stdout.count("verified") == 2, p.stdout
    assert sorted(d.name for d in out.iterdir()) == ["stage00000", "stage00003"]


@pytest.mark.parametrize(
    ("schedule", "rank", "phase"), [("interleaved1f1b", 1, "backward"), ("zbvzerobubble", 0, "weight")]
)
def test_a_rank_clipped_to_the_pipeline_norm_replays_the_same_clip(
    references: object, tmp_path: Path, schedule: str, rank: int, phase: str
) -> None:
    """``client.clip_grad_norm_`` over the whole pipeline (every stage of every rank): each stage's
    META holds the norm, and the replay of the lost rank's stages clips by it; bit-exact."""
    r = _run(tmp_path, schedule, [KillSpec(rank, 4, 1, phase)], clip=0.05)
    _same_as_failure_free(references, r, schedule, clip=0.05)
    assert r.results[rank]["recovered"]["verified"]
