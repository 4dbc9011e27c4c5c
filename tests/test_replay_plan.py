"""Recovery planning on logs written by real 4-stage pipeline runs (tests/_replay_fixtures.py).

What a plan must say: per failed stage (or logging group), the checkpoint it restarts from, the
iteration it replays to, the records to fetch and from where, bytes and time; and when the replay
is impossible (a gap, a missing or corrupt record, no usable checkpoint), why, and the fallback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from logstore import Channel, RecordKey
from replay import RecoveryPlan, plan_recovery
from replay.plan import groups_from_channels
from tests._replay_helpers import (
    CKPT,
    ITERS,
    NUM_STAGES,
    copy_run_files,
    corrupt_hot_record,
)

pytest_plugins = ["tests._replay_fixtures"]


def test_plan_of_one_stage_names_checkpoint_target_sources_and_estimate(f1b_run):
    with f1b_run.store() as st:
        plan = plan_recovery(st, [2])
    assert plan.possible and plan.recommended == "replay" and plan.reasons == []
    assert plan.num_stages == NUM_STAGES and plan.target_iteration == ITERS
    assert plan.logging_groups == [[0], [1], [2], [3]] and plan.groups_from.startswith("META")
    (u,) = plan.units
    assert (u.stages, u.failed, u.rolled_back) == ([2], [2], [])
    assert (
        u.checkpoint_iteration == CKPT
        and u.stop_iteration == ITERS == u.logged_through
        and u.iterations == ITERS - CKPT
    )
    assert u.checkpoints[2].endswith("stage00002/it000000000002.pt") and u.n_microbatches == f1b_run.gpt.n_microbatches
    assert u.verifiable and not u.needs_data_source
    by = {(f.channel, f.purpose) for f in u.fetch}
    assert by == {
        ("act_1_2", "input"),
        ("grad_3_2", "input"),
        ("meta_2", "meta"),
        ("digest_2_3", "verify"),
        ("digest_2_1", "verify"),
    }
    n_mb = f1b_run.gpt.n_microbatches
    inputs = [f for f in u.fetch if f.purpose == "input"]
    assert sum(f.records for f in inputs) == 2 * (ITERS - CKPT) * n_mb
    # survivors' hot tiers are preferred; the failed stage's own META comes from the cold tier
    assert {(f.channel, f.tier, f.writer) for f in inputs} == {
        ("act_1_2", "hot", "stage1"),
        ("grad_3_2", "hot", "stage3"),
    }
    assert [(f.tier, f.on_failed_node) for f in u.fetch if f.purpose == "meta"] == [("cold", False)]
    assert u.bytes == sum(f.bytes for f in u.fetch) > 0 and plan.bytes == u.bytes
    est = u.estimate
    assert est["fetch_seconds"] > 0 and est["replay_seconds"] > 0 and est["total_seconds"] >= est["replay_seconds"]
    assert plan.estimated_seconds == est["total_seconds"]
    # JSON-able, and it round-trips (the CLI rebuilds plans that a server returned)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["units"][0]["checkpoints"] == {"2": u.checkpoints[2]}
    again = RecoveryPlan.from_dict(d)
    assert again.units[0].fetch == u.fetch and again.units[0].checkpoints == u.checkpoints
    assert (
        plan.fallback["kind"] == "global_rollback"
        and plan.fallback["iteration"] == CKPT
        and plan.fallback["lost_iterations"] == ITERS - CKPT
    )


def test_plan_estimates_scale_with_bandwidth_and_workers(f1b_run):
    with f1b_run.store() as st:
        slow = plan_recovery(st, [1], bandwidth_mbps=0.001, replay_seconds_per_iteration=0.5)
        fast = plan_recovery(st, [1], bandwidth_mbps=1000.0, replay_seconds_per_iteration=0.5, workers=2)
    s, f = slow.units[0].estimate, fast.units[0].estimate
    assert s["replay_seconds"] == f["replay_seconds"] == pytest.approx(0.5 * (ITERS - CKPT))
    assert s["fetch_seconds"] == pytest.approx(slow.units[0].bytes / 1e3)  # 0.001 MB/s
    assert s["total_seconds"] == pytest.approx(s["fetch_seconds"] * (1 + 1 / (ITERS - CKPT)))  # fetch-bound
    assert f["total_seconds"] == pytest.approx(
        f["replay_seconds"] / 2 + f["fetch_seconds"] * (1 + 1 / (ITERS - CKPT)), rel=1e-6, abs=1e-3
    )


def test_a_measured_tier_rate_replaces_its_assumption_and_the_plan_says_so(f1b_run):
    with f1b_run.store() as st:
        assumed = plan_recovery(st, [1], replay_seconds_per_iteration=0.5)
        measured = plan_recovery(st, [1], replay_seconds_per_iteration=0.5, rates={"hot": 0.001})
    hot = sum(f.bytes for f in measured.units[0].fetch if f.tier == "hot")
    assert hot and measured.units[0].estimate["fetch_seconds"] >= hot / 1e3  # 0.001 MB/s for the hot tier
    assert measured.units[0].estimate["fetch_seconds"] > assumed.units[0].estimate["fetch_seconds"]
    assert measured.assumptions["rates_measured"] == ["hot"] and assumed.assumptions["rates_measured"] == []
    assert measured.assumptions["hot_mbps"] == 0.001


def test_two_failed_stages_with_a_logged_boundary_replay_separately(f1b_run):
    with f1b_run.store() as st:
        plan = plan_recovery(st, [1, 2, 3])
    assert plan.possible and [u.stages for u in plan.units] == [[1], [2], [3]]
    last = plan.units[-1]
    assert {f.channel for f in last.fetch if f.purpose == "input"} == {"act_2_3", "target_3"}


def test_adjacent_failed_stages_whose_sends_to_each_other_are_gone_replay_together(f1b_run, tmp_path):
    """Stages 1 and 2 died with their disks: what each sent the other (act_1_2, grad_2_1) never
    reached the cold tier. Planned apart, neither could replay; planned as one unit, the sends
    between them are regenerated and the replay verifies at the unit's edges, bit-exact."""
    from replay import ReplayJob, SourceSpec, jobs_from_plan, replay
    from replay.plan import cold_only_store
    from replay.states import checkpoint_of
    from tests._replay_helpers import checkpoint_vs_live

    _, cold = copy_run_files(f1b_run, tmp_path)
    for ch in ("act_1_2", "grad_2_1"):
        shutil.rmtree(Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / ch)
    with cold_only_store(cold, f1b_run.run_id) as st:
        plan = plan_recovery(st, [1, 2])
        apart = plan_recovery(st, [1], target_iteration=ITERS)
    assert plan.possible and plan.target_iteration == ITERS and [u.stages for u in plan.units] == [[1, 2]]
    assert any("replayed together" in w for w in plan.warnings)
    assert (
        not apart.possible and "grad_2_1" in apart.reasons[0]
    )  # stage 2 did not fail: its sends to stage 1 are needed
    (job,) = jobs_from_plan(
        plan, sources=[SourceSpec(kind="cold", location=cold)], output=str(tmp_path / "out"), **f1b_run.job_fields()
    )
    assert isinstance(job, ReplayJob)
    res = replay(job)
    assert res.verified
    for k in (1, 2):
        assert checkpoint_vs_live(checkpoint_of(res, k), f1b_run.results[k]) == [], k


