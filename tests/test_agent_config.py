"""The agent's pieces that need no cluster: its configuration, its command line, the hang rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replay.agent import AgentConfig
from replay.agent._leader import hang_culprit
from replay.launcher import KillSpec
from server.testing import subprocess_env

BASE = dict(
    nnodes=2,
    nproc_per_node=2,
    node_rank=0,
    rdzv_endpoint="127.0.0.2:29500",
    module="trainer_client.examples.train_resilient",
    run_id="r",
    store_root="/tmp/x",
    checkpoint_url="file:///tmp/ck",
    out="/tmp/out",
)


def test_a_config_names_the_mesh_it_makes() -> None:
    cfg = AgentConfig(**BASE, dp_replicate=2)
    assert cfg.world_size == 4 and cfg.layout.num_stages == 2 and cfg.store_address == ("127.0.0.2", 29500)
    assert cfg.process_root("stage1-g0") == "/tmp/x/stage1-g0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"node_rank": 2}, "node_rank must be in 0..1"),
        ({"nproc_per_node": 1, "dp_replicate": 2}, "do not make a pipeline"),
        ({"rdzv_endpoint": "nohost"}, "HOST:PORT"),
        ({"mode": "fast"}, "mode must be"),
        ({"hang_timeouts": (("forward", 3.0),)}, "hang timeout forward=3.0"),
        ({"node_timeout_s": 0.3, "heartbeat_s": 0.2}, "two heartbeats"),
        ({"kills": (KillSpec(4, 1),)}, "outside the mesh"),
        ({"groups": (2, 1)}, r"adding up to 4 stages"),
        ({"groups": (2, 2), "group_recovery": "teleport"}, "group_recovery must be"),
        ({"group_recovery": "in_place"}, "needs the logging groups"),
        ({"groups": (2, 2), "nproc_per_node": 4, "dp_replicate": 2}, "dp_replicate or dp_shard > 1"),
        ({"nproc_per_node": 4, "dp_shard": 2, "replay_workers": 2}, "replay helpers with dp_shard > 1"),
        ({"nproc_per_node": 1, "dp_shard": 2}, "2 shard\\(s\\)"),
    ],
)
def test_a_config_that_cannot_work_says_what(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentConfig(**{**BASE, **change})


def _stalled(rank: int, state: str, since: float) -> tuple[int, tuple, float]:
    return (rank, (f"stage{rank}-g0", 7, "step", state), since)


def test_the_culprit_of_a_hang_is_the_busy_rank_not_those_waiting_on_it() -> None:
    # rank 2 waited on rank 1 before rank 1 stopped moving: the busy one is still the culprit
    stalled = [_stalled(0, "waiting", 10.0), _stalled(1, "busy", 10.5), _stalled(2, "waiting", 9.0)]
    assert hang_culprit(stalled)[0] == 1
    # every one waiting (a collective stuck everywhere): the earliest stalled
    assert hang_culprit([_stalled(0, "waiting", 10.0), _stalled(2, "waiting", 9.0)])[0] == 2
    with pytest.raises(ValueError):
        hang_culprit([])


def test_the_command_line_refuses_a_node_without_a_rank_or_spare() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "server.cli", "agent", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-endpoint", "127.0.0.2:1", "--run-id", "r", "--store-root", "/tmp/x",
         "--checkpoint-url", "file:///tmp/c", "--out", "/tmp/o", "-m", "m"],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--node-rank" in r.stderr and "--spare" in r.stderr, r.stderr


def test_measured_fetch_rates_reach_the_plan_estimate(tmp_path) -> None:
    """A replay's per-tier read rates go into the job's store; measured_rates gives them to
    plan_recovery, whose estimate then uses them and says so (the other tier stays assumed)."""
    from replay import SourceSpec, measured_rates
    from replay.survivors import CountingSource, record_rates
    from trainer_client import RecoveryKeys, loopback_store

    host = loopback_store()
    http, cold = CountingSource(None), CountingSource(None)
    http.bytes, http.seconds = 50_000_000, 0.5  # 100 MB/s
    cold.bytes, cold.seconds = 1000, 1.0  # too little to tell a rate
    specs = [SourceSpec(kind="http", location="http://127.0.0.2:1"), SourceSpec(kind="cold", location="file:///x")]
    record_rates(host, RecoveryKeys("r"), specs, [http, cold])
    assert measured_rates(host, "r") == {"hot": 100.0}
    assert measured_rates(host, "other") == {}

    from replay._plan_fetch import tier_rates
    from replay.plan import DEFAULT_COLD_MBPS

    assert tier_rates(None, {"hot": 100.0}) == (100.0, DEFAULT_COLD_MBPS)
    assert tier_rates(7.0, {"hot": 100.0}) == (7.0, 7.0)  # an explicit bandwidth wins
