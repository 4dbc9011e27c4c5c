"""Whether a run with data-parallel replicas needs its logs: the node map, the client switching
logging off where no machine holds every replica of a stage, and ``swiftlog plan --node-map``
pricing it from a real mesh run's logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logstore.errors import ConfigError
from replay import plan_replica_logging
from replay.launcher import run_with_failures
from tests._cli_helpers import ok, swiftlog
from trainer_client import ClientConfig, MeshLayout, SwiftlogClient


def test_a_stage_is_exposed_when_one_machine_holds_every_replica() -> None:
    m = MeshLayout(2, 2)  # ranks: stage 0 -> 0, 1; stage 1 -> 2, 3
    spread = plan_replica_logging(m, ["a", "b", "a", "b"])
    assert (spread.logging_needed, spread.exposed) == (False, {})
    assert "healed by a copy" in spread.why and "recomputes up to the checkpoint interval" in spread.double_failure
    packed = plan_replica_logging(m, {"0": "a", "1": "a", "2": "a", "3": "b"})
    assert (packed.logging_needed, packed.exposed) == (True, {0: ["a"]})
    assert packed.machines == {0: ["a"], 1: ["a", "b"]} and "stage(s) 0 (a)" in packed.why
    with pytest.raises(ValueError, match=r"ranks \[3\] missing"):
        plan_replica_logging(m, ["a", "b", "a"])


def test_the_client_logs_nothing_when_no_stage_can_lose_all_its_replicas(tmp_path: Path) -> None:
    base = {"run_id": "r", "stage": 1, "num_stages": 2, "store_root": str(tmp_path), "dp_replicate": 2}
    off = ClientConfig(**base, replica=1, node_map=["a", "b", "a", "b"], replica_logging="when_exposed")
    assert off.logging_off_reason is not None
    client = SwiftlogClient(off)
    try:
        assert client.recorder.enabled is False
    finally:
        client.close()
    on = ClientConfig(**base, replica=1, node_map=["a", "a", "b", "b"], replica_logging="when_exposed")
    assert on.logging_off_reason is None  # stage 0's replicas share machine a
    assert ClientConfig(**base, node_map=["a", "b", "a", "b"]).logging_off_reason is None  # "always"
    with pytest.raises(ConfigError, match="needs dp_replicate > 1 and a node_map"):
        ClientConfig(**base, replica_logging="when_exposed")
    with pytest.raises(ConfigError, match=r"node_map: .*ranks \[4\] outside it"):
        ClientConfig(**base, node_map=["a", "b", "a", "b", "c"])


def test_swiftlog_plan_prices_switching_the_logs_off_from_a_mesh_runs_logs(tmp_path: Path) -> None:
    """A dp_replicate=2 x pp=2 run of the template script, checkpoints every 3 iterations: the
    plan over one node's root and the cold tier measures both replicas' logs per iteration and
    the checkpoint interval a double failure would roll back by."""
    base = tmp_path / "run"
    base.mkdir()
    r = run_with_failures(
        ["--iters", "7", "--ckpt-at", "0,3,6", "--cold-url", f"file://{base / 'cold'}"],
        run_id="mesh",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=2,
        dp_replicate=2,
        timeout_s=120,
        script="trainer_client.examples.minimal_resilient",
    )
    assert r.ok, r.describe()
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps(["host-a", "host-b", "host-a", "host-b"]))
    root = base / "nodes" / "stage0-dp0-g0"
    plan = ("plan", "--root", root, "--run", "mesh", "--dp-replicate", "2", "--node-map", nodes)
    cold = ("--cold-url", f"file://{base / 'cold'}")
    p = ok(swiftlog(*plan, *cold, "--json"))
    doc = json.loads(p.stdout)
    assert doc["runs_measured"] == ["mesh.dp0", "mesh.dp1"]  # replica 1's logs from the cold tier
    assert doc["logging_needed"] is False and doc["checkpoints"] == [0, 3, 6] and doc["checkpoint_interval"] == 3
    assert (
        doc["stored_bytes_per_iteration"] > 0
        and doc["raw_bytes_per_iteration"] >= doc["stored_bytes_per_iteration"] / 4
    )
    text = ok(swiftlog(*plan, *cold)).stdout
    assert "logs needed: no" in text and "switching them off saves" in text and "up to 3 iterations" in text
