"""``swiftlog agent``: real agent processes, one per "host" (its own 127.0.0.x and store root).

Each case runs the example GPT pipeline (4 stages, 2 nodes x 2 ranks, 1 spare node) under the
agents, injects a failure and compares every rank's final state bitwise with the failure-free run
of the same arguments (the shared references).
"""

from __future__ import annotations

import datetime
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from replay.agent.hosts import NamespaceHosts, namespaces_available
from replay.agent.local import LocalCluster
from replay.compare import states_equal
from tests._recovery_helpers import Reference, assert_same_as, pipeline_args
from trainer_client.mesh import MeshLayout

pytestmark = pytest.mark.slow

SCRIPT = "trainer_client.examples.train_resilient"


@pytest.fixture(params=["loopback", "namespaces"])
def hosts(request: pytest.FixtureRequest) -> Any:
    """None: every host a 127.0.0.x of this machine; else 3 namespaced hosts on 1 Gbit/s links."""
    if request.param == "loopback":
        yield None
        return
    why = namespaces_available()
    if why and os.environ.get("SWIFTLOG_REQUIRE_NAMESPACES") == "1":  # CI: never passed over
        pytest.fail(f"namespaced hosts are required here (SWIFTLOG_REQUIRE_NAMESPACES=1): {why}")
    if why:  # a developer's machine without root: the loopback-host variant of each case still runs
        pytest.skip(f"namespaced hosts: {why}")
    with NamespaceHosts(3, rate="1gbit") as h:
        yield h


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


def test_a_dead_process_is_replaced_on_its_node(tmp_path: Path, references: Any, hosts: Any) -> None:
    extra = ("--data-source",)
    c = LocalCluster(
        tmp_path,
        SCRIPT,
        pipeline_args(tmp_path, "1f1b", extra),
        node0_args=["--inject-kill", "1:3,1,backward"],
        hosts=hosts,
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


def test_a_logging_group_recovers_in_place_under_the_agents(tmp_path: Path, references: Any) -> None:
    """Groups [2,2], stage 1 killed: only it is replaced; stage 0, its group's live member on the
    same node, reloads its checkpoint in its own process and replays with the replacement."""
    extra = ("--data-source", "--groups", "2,2")
    c = LocalCluster(
        tmp_path,
        SCRIPT,
        pipeline_args(tmp_path, "1f1b", extra),
        agent_args=["--groups", "2,2", "--group-in-place"],
        node0_args=["--inject-kill", "1:3,1,backward"],
    ).start()
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=extra, groups=[2, 2]))
    logs = tmp_path / "node0" / "agent-logs"
    assert (logs / "stage1-g1.log").is_file() and not (logs / "stage0-g1.log").exists()
    ev = res.results[0]["events"][0]
    assert ev["replayed_in_place"] == [0, 1] and ev["replaced"] == [1], ev


def test_node_loss_a_spare_takes_its_ranks_from_cold_and_http(tmp_path: Path, references: Any, hosts: Any) -> None:
    """Node 1 (ranks 2 and 3) is SIGKILLed with its agent and its store root deleted: the spare
    starts both replacements; they read node 0's hot tiers over its node servers and the lost
    node's own records (the last stage's targets) from the cold tier. Namespaced, every byte the
    spare read from node 0 crossed its link."""
    c = LocalCluster(
        tmp_path, SCRIPT, pipeline_args(tmp_path, "1f1b"), agent_args=["--node-timeout", "1.0"], hosts=hosts
    ).start()
    c.wait_for_iteration(2)
    link = hosts.link_bytes(2) if hosts else None
    c.lose_node(1)
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=()))
    for rank in (2, 3):
        assert (tmp_path / "spare1" / "agent-logs" / f"stage{rank}-g1.log").is_file()
    src = _sources(res, 3)
    assert src.get("http", 0) > 0, src  # node 0's hot tiers, over the network
    assert src.get("cold", 0) > 0, src  # what only the lost node had
    assert "node 1 lost" in c.node(0).output()
    if hosts is not None:
        http = sum(s["bytes"] for k in (2, 3) for s in res.results[k]["recovered"]["sources"] if s["kind"] == "http")
        received = hosts.link_bytes(2)["in"] - link["in"]
        assert received > http / 2, (received, http)  # the records came over the spare's link (compressed)


def test_a_hung_rank_is_found_and_only_it_replaced(tmp_path: Path, references: Any, hosts: Any) -> None:
    """Rank 1 stops in the forward of iteration 3 (its process and heartbeat live on); its
    neighbours stall waiting on it. The leader kills the busy one only, and it is replaced."""
    extra = ("--data-source",)
    c = LocalCluster(
        tmp_path,
        SCRIPT,
        pipeline_args(tmp_path, "1f1b", extra),
        agent_args=["--hang-timeout", "step=3"],
        node0_args=["--inject-kill", "1:3,1,hang"],
        hosts=hosts,
    ).start()
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=extra))
    out = c.node(0).output()
    assert "hang: rank 1 (stage1-g0) made no progress" in out, out[-3000:]
    assert "rcs={'stage0-g0': 0, 'stage1-g0': -9, 'stage2-g0': 0, 'stage3-g0': 0, 'stage1-g1': 0}" in out