def test_a_failed_logging_group_replays_together_with_its_survivors(groups_run):
    with groups_run.store() as st:
        plan = plan_recovery(st, [1])
        both = plan_recovery(st, [1, 2])
    assert plan.logging_groups == [[0, 1], [2, 3]]
    (u,) = plan.units
    assert (u.stages, u.failed, u.rolled_back) == ([0, 1], [1], [0]) and plan.possible
    assert {(f.channel, f.purpose) for f in u.fetch} == {
        ("input_0", "input"),
        ("grad_2_1", "input"),
        ("meta_0", "meta"),
        ("meta_1", "meta"),
        ("digest_1_2", "verify"),
    }
    assert u.verifiable and u.checkpoints.keys() == {0, 1}
    assert [x.stages for x in both.units] == [[0, 1], [2, 3]] and [x.rolled_back for x in both.units] == [[0], [3]]
    # without META the groups are inferred from which boundary channels exist
    with groups_run.store() as st:
        assert groups_from_channels(NUM_STAGES, set(st.channels())) == [[0, 1], [2, 3]]
    assert groups_from_channels(3, {Channel.digest(0, 1)}) == [[0], [1, 2]]


def test_a_recorded_gap_makes_the_plan_impossible_and_names_it(gap_run):
    with gap_run.store() as st:
        gaps = st.gaps()
        assert gaps and {g["channel"] for g in gaps} <= {"act_0_1", "input_0", "meta_0"}
        act_gaps = [g for g in gaps if g["channel"] == "act_0_1" and g["iteration"] >= CKPT]
        assert act_gaps, gaps
        plan = plan_recovery(st, [1], target_iteration=ITERS)
    assert not plan.possible and plan.recommended == "global_rollback"
    (u,) = plan.units
    first = min(act_gaps, key=lambda g: (g["iteration"], g["micro_batch"]))
    assert u.missing[0] == f"act_0_1/it{first['iteration']}/mb{first['micro_batch']}/p0"
    assert u.gaps and u.gaps[0]["reason"].startswith("overflow")
    assert "gap was recorded" in plan.reasons[0] and u.missing[0] in plan.reasons[0]
    assert plan.fallback["iteration"] == CKPT and plan.fallback["checkpoints"].keys() == {"0", "1", "2", "3"}
    # by default the plan only goes as far as the logs are complete
    with gap_run.store() as st:
        short = plan_recovery(st, [1])
    assert short.target_iteration == first["iteration"] and (short.possible or first["iteration"] == CKPT)


