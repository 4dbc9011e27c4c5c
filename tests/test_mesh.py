"""The data-parallel x pipeline mesh: coordinates, recovery paths, the replicas' gradient average
and the state transfer between replicas (real gloo groups in real processes)."""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
from typing import Any

import pytest
import torch
import torch.distributed as dist

from logstore.errors import ConfigError
from trainer_client import ClientConfig, RecoveryConfig
from trainer_client.commit import gloo_on_loopback, loopback_store
from trainer_client.mesh import MeshCoord, MeshLayout, recovery_paths


def test_ranks_and_coordinates_follow_torchtitans_order() -> None:
    """pp outermost, then dp_replicate: rank = stage * R + replica; one replica: rank = stage."""
    m = MeshLayout(3, 2)
    assert [m.coord(r) for r in range(6)] == [MeshCoord(s, r) for s in range(3) for r in range(2)]
    assert all(m.rank(c.stage, c.replica) == r for r in range(6) for c in [m.coord(r)])
    assert (m.replicas_of(1), m.pipeline_of(1)) == ([2, 3], [1, 3, 5])
    assert [MeshLayout(4).rank(k) for k in range(4)] == [0, 1, 2, 3]
    for bad in (lambda: m.coord(6), lambda: m.rank(3, 0), lambda: m.rank(0, 2), lambda: MeshLayout(2, 0)):
        with pytest.raises(ValueError):
            bad()


def test_a_lost_rank_is_copied_from_its_lowest_live_replica_or_replayed_with_the_other_lost_ones() -> None:
    m = MeshLayout(2, 3)  # stage 0: ranks 0,1,2; stage 1: ranks 3,4,5
    p = recovery_paths(m, [0, 4, 5, 3])
    assert (p[0].path, p[0].donor) == ("replica", 1)
    assert {r: p[r].path for r in (3, 4, 5)} == {3: "replay", 4: "replay", 5: "replay"}
    assert p[4].replay_group == (3, 4, 5) and "every replica of stage 1 was lost" in p[4].why
    assert "copy rank 1" in p[0].why
    assert recovery_paths(m, [2, 1])[1].donor == 0  # the same answer on every rank
    one = recovery_paths(MeshLayout(4), [2])[2]
    assert (one.path, one.replay_group) == ("replay", (2,))
    with pytest.raises(ValueError):
        recovery_paths(m, [6])


def test_a_sharded_mesh_puts_dp_shard_innermost_and_gives_each_pipeline_a_run() -> None:
    """pp x dp_replicate x dp_shard: rank = (stage * R + replica) * D + shard; each (replica,
    shard) is a pipeline with its own data-parallel index, logs and checkpoints."""
    m = MeshLayout(2, 2, 3)
    assert m.world_size == 12 and m.dp_size == 6 and m.shape() == "2 x 2 x 3"
    assert [m.coord(r) for r in range(12)] == [MeshCoord(k, r, s) for k in range(2) for r in range(2) for s in range(3)]
    assert all(m.rank(c.stage, c.replica, c.shard) == r for r in range(12) for c in [m.coord(r)])
    assert m.shard_group(1, 0) == [6, 7, 8] and m.replicas_of(1, shard=2) == [8, 11]
    assert m.pipeline_of(1, 2) == [5, 11] and m.stage_ranks(0) == list(range(6))
    assert [m.dp_index(r) for r in (0, 4, 11)] == [0, 4, 5] and m.log_run("job", 11) == "job.dp5"
    assert m.describe(7) == "rank 7 (stage 1 replica 0 shard 1)"
    c = ClientConfig(
        run_id="job", stage=1, num_stages=2, store_root="/x", replica=1, dp_replicate=2, shard=2, dp_shard=3
    )
    assert (c.rank, c.dp_index, c.log_run, c.world_size) == (11, 5, "job.dp5", 12)
    with pytest.raises(ConfigError, match="shard must be an int in 0..2"):
        ClientConfig(run_id="job", stage=0, num_stages=2, store_root="/x", shard=3, dp_shard=3)
    with pytest.raises(ValueError):
        m.rank(0, 0, 3)


def test_a_lost_shard_is_copied_from_its_replica_else_its_shard_group_replays_in_place() -> None:
    """HSDP: a shard with a live replica is copied; FSDP (no replica): the whole shard group
    replays, its live members in place; HSDP with a shard lost in every replica is refused."""
    hsdp = MeshLayout(2, 2, 2)  # stage 1: replica 0 = ranks 4,5; replica 1 = ranks 6,7
    p = recovery_paths(hsdp, [5])[5]
    assert (p.path, p.donor, p.shard) == ("replica", 7, 1) and "stage 1 shard 1" in p.why
    fsdp = MeshLayout(2, 1, 3)  # stage 1: ranks 3,4,5
    q = recovery_paths(fsdp, [4])[4]
    assert (q.path, q.replay_group, q.in_place, q.shard) == ("shard", (3, 4, 5), (3, 5), 1)
    both = recovery_paths(fsdp, [3, 5])
    assert both[3].in_place == both[5].in_place == (4,)
    with pytest.raises(ValueError, match="lost in every replica"):
        recovery_paths(hsdp, [5, 7])