def test_losing_the_store_host_ends_in_a_clean_global_restart(tmp_path: Path, references: Any, hosts: Any) -> None:
    """Node 0 (the job's store and the leader) is lost: every other agent stops its processes and
    exits 4 (unavailable); the job restarted with --resume --attempt 1 starts every rank from the
    newest common checkpoint and ends bit-exact."""
    extra = ("--data-source",)
    args = pipeline_args(tmp_path, "1f1b", extra)
    c = LocalCluster(tmp_path, SCRIPT, args, hosts=hosts).start()
    c.wait_for_iteration(3)
    c.lose_node(0)
    for p in c.nodes[:-1]:  # node 1 and the spare
        assert p.proc.wait(timeout=60) == 4, p.output()[-3000:]
        assert "the job's store" in p.output() and "--resume" in p.output()
    again = LocalCluster(tmp_path, SCRIPT, args, hosts=hosts, agent_args=["--resume", "--attempt", "1"]).start()
    res = _finish(again)
    assert_same_as(res, references.get("1f1b", extra=extra))
    assert re.search(r"every rank resumes from checkpoint [24]\b", again.node(0).output())


def test_losing_a_helpers_node_during_a_replay_still_ends_bit_exact(
    tmp_path: Path, references: Any, hosts: Any
) -> None:
    """Rank 1 dies; its replacement (node 0) replays with a helper the leader placed on a survivor
    node; that node is lost as soon as the replay job is out. The replacement replays alone (the
    spare held the helper) or the job rolls back (node 1 held it, with ranks 2 and 3): either way
    the final states are the failure-free run's."""
    extra = ("--data-source",)
    c = LocalCluster(
        tmp_path,
        SCRIPT,
        pipeline_args(tmp_path, "1f1b", extra),
        agent_args=["--replay-workers", "2", "--node-timeout", "1.0"],
        node0_args=["--inject-kill", "1:3,1,backward"],
        hosts=hosts,
    ).start()
    store, job = c.store(), "swiftlog/rec/recovery/gen0/replay_job/1"
    store.wait([job], datetime.timedelta(seconds=120))
    helper_on = [p for p in c.nodes if (p.root / "agent-logs" / "stage1-g1-helper1.log").is_file()]
    assert len(helper_on) == 1 and helper_on[0].node != 0  # on a survivor node, not the replacement's
    c.lose_node(helper_on[0].node) if helper_on[0].node is not None else c.lose_spare(helper_on[0])
    res = _finish(c)
    assert_same_as(res, references.get("1f1b", extra=extra))


MESH_SCRIPT = "trainer_client.examples.minimal_resilient"


def _mesh_args(base: Path) -> list[str]:
    return ["--iters", "7", "--ckpt-at", "0,3", "--cold-url", f"file://{base / 'cold'}"]


def _mesh_results(c: LocalCluster) -> dict[int, Any]:
    rc = c.wait(timeout_s=300)
    assert rc == 0, "\n".join(f"--- {p.log.name}\n{p.output()[-4000:]}" for p in c.nodes)
    layout = MeshLayout(2, 2)
    return {
        k: torch.load(c.out / f"stage{layout.coord(k).stage}-dp{layout.coord(k).replica}.pt", weights_only=False)
        for k in range(4)
    }


def _same_as_mesh_reference(got: dict[int, Any], references: Any) -> None:
    ref = references.failure_free(_mesh_args, run_id="mesh", num_stages=2, script=MESH_SCRIPT, dp_replicate=2)
    diffs = {k: states_equal(got[k], ref.results[k]) for k in range(4)}
    assert not any(diffs.values()), {k: v[:5] for k, v in diffs.items() if v}


def test_a_mesh_under_the_agents_copies_a_lost_replica(tmp_path: Path, references: Any) -> None:
    """dp_replicate=2 x pp=2 on 2 nodes: rank 3 (stage 1, replica 1) dies; its replacement on its
    node receives the state of rank 2, the live replica (no replay)."""
    c = LocalCluster(
        tmp_path,
        MESH_SCRIPT,
        _mesh_args(tmp_path),
        run_id="mesh",
        agent_args=["--dp-replicate", "2"],
        node0_args=["--inject-kill", "3:4,0,forward"],
    ).start()
    got = _mesh_results(c)
    _same_as_mesh_reference(got, references)
    assert (got[3]["recovered"]["path"], got[3]["recovered"]["donor"]) == ("replica", 2)


