"""In-place recovery of a data-parallel x pipeline mesh (``dp_replicate`` x ``pp``), real processes.

The template script (``trainer_client.examples.minimal_resilient``: its own MLP, SGD with
momentum, StepLR; each replica its own data) runs as a mesh under :mod:`replay.launcher`; a rank
is SIGKILLed; every rank's final state must equal a failure-free run's bit for bit, and the
replicas of each stage must be bit-identical to each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from replay.compare import states_equal
from replay.launcher import KillSpec, RecoveryRun, run_with_failures
from trainer_client.mesh import MeshLayout

SCRIPT = "trainer_client.examples.minimal_resilient"
ITERS = 7


def _args(base: Path) -> list[str]:
    return ["--iters", str(ITERS), "--ckpt-at", "0,3", "--cold-url", f"file://{base / 'cold'}"]


def _run(tmp_path: Path, kills: list[KillSpec], stages: int, replicas: int) -> RecoveryRun:
    base = tmp_path / "kill"
    base.mkdir()
    r = run_with_failures(
        _args(base),
        run_id="mesh",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=stages,
        dp_replicate=replicas,
        kills=kills,
        timeout_s=150,
        script=SCRIPT,
    )
    assert r.ok, r.describe()
    return r


def _check(r: RecoveryRun, ref: object, stages: int, replicas: int) -> None:
    layout = MeshLayout(stages, replicas)
    want = ref.results  # type: ignore[attr-defined]
    diffs = {k: states_equal(r.results[k], want[k]) for k in range(layout.world_size)}
    assert not any(diffs.values()), {k: v[:5] for k, v in diffs.items() if v}
    for k in range(stages):
        first, *others = layout.replicas_of(k)
        for o in others:
            assert states_equal(r.results[o], r.results[first]) == [], f"replicas of stage {k} differ"


CASES = [
    pytest.param(1, 1, "forward", id="stage1-replica1-forward"),
    pytest.param(0, 0, "optimizer", marks=pytest.mark.slow, id="stage0-replica0-optimizer"),
    pytest.param(0, 1, "forward", marks=pytest.mark.slow, id="stage0-replica1-forward"),
    pytest.param(1, 0, "optimizer", marks=pytest.mark.slow, id="stage1-replica0-optimizer"),
]


@pytest.mark.parametrize(("stage", "replica", "phase"), CASES)
def test_a_lost_replica_is_copied_from_a_live_one(
    references: object, tmp_path: Path, stage: int, replica: int, phase: str
) -> None:
    """dp_replicate=2 x pp=2: the killed rank's replacement receives its stage's state from the
    other replica (no replay), verified by digest; the whole mesh re-forms and goes on."""
    ref = references.failure_free(  # type: ignore[attr-defined]
        _args, run_id="mesh", num_stages=2, script=SCRIPT, dp_replicate=2, timeout_s=150
    )
    r = _run(tmp_path, [KillSpec(stage, 4, 0, phase, replica=replica)], 2, 2)
    _check(r, ref, 2, 2)
    lost = MeshLayout(2, 2).rank(stage, replica)
    donor = MeshLayout(2, 2).rank(stage, 1 - replica)
    assert r.fallback is None and [t["failed_stages"] for t in r.timings] == [[lost]]
    rec = r.results[lost]["recovered"]
    assert (rec["path"], rec["donor"], rec["resume"]) == ("replica", donor, 4 + (phase == "optimizer"))
    (received,) = r.results[lost]["transfers"]
    (sent,) = r.results[donor]["transfers"]
    assert (received["role"], received["peer"], sent["peer"]) == ("received", donor, lost)
    assert received["bytes"] == sent["bytes"] > 0


@pytest.mark.slow
def test_two_failures_one_after_the_other_in_a_mesh_of_three_replicas(references: object, tmp_path: Path) -> None:
    """dp_replicate=3 x pp=2: a replica of stage 0 lost in one iteration, one of stage 1 later;
    each is copied from a live replica, and every rank ends as in the failure-free run."""
    ref = references.failure_free(  # type: ignore[attr-defined]
        _args, run_id="mesh", num_stages=2, script=SCRIPT, dp_replicate=3, timeout_s=150
    )
    r = _run(tmp_path, [KillSpec(0, 2, 0, "forward", replica=2), KillSpec(1, 5, 0, "optimizer", replica=0)], 2, 3)
    _check(r, ref, 2, 3)
    assert [t["failed_stages"] for t in r.timings] == [[2], [3]]
    assert r.results[2]["recovered"]["donor"] == 0 and r.results[3]["recovered"]["donor"] == 4


@pytest.mark.parametrize(
    ("stages", "stage", "phase"),
    [
        pytest.param(2, 1, "forward", id="pp2-stage1-forward"),
        pytest.param(2, 0, "optimizer", marks=pytest.mark.slow, id="pp2-stage0-optimizer"),
    ],
)
def test_every_replica_of_a_stage_lost_at_once_is_replayed_exactly_with_the_others(
    references: object, tmp_path: Path, stages: int, stage: int, phase: str
) -> None:
    """dp_replicate=3 (with two, a+b = b+a would hide a wrong order): the three replicas of one
    stage die together (one failure domain). Each replacement replays its own pipeline's logs and
    they repeat the live average over the replicas among themselves (no gradient was logged): every
    rank ends bit-exact, the replay verified, and the plan says why each rank took that path."""
    ref = references.failure_free(  # type: ignore[attr-defined]
        _args, run_id="mesh", num_stages=stages, script=SCRIPT, dp_replicate=3, timeout_s=150
    )
    kills = [KillSpec(stage, 5, 0, phase, replica=r) for r in range(3)]
    r = _run(tmp_path, kills, stages, 3)
    _check(r, ref, stages, 3)
    lost = MeshLayout(stages, 3).replicas_of(stage)
    assert r.fallback is None and [t["failed_stages"] for t in r.timings] == [lost]
    assert r.timings[0]["verified"] is True and r.timings[0]["checkpoint_iteration"] == 3
    for k in lost:
        rec = r.results[k]["recovered"]
        assert (rec["path"], rec["verified"]) == ("replay", True)
        assert f"every replica of stage {stage} was lost" in rec["why"]


@pytest.mark.slow
def test_a_lost_replica_in_a_four_stage_mesh(references: object, tmp_path: Path) -> None:
    """dp_replicate=2 x pp=4 (eight processes): a middle stage's replica is copied."""
    ref = references.failure_free(  # type: ignore[attr-defined]
        _args, run_id="mesh", num_stages=4, script=SCRIPT, dp_replicate=2, timeout_s=150
    )
    r = _run(tmp_path, [KillSpec(2, 4, 0, "forward", replica=1)], 4, 2)
    _check(r, ref, 4, 2)
    assert r.results[5]["recovered"]["donor"] == 4