def test_a_replicas_config_names_its_run_checkpoints_and_rank() -> None:
    c = ClientConfig(run_id="job", stage=1, num_stages=2, store_root="/tmp/x", replica=1, dp_replicate=3)
    assert (c.rank, c.log_run) == (4, "job.dp1")
    assert c.resolved_checkpoint_url().endswith("/job.dp1/checkpoint-files")
    assert c.commit_prefix == "swiftlog/job"  # the commit step spans the mesh
    from trainer_client import CheckpointConfig

    c2 = ClientConfig(
        run_id="job",
        stage=0,
        num_stages=2,
        store_root="/tmp/x",
        replica=2,
        dp_replicate=3,
        checkpoints=CheckpointConfig(url="s3://b/ck"),
    )
    assert c2.resolved_checkpoint_url() == "s3://b/ck/dp2"
    single = ClientConfig(run_id="job", stage=1, num_stages=2, store_root="/tmp/x")
    assert (single.rank, single.log_run) == (1, "job")
    with pytest.raises(ConfigError, match="replica must be an int in 0..1"):
        ClientConfig(run_id="job", stage=0, num_stages=2, store_root="/tmp/x", replica=2, dp_replicate=2)
    with pytest.raises(ConfigError, match="dp_replicate must be an int >= 1"):
        RecoveryConfig(run_id="job", stage=0, num_stages=2, dp_replicate=0)
    with pytest.raises(ConfigError, match="logging_groups with dp_replicate or dp_shard > 1"):
        ClientConfig(run_id="j", stage=0, num_stages=2, store_root="/x", dp_replicate=2, logging_groups=[2])
    assert RecoveryConfig(run_id="job", stage=1, num_stages=2, replica=1, dp_replicate=2).rank == 3


# ------------------------------------------------------------------ real gloo groups
def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(1000, generator=g),
        torch.randn(37, 3, generator=g).to(torch.float64),
        torch.randn(2000, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),
    ]


def _average_worker(rank: int, world: int, port: int, q: Any) -> None:
    from trainer_client.replicas import average_gradients_

    gloo_on_loopback()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    out = []
    for attempt in range(2):  # a fresh group each time: the replay's group, after the live one
        dist.init_process_group("gloo", store=dist.PrefixStore(f"a{attempt}", store), rank=rank, world_size=world)
        grads = _grads(rank)
        layout = average_gradients_(grads, None, bucket_bytes=1024)
        out.append(([g.clone() for g in grads], layout))
        dist.destroy_process_group()
    _put(q, (rank, out))


def _put(q: Any, item: Any) -> None:
    """Tensors as bytes: a queue shares a tensor's memory with the reader, gone once the worker exits."""
    buf = io.BytesIO()
    torch.save(item, buf)
    q.put(buf.getvalue())


