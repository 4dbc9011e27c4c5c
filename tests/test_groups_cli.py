"""Selective logging end to end on a real run: ``swiftlog profile`` measures a 1F1B run's costs
(replaying each stage to time it), ``swiftlog plan-groups`` and ``GET /logging-groups`` choose
groups within a budget, and ``ClientConfig`` takes the plan as it comes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from server.cli import app
from server.testing import ServerProcess
from tests._replay_helpers import EXAMPLE_MODEL, copy_run_files

pytest_plugins = ["tests._replay_fixtures"]

runner = CliRunner()


@pytest.fixture(scope="module")
def profiled(f1b_run, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str, dict]:
    """A private copy of the 1F1B run, profiled: (root, cold_url, run id, profile)."""
    root, cold = copy_run_files(f1b_run, tmp_path_factory.mktemp("profiled"))
    args = ["profile", "--root", root, "--run", f1b_run.run_id, "--cold-url", cold, "--model", EXAMPLE_MODEL]
    r = runner.invoke(app, [*args, "--checkpoint-interval", "10", "--domains", "0,0,1,1", "--json"])
    assert r.exit_code == 0, r.output
    return root, cold, f1b_run.run_id, json.loads(r.stdout)


@pytest.mark.slow
def test_a_profile_measures_bytes_rates_and_replay_times(profiled) -> None:
    _, _, _, p = profiled
    assert p["num_stages"] == 4 and len(p["activation_bytes"]) == 3
    assert all(b > 0 for b in p["activation_bytes"] + p["gradient_bytes"])
    assert all(t > 0 for t in p["replay_s"]) and p["fetch_mbps"] > 0
    assert p["sources"]["replay_s"].startswith("measured") and p["sources"]["activation_bytes"].startswith("measured")
    assert p["domains"] == [0, 0, 1, 1] and p["checkpoint_interval"] == 10 and p["n_microbatches"] >= 1


@pytest.mark.slow
def test_plan_groups_within_half_the_all_logged_size_feeds_the_client(profiled, tmp_path: Path) -> None:
    from trainer_client import ClientConfig

    root, cold, run, _ = profiled
    args = ["plan-groups", "--root", root, "--run", run, "--cold-url", cold]
    r = runner.invoke(app, [*args, "--budget", "50%", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert sum(plan["sizes"]) == 4 and plan["stored_bytes"] <= plan["budget_bytes"]
    assert plan["budget_bytes"] == pytest.approx(plan["all_logged"]["stored_bytes"] / 2)
    assert plan["greedy"]["gap"] >= 0
    cfg = ClientConfig(run_id=run, stage=0, num_stages=4, store_root=str(tmp_path), logging_groups=plan)
    assert list(cfg.logging_groups) == plan["sizes"]
    text = runner.invoke(app, [*args, "--budget", "50%"])
    assert text.exit_code == 0 and "SWIFT greedy" in text.stdout and "all logged" in text.stdout, text.output
    # a budget below the cheapest cut: exit 2, naming what it needs
    small = runner.invoke(app, [*args, "--budget", "1KB"])
    assert small.exit_code == 2 and "too small" in small.output and "needs" in small.output, small.output
    bad = runner.invoke(app, [*args, "--budget", "lots"])
    assert bad.exit_code == 2 and "is not a size" in bad.output


@pytest.mark.slow
def test_the_admin_api_serves_the_profile_and_plans_groups(profiled) -> None:
    root, cold, run, p = profiled
    with ServerProcess(root, cold_url=cold) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get(f"/v1/runs/{run}/profile").json()["activation_bytes"] == p["activation_bytes"]
        ok = c.get(f"/v1/runs/{run}/logging-groups", params={"budget_fraction": 0.5, "recovery": "in_place"})
        assert ok.status_code == 200 and ok.json()["recovery"] == "in_place", ok.text
        for params, status in (
            ({}, 400),  # no budget
            ({"budget_bytes": 1}, 400),  # too small: the message names what it needs
            ({"budget_bytes": -1}, 422),
            ({"budget_fraction": "half"}, 422),
            ({"budget_bytes": 1e9, "recovery": "teleport"}, 422),
        ):
            r = c.get(f"/v1/runs/{run}/logging-groups", params=params)
            assert r.status_code == status, (params, r.text)
        assert "needs" in c.get(f"/v1/runs/{run}/logging-groups", params={"budget_bytes": 1}).json()["error"]["message"]
        assert c.get("/v1/runs/nope/logging-groups", params={"budget_fraction": 0.5}).status_code == 404


@pytest.mark.slow
def test_a_run_with_groups_cannot_be_profiled_and_an_unprofiled_run_has_no_plan(groups_run, f1b_run, tmp_path) -> None:
    root, cold = copy_run_files(groups_run, tmp_path / "g")
    r = runner.invoke(app, ["profile", "--root", root, "--run", groups_run.run_id, "--cold-url", cold])
    assert r.exit_code == 2 and "every boundary" in r.output, r.output
    plain = ["plan-groups", "--root", f1b_run.root, "--run", f1b_run.run_id, "--budget", "50%"]
    r = runner.invoke(app, plain)
    assert r.exit_code == 3 and "no cost profile" in r.output and "swiftlog profile" in r.output, r.output
