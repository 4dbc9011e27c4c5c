"""The failure simulator (replay.sim): exact where a closed form exists, sane everywhere else.

- global rollback under exponential failures against the exact expectation (Daly), within the
  confidence interval the simulation reports;
- the breakdown adds up to the total; without failures the total is the work plus its overheads;
- properties (hypothesis): more failures, a dearer restart or a slower replay never make a plan
  cheaper; more replay workers never make it dearer; a trace replays exactly;
- every strategy at the Llama-3-405B-like layout, the replica strategy only with replicas;
- ``swiftlog simulate`` end to end (table, --json, errors).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.sim import (
    BUCKETS,
    LLAMA3_405B,
    REPLICATED_405B,
    STRATEGIES,
    Layout,
    ScaleInputs,
    expected_waste,
    flips,
    make_plan,
    measured_inputs,
    rollback_expected_time,
    simulate,
    simulate_plan,
    sweep,
    wasted_series,
)
from replay.sim.engine import run_once

SMALL = Layout(tp=8, pp=4, dp_shard=4, dp_replicate=1)  # 16 nodes
BY_NAME = {s.name: s for s in STRATEGIES}


def _inputs(**kw: object) -> ScaleInputs:
    base = dict(
        params=1e9,
        iteration_s=1.0,
        work_s=20_000.0,
        failures_per_node_hour=1.0,
        correlated_fraction=0.0,
        detect_s=5.0,
        restart_job_s=40.0,
        replace_node_s=10.0,
        ckpt_sync_s=10.0,
    )
    return ScaleInputs(**(base | kw))  # type: ignore[arg-type]


def test_rollback_matches_the_exact_expectation() -> None:
    x = _inputs()
    plan = make_plan(BY_NAME["global_rollback"], SMALL, x, persistent_s=500.0)
    res = simulate_plan(plan, reps=300, seed=3)
    recovery = x.detect_s + x.restart_job_s + x.node_state_bytes(SMALL) / x.ckpt_read_bps
    exact = rollback_expected_time(x.work_s, plan.persistent_s, plan.persistent_stall_s, recovery, plan.rate)
    assert res.incidents > 50  # failures do matter here
    assert abs(res.total_s - exact) <= res.ci95_s, (res.total_s, exact, res.ci95_s)


def test_breakdown_adds_up_and_no_failures_cost_only_overheads() -> None:
    x = _inputs()
    for name in ("global_rollback", "in_memory", "logging", "combined"):
        plan = make_plan(BY_NAME[name], SMALL, x, persistent_s=400.0, memory_s=100.0)
        r = run_once(plan, random.Random(1))
        assert sum(r.buckets.values()) == pytest.approx(r.total_s, rel=1e-9)
        assert set(r.buckets) == set(BUCKETS)
    quiet = _inputs(failures_per_node_hour=0.0)
    plan = make_plan(BY_NAME["logging"], SMALL, quiet, persistent_s=400.0)
    r = run_once(plan, random.Random(1))
    checkpoints = int(quiet.work_s / plan.persistent_s) - 1
    assert r.incidents == 0
    assert r.total_s == pytest.approx(quiet.work_s * plan.slowdown + checkpoints * plan.persistent_stall_s)


def test_a_trace_replays_exactly() -> None:
    x = _inputs()
    plan = make_plan(BY_NAME["logging"], SMALL, x, persistent_s=1000.0)
    r = run_once(plan, random.Random(0), trace=[(1500.0, 3)])
    replay = 500.0 * x.replay_ratio(SMALL) / x.parallel_speedup(x.replay_workers)
    load = x.node_state_bytes(SMALL) / x.ckpt_read_bps
    assert r.incidents == 1 and r.rollbacks == 0
    assert r.buckets["replay"] == pytest.approx(replay)
    assert r.buckets["restart"] == x.replace_node_s and r.buckets["load"] == pytest.approx(load)
    rb = run_once(make_plan(BY_NAME["global_rollback"], SMALL, x, persistent_s=1000.0), random.Random(0), [(1500.0, 3)])
    assert rb.rollbacks == 1 and rb.buckets["lost_work"] == pytest.approx(500.0)


@settings(max_examples=25, deadline=None)
@given(
    strategy=st.sampled_from([s.name for s in STRATEGIES if s.name != "replica"]),
    rate=st.floats(0.01, 2.0),
    factor=st.floats(1.0, 10.0),
    interval=st.floats(100.0, 5000.0),
)
def test_more_failures_or_dearer_recoveries_never_help(
    strategy: str, rate: float, factor: float, interval: float
) -> None:
    s = BY_NAME[strategy]
    x = _inputs(failures_per_node_hour=rate)

    def waste(inp: ScaleInputs) -> float:
        return expected_waste(make_plan(s, SMALL, inp, interval, interval / 4), samples=60)

    w = waste(x)
    assert waste(x.with_(failures_per_node_hour=rate * factor)) >= w - 1e-12
    assert waste(x.with_(restart_job_s=x.restart_job_s * factor, replace_node_s=x.replace_node_s * factor)) >= w - 1e-12
    assert waste(x.with_(replay_efficiency=1.0 / factor)) >= w - 1e-12
    assert waste(x.with_(replay_workers=4)) <= waste(x.with_(replay_workers=1)) + 1e-12


def test_more_failures_lengthen_the_simulated_run() -> None:
    x = _inputs()
    plan = make_plan(BY_NAME["global_rollback"], SMALL, x, persistent_s=500.0)
    more = make_plan(BY_NAME["global_rollback"], SMALL, x.with_(failures_per_node_hour=3.0), persistent_s=500.0)
    a, b = simulate_plan(plan, reps=40, seed=1), simulate_plan(more, reps=40, seed=1)
    assert b.total_s - b.ci95_s > a.total_s + a.ci95_s


def test_every_strategy_at_405b_scale() -> None:
    x = measured_inputs()
    res = simulate(LLAMA3_405B, x, reps=4)
    names = {r.strategy for r in res.rows}
    assert names == {s.name for s in STRATEGIES} - {"replica"}
    assert "replica" in res.skipped and "dp_replicate" in res.skipped["replica"]
    for r in res.rows:
        assert 0 < r.wasted_fraction < 0.5 and sum(r.breakdown.values()) == pytest.approx(1.0, rel=1e-6)
    logging = next(r for r in res.rows if r.strategy == "logging")
    assert logging.rollbacks == 0 and logging.breakdown["replay"] > 0
    rep = simulate(REPLICATED_405B, x, ["replica", "global_rollback"], reps=4)
    by = {r.strategy: r for r in rep.rows}
    assert by["replica"].total_s < by["global_rollback"].total_s
    doc = res.to_dict()
    assert doc["input_sources"]["failures_per_node_hour"].startswith("Llama 3")
    assert json.dumps(doc)


def test_flips_name_the_inputs_that_change_the_winner() -> None:
    x = measured_inputs()
    f = flips(LLAMA3_405B, x, ["global_rollback", "logging"], factors=(0.1, 10.0), names=("restart_job_s",))
    assert [n for n, _ in f["ranking"]] and {c["input"] for c in f["flips"]} <= {"restart_job_s"}
    # a job restart ten times dearer favours logging, ten times cheaper favours rollback
    ranks = {c["factor"]: c["best"] for c in f["flips"]}
    assert set(ranks.values()) <= {"global_rollback", "logging"}


def test_a_sweep_gives_one_line_per_strategy() -> None:
    runs = sweep(SMALL, _inputs(work_s=5000.0), [128, 256], ["logging", "global_rollback"], reps=2)
    lines = wasted_series(runs)
    assert list(lines) == ["global_rollback", "logging"]
    assert all(xs == [128, 256] and len(ys) == 2 and all(0 < y < 1 for y in ys) for xs, ys in lines.values())


def test_bad_layouts_and_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="tp"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="multiple"):
        LLAMA3_405B.with_gpus(1000)
    with pytest.raises(ValueError, match="unknown input"):
        ScaleInputs().with_(nonsense=1)
    with pytest.raises(ValueError, match="detect_s"):
        ScaleInputs(detect_s=-1.0)
    with pytest.raises(ValueError, match="unknown strategy"):
        simulate(SMALL, _inputs(), ["nope"])


def test_cli_simulate(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from server.cli import app

    runner = CliRunner()
    plot = tmp_path / "sim.png"
    out = runner.invoke(
        app, ["simulate", "--gpus", "1024", "--gpus", "2048", "--reps", "3", "--json", "--plot", str(plot)]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert set(doc["sizes"]) == {"1024", "2048"} and plot.stat().st_size > 0
    assert doc["sizes"]["2048"]["layout"]["nodes"] == 256
    table = runner.invoke(app, ["simulate", "--gpus", "1024", "--reps", "2", "--strategy", "logging"])
    assert table.exit_code == 0 and "logging" in table.stdout and "inputs:" in table.stdout
    bad = runner.invoke(app, ["simulate", "--gpus", "1000", "--json"])
    assert bad.exit_code == 2 and "multiple" in json.loads(bad.stdout)["error"]["message"]
    bad = runner.invoke(app, ["simulate", "--set", "restart_job_s=-5"])
    assert bad.exit_code == 2 and "restart_job_s" in bad.output