def test_missing_records_and_targets_beyond_the_logs(f1b_run, tmp_path):
    root, cold = copy_run_files(f1b_run, tmp_path)
    seg = next((Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "act_1_2").glob("000000000004-*"))
    for p in seg.parent.glob(seg.name + "*"):
        p.unlink()  # the cold object of act_1_2, iterations 4..5, and its commit marker
    from replay.plan import cold_only_store

    with cold_only_store(cold, f1b_run.run_id) as st:
        default = plan_recovery(st, [2])
        full = plan_recovery(st, [2], target_iteration=ITERS)
    assert default.possible and default.target_iteration == 4 and default.units[0].logged_through == 4
    assert any("stages committed up to iteration 5: if the survivors stand past 4" in w for w in default.warnings), (
        default.warnings
    )
    assert not full.possible and full.units[0].missing[0] == "act_1_2/it4/mb0/p0"
    assert "first missing record act_1_2/it4/mb0/p0" in full.reasons[0]
    # a target before every checkpoint: nothing to restart from but the beginning
    with f1b_run.store() as st:
        early = plan_recovery(st, [2], target_iteration=1)
    assert not early.possible and "at or below the target 1" in early.reasons[0]
    assert early.fallback["iteration"] is None and "from scratch" in early.fallback["note"]
    # a target far beyond the logs (up to the API's limit): one reason, found at once (a walk would never return)
    with f1b_run.store() as st:
        far = plan_recovery(st, [2], target_iteration=2**53 - 1)
    assert not far.possible and far.units[0].iterations == 2**53 - 1 - 2
    reasons = far.units[0].reasons
    assert (
        len(reasons) == 3
        and reasons[0]
        == f"iteration {ITERS}: no stage has a META record (no stage committed it, or it was garbage-collected)"
    ), reasons
    assert (
        reasons[-1]
        == f"target iteration {2**53 - 1} is beyond the logs: iterations [{ITERS + 1}, {2**53 - 1}) are not logged "
        f"(nor is {ITERS} completely)"
    )
    shutil.rmtree(root)


