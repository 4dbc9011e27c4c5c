"""``swiftlog agent``: real agent processes, one per "host" (its own 127.0.0.x and store root).

Each case runs the example GPT pipeline (4 stages, 2 nodes x 2 ranks, 1 spare node) under the
agents, injects a failure and compares every rank's final state bitwise with the failure-free run
of the same arguments (the shared references).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from replay.agent.local import LocalCluster
from tests._recovery_helpers import Reference, assert_same_as, pipeline_args

pytestmark = pytest.mark.slow

SCRIPT = "trainer_client.examples.train_resilient"


def _results(c: LocalCluster) -> Reference:
    return Reference({k: torch.load(c.out / f"stage{k}.pt", weights_only=False) for k in range(4)})


def _finish(c: LocalCluster) -> Reference:
    rc = c.wait(timeout_s=300)
    assert rc == 0, "\n".join(f"--- {p.log.name}\n{p.output()[-4000:]}" for p in c.nodes)
    return _results(c)


def _sources(res: Reference, rank: int) -> dict[str, int]:
    """Records the replacement of ``rank`` read, per source kind."""
    out: dict[str, int] = {}
    for s in res.results[rank]["recovered"]["sources"]:
        out[s["kind"]] = out.get(s["kind"], 0) + s["records"]
    return out


def test_a_dead_process_is_replaced_on_its_node(tmp_path: Path, references: Any) -> None:
    extra = ("--data-source",)
    c = LocalCluster(
        tmp_path, SCRIPT, pipeline_args(tmp_path, "1f1b", extra), node0_args=["--inject-kill", "1:3,1,backward"]
    ).start()
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=extra))
    # the replacement ran on node 0, the rank's own node; the spare took nothing
    assert (tmp_path / "node0" / "agent-logs" / "stage1-g1.log").is_file()
    assert not list((tmp_path / "spare1").glob("stage*"))
    assert res.results[1]["recovered"]["path"] == "replay"
    # its neighbours: stage 0 on its own node is read from its store root, stage 2 (node 1) over HTTP
    src = _sources(res, 1)
    assert src.get("store", 0) > 0 and src.get("http", 0) > 0, src


def test_node_loss_a_spare_takes_its_ranks_from_cold_and_http(tmp_path: Path, references: Any) -> None:
    """Node 1 (ranks 2 and 3) is SIGKILLed with its agent and its store root deleted: the spare
    starts both replacements; they read node 0's hot tiers over its node servers and the lost
    node's own records (the last stage's targets) from the cold tier."""
    c = LocalCluster(tmp_path, SCRIPT, pipeline_args(tmp_path, "1f1b"), agent_args=["--node-timeout", "1.0"]).start()
    c.wait_for_iteration(2)
    c.lose_node(1)
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=()))
    for rank in (2, 3):
        assert (tmp_path / "spare1" / "agent-logs" / f"stage{rank}-g1.log").is_file()
    src = _sources(res, 3)
    assert src.get("http", 0) > 0, src  # node 0's hot tiers, over the network
    assert src.get("cold", 0) > 0, src  # what only the lost node had
    assert "node 1 lost" in c.node(0).output()


def test_a_hung_rank_is_found_and_only_it_replaced(tmp_path: Path, references: Any) -> None:
    """Rank 1 stops in the forward of iteration 3 (its process and heartbeat live on); its
    neighbours stall waiting on it. The leader kills the busy one only, and it is replaced."""
    extra = ("--data-source",)
    c = LocalCluster(
        tmp_path,
        SCRIPT,
        pipeline_args(tmp_path, "1f1b", extra),
        agent_args=["--hang-timeout", "step=3"],
        node0_args=["--inject-kill", "1:3,1,hang"],
    ).start()
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=extra))
    out = c.node(0).output()
    assert "hang: rank 1 (stage1-g0) made no progress" in out, out[-3000:]
    assert "rcs={'stage0-g0': 0, 'stage1-g0': -9, 'stage2-g0': 0, 'stage3-g0': 0, 'stage1-g1': 0}" in out