# ------------------------------------------------------------------ the example GPT as a mesh, every phase
GPT = "trainer_client.examples.train_resilient"


def _gpt_args(fmt: str) -> Callable[[Path], list[str]]:
    def args(base: Path) -> list[str]:
        return [
            "--iters",
            "7",
            "--ckpt-at",
            "0,3,6",
            "--cold-url",
            f"file://{base / 'cold'}",
            "--checkpoint-format",
            fmt,
            "--clip-grad-norm",
            "1.0",
            "--pg-timeout",
            "60",
            "--rejoin-timeout",
            "60",
        ]

    return args


def _gpt_run(tmp_path: Path, kills: list[KillSpec], fmt: str) -> RecoveryRun:
    base = tmp_path / "gpt"
    base.mkdir()
    r = run_with_failures(
        _gpt_args(fmt)(base),
        run_id="gptmesh",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=2,
        dp_replicate=2,
        kills=kills,
        timeout_s=150,
        script=GPT,
    )
    assert r.ok, r.describe()
    return r


#: (phase, kill iteration, checkpoint format): every phase on both stages (a replica of each)
_PHASES = [
    ("forward", 4, "dcp"),
    ("backward", 4, "torch"),
    ("reduce", 4, "torch"),
    ("commit", 4, "torch"),
    ("optimizer", 5, "dcp-async"),
    ("checkpoint", 3, "torch"),
    ("dcp_save", 3, "dcp-async"),
]
PHASES = [
    pytest.param(
        stage,
        (stage + i) % 2,
        it,
        phase,
        fmt,
        id=f"{phase}-stage{stage}",
        marks=() if (phase, stage) == ("reduce", 1) else pytest.mark.slow,
    )
    for i, (phase, it, fmt) in enumerate(_PHASES)
    for stage in (0, 1)
]