def test_a_node_holding_every_replica_of_a_stage_is_replayed_on_the_spare(
    tmp_path: Path, references: Any, hosts: Any
) -> None:
    """Node 1 holds both replicas of stage 1 (one failure domain): lost with its store root, both
    replacements start on the spare and replay their pipelines' logs together (repeating the
    replicas' average between them)."""
    c = LocalCluster(
        tmp_path,
        MESH_SCRIPT,
        _mesh_args(tmp_path),
        run_id="mesh",
        agent_args=["--dp-replicate", "2", "--node-timeout", "1.0"],
        hosts=hosts,
    ).start()
    ckpts = [tmp_path / "ckpt" / f"dp{r}" / "stage00001" / "it000000000003.pt" for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(p.is_file() for p in ckpts):  # the template script keeps no progress key: its checkpoints
        assert time.monotonic() < deadline and c.node(0).proc.poll() is None
        time.sleep(0.05)
    c.lose_node(1)
    got = _mesh_results(c)
    _same_as_mesh_reference(got, references)
    assert {got[k]["recovered"]["path"] for k in (2, 3)} == {"replay"}


def test_a_lost_shard_is_replayed_in_place_by_its_shard_group_under_the_agents(tmp_path: Path, references: Any) -> None:
    """FSDP2, dp_shard=2 x pp=2 on 2 nodes: rank 3 (stage 1, shard 1) dies; its replacement on its
    node and rank 2, live in its own process, replay their shard group from the checkpoint."""
    c = LocalCluster(
        tmp_path,
        MESH_SCRIPT,
        _mesh_args(tmp_path),
        run_id="fsdp",
        agent_args=["--dp-shard", "2"],
        node0_args=["--inject-kill", "3:4,1,backward"],
    ).start()
    rc = c.wait(timeout_s=300)
    assert rc == 0, "\n".join(f"--- {p.log.name}\n{p.output()[-4000:]}" for p in c.nodes)
    layout = MeshLayout(2, 1, 2)
    got = {
        k: torch.load(c.out / f"stage{layout.coord(k).stage}-dp{layout.dp_index(k)}.pt", weights_only=False)
        for k in range(4)
    }
    ref = references.failure_free(_mesh_args, run_id="fsdp", num_stages=2, script=MESH_SCRIPT, dp_shard=2)
    diffs = {k: states_equal(got[k], ref.results[k]) for k in range(4)}
    assert not any(diffs.values()), {k: v[:5] for k, v in diffs.items() if v}
    assert got[3]["recovered"]["path"] == "shard" and "ranks 2 in place" in got[3]["recovered"]["why"]
    assert [e["replayed_in_place"] for e in got[2]["events"]] == [[2, 3]]


MULTI_SCRIPT = "trainer_client.examples.multi_stage_resilient"


def _multi_args(base: Path) -> list[str]:
    return ["--iters", "7", "--ckpt-at", "0,3", "--cold-url", f"file://{base / 'cold'}", "--schedule", "zbvzerobubble"]


def test_a_rank_holding_two_stages_is_replaced_under_the_agents(tmp_path: Path, references: Any, hosts: Any) -> None:
    """ZBV zero-bubble, 2 nodes x 1 rank of 2 stages each: node 1 (the V's middle stages 1 and 2)
    is lost with its store root; the replacement on the spare replays both stages together from the
    cold tier and node 0's node server, bit-exact."""
    c = LocalCluster(
        tmp_path, MULTI_SCRIPT, _multi_args(tmp_path), nproc_per_node=1, run_id="multi",
        agent_args=["--node-timeout", "1.0"], hosts=hosts,
    ).start()  # fmt: skip
    ckpt = tmp_path / "ckpt" / "stage00002" / "it000000000003.pt"
    deadline = time.monotonic() + 120
    while not ckpt.is_file():
        assert time.monotonic() < deadline and c.node(0).proc.poll() is None
        time.sleep(0.05)
    c.lose_node(1)
    rc = c.wait(timeout_s=300)
    assert rc == 0, "\n".join(f"--- {p.log.name}\n{p.output()[-4000:]}" for p in c.nodes)
    got = {k: torch.load(c.out / f"stage{k}.pt", weights_only=False) for k in (0, 1)}
    ref = references.failure_free(_multi_args, run_id="multi", num_stages=2, script=MULTI_SCRIPT)
    for k in (0, 1):
        diffs = {s: states_equal(got[k]["stages"][s], ref.results[k]["stages"][s]) for s in ref.results[k]["stages"]}
        assert not any(diffs.values()), {s: v[:5] for s, v in diffs.items() if v}
    rec = got[1]["recovered"]
    assert [u["stages"] for u in rec["units"]] == [[1, 2]] and rec["verified"]
