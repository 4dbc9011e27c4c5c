"""In-place recovery of sharded stages (FSDP2 / HSDP) x pipeline, real processes.

The template script (``trainer_client.examples.minimal_resilient`` with ``--dp-shard D``: every
linear layer and the stage ``fully_shard``-ed over the stage's shard group, DCP checkpoints, each
data-parallel pipeline its own data) runs as a ``pp`` x ``dp_shard`` mesh under
:mod:`replay.launcher`; a rank is SIGKILLed in a phase; its shard group replays from the
checkpoint, the live members in their own processes; with replicas too (HSDP, ``--dp-replicate
2``) the lost shard is copied from its replica instead. Every rank's final state (its shards) must
equal a failure-free run's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.compare import states_equal
from replay.launcher import KillSpec, RecoveryRun, run_with_failures
from trainer_client.mesh import MeshLayout

SCRIPT = "trainer_client.examples.minimal_resilient"
ITERS = 7


def _args(base: Path) -> list[str]:
    return ["--iters", str(ITERS), "--ckpt-at", "0,3", "--cold-url", f"file://{base / 'cold'}"]


def _run(tmp_path: Path, kills: list[KillSpec], layout: MeshLayout) -> RecoveryRun:
    base = tmp_path / "kill"
    base.mkdir()
    r = run_with_failures(
        _args(base),
        run_id="fsdp",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=layout.num_stages,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        kills=kills,
        timeout_s=200,
        script=SCRIPT,
    )
    assert r.ok, r.describe()
    return r


def _reference(references: object, layout: MeshLayout) -> object:
    return references.failure_free(  # type: ignore[attr-defined]
        _args,
        run_id="fsdp",
        num_stages=layout.num_stages,
        script=SCRIPT,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        timeout_s=200,
    )


def _same_as(r: RecoveryRun, ref: object, layout: MeshLayout) -> None:
    want = ref.results  # type: ignore[attr-defined]
    diffs = {k: states_equal(r.results[k], want[k]) for k in range(layout.world_size)}
    assert not any(diffs.values()), {k: v[:5] for k, v in diffs.items() if v}


CASES = [
    pytest.param(2, 1, 1, "forward", id="shard2-stage1-shard1-forward"),
    pytest.param(2, 1, 0, "backward", marks=pytest.mark.slow, id="shard2-stage1-shard0-backward"),
    pytest.param(2, 0, 1, "commit", marks=pytest.mark.slow, id="shard2-stage0-shard1-commit"),
    pytest.param(2, 1, 0, "optimizer", marks=pytest.mark.slow, id="shard2-stage1-shard0-optimizer"),
    pytest.param(3, 1, 2, "backward", id="shard3-stage1-shard2-backward"),
    pytest.param(3, 0, 1, "forward", marks=pytest.mark.slow, id="shard3-stage0-shard1-forward"),
    pytest.param(3, 0, 0, "commit", marks=pytest.mark.slow, id="shard3-stage0-shard0-commit"),
    pytest.param(3, 1, 1, "optimizer", marks=pytest.mark.slow, id="shard3-stage1-shard1-optimizer"),
]


@pytest.mark.parametrize(("dp_shard", "stage", "shard", "phase"), CASES)
def test_a_lost_shard_is_replayed_by_its_shard_group_in_place(
    references: object, tmp_path: Path, dp_shard: int, stage: int, shard: int, phase: str
) -> None:
    """dp_shard x pp=2, no replica: only the killed rank is replaced; its shard group goes back to
    the checkpoint all members have and replays together (the live members in their processes,
    their FSDP collectives repeated), every other rank keeps its state; bit-exact."""
    layout = MeshLayout(2, 1, dp_shard)
    ref = _reference(references, layout)
    r = _run(tmp_path, [KillSpec(stage, 4, 1, phase, shard=shard)], layout)
    _same_as(r, ref, layout)
    lost = layout.rank(stage, 0, shard)
    assert r.fallback is None and [t["failed_stages"] for t in r.timings] == [[lost]]
    rec = r.results[lost]["recovered"]
    resume = 4 + (phase == "optimizer")
    assert (rec["path"], rec["resume"], rec["checkpoint_iteration"], rec["verified"]) == ("shard", resume, 3, True)
    live = [k for k in layout.shard_group(stage) if k != lost]
    assert f"ranks {', '.join(map(str, live))} in place" in rec["why"]
    for k in live:  # the live members replayed with it, in their own processes
        (ev,) = r.results[k]["events"]
        assert ev["replayed_in_place"] == layout.shard_group(stage) and ev["resume"] == resume
    for k in set(range(layout.world_size)) - set(layout.shard_group(stage)):
        assert [e["replayed_in_place"] for e in r.results[k]["events"]] == [[]]  # the others kept their state


HSDP = [
    pytest.param(1, 1, 0, "backward", id="hsdp-stage1-replica1-shard0-backward"),
    pytest.param(0, 0, 1, "forward", marks=pytest.mark.slow, id="hsdp-stage0-replica0-shard1-forward"),
    pytest.param(1, 0, 1, "optimizer", marks=pytest.mark.slow, id="hsdp-stage1-replica0-shard1-optimizer"),
    pytest.param(0, 1, 0, "commit", marks=pytest.mark.slow, id="hsdp-stage0-replica1-shard0-commit"),
]


@pytest.mark.parametrize(("stage", "replica", "shard", "phase"), HSDP)
def test_a_lost_shard_with_a_live_replica_is_copied_from_it(
    references: object, tmp_path: Path, stage: int, replica: int, shard: int, phase: str
) -> None:
    """HSDP 2 x 2 x pp=2 (8 ranks): the replacement is built over the next generation's shard
    group and receives its shard's state from the same shard of the other replica (no replay);
    bit-exact, and the replicas of each shard equal."""
    layout = MeshLayout(2, 2, 2)
    ref = _reference(references, layout)
    r = _run(tmp_path, [KillSpec(stage, 4, 1, phase, replica=replica, shard=shard)], layout)
    _same_as(r, ref, layout)
    lost, donor = layout.rank(stage, replica, shard), layout.rank(stage, 1 - replica, shard)
    rec = r.results[lost]["recovered"]
    assert (rec["path"], rec["donor"], rec["resume"]) == ("replica", donor, 4 + (phase == "optimizer"))
    assert [t["role"] for t in r.results[lost]["transfers"]] == ["received"]
    for k in range(layout.world_size):
        c = layout.coord(k)
        twin = layout.rank(c.stage, 1 - c.replica, c.shard)
        assert states_equal(r.results[k], r.results[twin]) == [], f"rank {k} differs from its replica {twin}"


def _gpt_args(base: Path) -> list[str]:
    return [
        *["--iters", "8", "--ckpt-at", "0,4", "--cold-url", f"file://{base / 'cold'}", "--checkpoint-format", "dcp"],
        *["--hidden", "64", "--layers", "1", "--seq", "16", "--n-microbatches", "4", "--clip-grad-norm", "0.05"],
    ]


def test_the_example_gpt_sharded_and_clipped_to_a_global_norm_recovers_bit_for_bit(
    references: object, tmp_path: Path
) -> None:
    """The example GPT (``train_resilient --dp-shard 2``: every block and the stage sharded) with
    its gradients clipped to the pipeline's global norm (a norm over sharded gradients, a clip of
    DTensors, replayed from the logged norm): a shard killed in its backward is replayed by its
    shard group in place; bit-exact."""
    ref = references.failure_free(_gpt_args, run_id="gfsdp", num_stages=2, dp_shard=2)  # type: ignore[attr-defined]
    base = tmp_path / "kill"
    base.mkdir()
    r = run_with_failures(
        _gpt_args(base),
        run_id="gfsdp",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=2,
        dp_shard=2,
        kills=[KillSpec(1, 5, 1, "backward", shard=1)],
        timeout_s=200,
    )
    assert r.ok, r.describe()
    _same_as(r, ref, MeshLayout(2, 1, 2))
    assert r.results[3]["recovered"]["path"] == "shard"