def _spawn(target: Any, world: int, *extra: Any) -> list[Any]:
    gloo_on_loopback()
    store = loopback_store()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, store.port, q, *extra)) for r in range(world)]
    for p in procs:
        p.start()
    got = [torch.load(io.BytesIO(q.get(timeout=120)), weights_only=False) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * world
    return sorted(got, key=lambda x: x[0])


def test_the_replicas_average_is_the_same_bits_on_every_replica_and_in_every_repetition() -> None:
    """Three replicas (a+b+c is not c+b+a in floating point): every rank ends with the same bits,
    a second group of the same size and layout repeats them exactly, and the result is the mean."""
    got = _spawn(_average_worker, 3)
    first = got[0][1][0][0]
    for _, runs in got:
        for grads, layout in runs:
            assert all(torch.equal(a, b) for a, b in zip(grads, first, strict=True))
            assert (layout["world"], layout["bucket_bytes"], layout["ranks"]) == (3, 1024, [0, 1, 2])
    # float32 laid end to end (12000 bytes: 12 buckets of 1 KiB), float64 (888 bytes), bfloat16 (10 bytes)
    assert got[0][1][0][1]["buckets"] == 12 + 1 + 1
    mean = torch.stack([_grads(r)[0] for r in range(3)]).sum(0) / 3
    assert torch.allclose(first[0], mean, atol=1e-6)


def _transfer_worker(rank: int, world: int, port: int, q: Any, corrupt: bool) -> None:
    from trainer_client import replicas

    gloo_on_loopback()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.BatchNorm1d(200), torch.nn.Linear(200, 3))
    opt = torch.optim.Adam(model.parameters())
    if rank == 0:
        model(torch.randn(8, 300)).sum().backward()
        opt.step()
        state = {"stage": 1, "model": model.state_dict(), "optimizer": opt.state_dict(), "note": ("a", 2)}
        rep = replicas.send_state(state, 1, chunk_bytes=4096)
        _put(q, (rank, rep.to_dict(), model.state_dict(), opt.state_dict()))
    else:
        if corrupt:  # what the receiver hashes is not what the donor hashed: the digest check must see it
            real = replicas.tensor_digest

            def flipped(t: torch.Tensor) -> int:
                return real(t) ^ (1 if t.numel() == 200 * 300 else 0)

            replicas.tensor_digest = flipped  # type: ignore[assignment]
        first = model[0].weight
        try:
            state, rep = replicas.receive_state(0, into={f"model/{k}": v for k, v in model.state_dict().items()})
        except replicas.ReplicaTransferError as e:
            _put(q, (rank, "error", str(e), None))
            return
        assert state["model"]["0.weight"].data_ptr() == first.data_ptr()  # received in place
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        _put(q, (rank, rep.to_dict(), model.state_dict(), opt.state_dict()))
    dist.destroy_process_group()


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_replicas_state_arrives_whole_or_is_refused(corrupt: bool) -> None:
    """The donor's parameters, buffers and Adam state arrive bit for bit (chunks of 4 KiB: tensors
    split over chunks and small ones packed together); a tensor whose digest differs is named."""
    (_, sent, m0, o0), (_, got, m1, o1) = _spawn(_transfer_worker, 2, corrupt)
    if corrupt:
        assert got == "error" and "tensor 0 of the state received from rank 0 ((200, 300)" in m1
        return
    n_tensors = len(m0) + sum(len(st) for st in o0["state"].values())  # 9 in the model, 3 per Adam parameter
    assert sent["bytes"] == got["bytes"] and got["tensors"] == sent["tensors"] == n_tensors == 9 + 18
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    for i, st in o0["state"].items():
        assert all(torch.equal(v, o1["state"][i][k]) for k, v in st.items())
    assert o0["param_groups"] == o1["param_groups"]


def test_replicas_store_one_copy_of_a_meta_they_share(tmp_path) -> None:
    """Two replicas of stage 1 (ranks 2 and 3) commit the same META: the store holds one copy
    (named by its xxh3) and a pointer per rank; a rank whose META differs keeps its own copy; a
    checkpoint deletes them all."""
    from trainer_client.commit import CommitCoordinator, meta_key, shared_meta_key, stored_metas

    store = dist.FileStore(str(tmp_path / "fs"), 1)
    coords = [
        CommitCoordinator(store, stage=r, num_stages=4, prefix="p", shared_stage=1, timeout=datetime.timedelta(5))
        for r in (2, 3)
    ]

    def doc(it: int, rank: int) -> bytes:  # the same but for the rank's own timing
        return b'{"same":%d,"step_s":0.%d}' % (it, rank)

    for it in range(3):
        for r, c in zip((2, 3), coords, strict=True):
            store.set(f"p/gen0/it{it}/decision", "commit:9")  # decided: commit() returns at once
            c.commit(it, meta=doc(it, r))
    coords[1].amend_meta(2, b'{"amended":2}')
    assert bytes(store.get(meta_key("p", 2, 0))).startswith(b"@" + shared_meta_key("p", 1, 0, b'{"same":0}').encode())
    assert stored_metas(store, "p", 2, range(3)) == {it: doc(it, 2) for it in range(3)}
    assert stored_metas(store, "p", 3, range(3)) == {0: doc(0, 3), 1: doc(1, 3), 2: b'{"amended":2}'}
    assert store.check([shared_meta_key("p", 1, 1, b'{"same":1}')])
    for c in coords:
        c.forget_metas(3)
    assert stored_metas(store, "p", 2, range(3)) == {} == stored_metas(store, "p", 3, range(3))
    leftover = [shared_meta_key("p", 1, it, b'{"same":%d}' % it) for it in range(3)]
    assert not any(store.check([k]) for k in [*leftover, shared_meta_key("p", 1, 2, b'{"amended":2}')])


def test_a_client_refuses_groups_that_do_not_fit_its_mesh(tmp_path) -> None:
    from trainer_client import SwiftlogClient

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    cfg = ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path / "s"), replica=0, dp_replicate=2)
    client = SwiftlogClient(cfg)
    try:
        with pytest.raises(ConfigError, match="the pp group has 1 ranks, the pipeline 2 stages"):
            client.set_groups(dist.group.WORLD, dist.group.WORLD)
        with pytest.raises(ConfigError, match="dp_replicate=2 but the dp_replicate group has no group"):
            client.set_groups(None)
        with pytest.raises(ConfigError, match="not 'pp'"):
            client.set_mesh(object())
        assert client.pipeline_group is dist.group.WORLD  # nothing was set
    finally:
        client.close()
        dist.destroy_process_group()