def test_check_records_names_a_corrupt_record(f1b_run, tmp_path):
    root, _ = copy_run_files(f1b_run, tmp_path)
    key = RecordKey(Channel.activation(1), 3, 1, 0)
    assert corrupt_hot_record(root, f1b_run.run_id, key) == "stage1"
    from logstore import LogStore

    with LogStore.open(root, f1b_run.run_id) as st:  # the node's hot tiers only
        assert plan_recovery(st, [2]).possible  # indexes alone cannot see it
        plan = plan_recovery(st, [2], check_records=True)
    assert (
        not plan.possible
        and str(key) in plan.units[0].missing
        and str(key) in plan.reasons[0]
        and "corrupt" in plan.reasons[0]
    )
    # META and digests are read by the replay too: a corrupt one is named as well (was "verifiable", then exit 3)
    for other in (RecordKey(Channel.meta(2), 4, 0), RecordKey(Channel.digest(2, 1), 4, 1)):
        root, _ = copy_run_files(f1b_run, tmp_path / other.channel.name)
        corrupt_hot_record(root, f1b_run.run_id, other)
        with LogStore.open(root, f1b_run.run_id) as st:
            plan = plan_recovery(st, [2], check_records=True)
        assert not plan.possible and str(other) in plan.reasons[0] and "corrupt" in plan.reasons[0], plan.reasons


def test_bad_arguments_are_refused(f1b_run):
    with f1b_run.store() as st:
        with pytest.raises(ValueError, match="outside the pipeline"):
            plan_recovery(st, [7])
        with pytest.raises(ValueError, match="at least one stage"):
            plan_recovery(st, [])
        plan = plan_recovery(store=st, failed_stages=[0])  # the keyword server.planner uses
    assert plan.possible and plan.units[0].stages == [0]
    with pytest.raises(ValueError, match="at least one LogStore"):
        plan_recovery([], [1])


def test_a_target_below_a_newer_checkpoint_whose_gc_removed_the_logs_says_so(f1b_run, tmp_path):
    """A QA check: with a newer checkpoint (4) whose GC removed the logs below it, a target between the
    two (3) was refused as "no stage committed it" and "beyond the logs". The plan now says first
    that the logs from the older checkpoint on were garbage-collected, and from where a replay can
    start."""
    root, cold = copy_run_files(f1b_run, tmp_path)
    from logstore import LogStore

    with LogStore.open(root, f1b_run.run_id, writer="admin", cold_url=cold) as st:
        st.register_checkpoint(2, 4, uri=f"file://{tmp_path}/it4.pt")
        assert st.gc().to_dict()
        plan = plan_recovery(st, [2], target_iteration=3)
        assert plan_recovery(st, [2]).possible  # from the newer one, to the end of the logs
    u = plan.units[0]
    assert not plan.possible and u.checkpoint_iteration == CKPT and u.newest_checkpoint == 4
    assert (
        u.reasons[0]
        == f"the logs of [{CKPT}, 4) were garbage-collected when stage(s) [2] registered their checkpoint at 4: a "
        "replay starts from it and reaches only iterations from 4 on"
    ), u.reasons
    assert not any("beyond the logs" in r for r in u.reasons), u.reasons
    shutil.rmtree(root)


def test_a_checkpoint_registered_without_a_uri_is_not_planned_from(f1b_run, tmp_path):
    """A registration without a URI (the admin API allows one) cannot be loaded: the plan keeps to
    the newest checkpoint it can load, and says so when there is none."""
    root, cold = copy_run_files(f1b_run, tmp_path)
    from logstore import LogStore

    with LogStore.open(root, f1b_run.run_id, writer="admin", cold_url=cold) as st:
        st.register_checkpoint(2, 4)  # no uri
        plan = plan_recovery(st, [2])
        assert plan.possible and plan.units[0].checkpoint_iteration == CKPT and plan.units[0].checkpoints[2]
    shutil.rmtree(root)
    with LogStore.open(tmp_path / "bare", "bare", writer="admin") as st:
        st.register_checkpoint(1, 0)  # the only one of stage 1, without a URI
        bare = plan_recovery(st, [1], num_stages=2)
    assert (
        not bare.possible
        and "the checkpoints of stage(s) [1] were registered without a URI: nothing to load them from"
        in bare.reasons[0]
    ), bare.reasons