@pytest.mark.parametrize(("stage", "replica", "iteration", "phase", "fmt"), PHASES)
def test_the_gpt_mesh_recovers_a_replica_lost_in_every_phase(
    references: object, tmp_path: Path, stage: int, replica: int, iteration: int, phase: str, fmt: str
) -> None:
    """The example GPT (AdamW, LinearLR, dropout, the clip to the pipeline's global norm) as a
    dp_replicate=2 x pp=2 mesh, one replica SIGKILLed in each phase (the replicas' average made
    deterministic with the client's hook; a DCP save killed before its .metadata): copied from
    the other replica, every rank bit-exact, the replicas equal."""
    ref = references.failure_free(  # type: ignore[attr-defined]
        _gpt_args(fmt), run_id="gptmesh", num_stages=2, script=GPT, dp_replicate=2, timeout_s=150
    )
    r = _gpt_run(tmp_path, [KillSpec(stage, iteration, 1, phase, replica=replica)], fmt)
    _check(r, ref, 2, 2)
    lost = MeshLayout(2, 2).rank(stage, replica)
    assert r.results[lost]["recovered"]["path"] == "replica"


@pytest.mark.slow
def test_both_replicas_lost_in_a_dcp_save_replay_from_the_dcp_checkpoint_before(
    references: object, tmp_path: Path
) -> None:
    """Both replicas of stage 1 die while their async DCP save of iteration 3 runs (before its
    .metadata): that checkpoint is never listed; they replay from the DCP checkpoint at 0 with
    dcp.load, together, and end bit-exact."""
    ref = references.failure_free(  # type: ignore[attr-defined]
        _gpt_args("dcp-async"), run_id="gptmesh", num_stages=2, script=GPT, dp_replicate=2, timeout_s=150
    )
    r = _gpt_run(tmp_path, [KillSpec(1, 3, 1, "dcp_save", replica=x) for x in range(2)], "dcp-async")
    _check(r, ref, 2, 2)
    for k in (2, 3):
        rec = r.results[k]["recovered"]
        assert (rec["path"], rec["checkpoint_iteration"]) == ("replay", 0)
        assert rec["checkpoint_uri"].endswith("it000000000000.dcp.json")


def test_the_replicas_of_a_stage_commit_one_meta(tmp_path: Path) -> None:
    """What lets the commit store keep one META copy per stage: the replicas' documents are the
    same bytes but for each rank's own timings (the mesh's run id, no per-replica digests), here
    read back from each replica's own log in the cold tier."""
    from logstore import Channel, LogStore, RecordKey
    from trainer_client.commit import split_meta

    _run(tmp_path, [], 2, 2)
    cold = f"file://{tmp_path / 'kill' / 'cold'}"
    docs = {}
    for r in range(2):
        with LogStore.open(tmp_path / "reader", f"mesh.dp{r}", cold_url=cold) as st:
            # from the last checkpoint (3) on: what GC left
            docs[r] = [st.get(RecordKey(Channel.meta(k), it, 0, 0)) for k in range(2) for it in range(3, ITERS)]
    assert len(docs[0]) == 2 * (ITERS - 3)
    assert [split_meta(d.numpy().tobytes())[0] for d in docs[0]] == [
        split_meta(d.numpy().tobytes())[0] for d in docs[1]
    ]
