"""``trainer_client.fsdp`` on real gloo groups in real processes: a ``fully_shard``-ed module keeps
training bit for bit across process-group generations, an abandoned iteration leaves nothing
behind, and a clip of sharded gradients with a given norm is the live clip's."""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer_client import fsdp
from trainer_client.commit import gloo_on_loopback, loopback_store

WORLD, ITERS = 2, 6


def _form(store: Any, rank: int, g: int) -> dist.ProcessGroup:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{g}", store), rank=rank, world_size=WORLD)
    return dist.group.WORLD


def _model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _step(m: nn.Module, opt: torch.optim.Optimizer, rank: int, it: int, clip: str) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * it + rank))
    m(x).square().mean().backward()
    if clip == "live":  # as the client clips: the whole norm, then the clip
        total = fsdp.full_value(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
        fsdp.clip_grads_with_norm_(list(m.parameters()), 0.05, total, None)
    elif clip == "logged":  # as a replay clips: the norm the live clip logged, as a float
        total = fsdp.full_value(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
        fsdp.clip_grads_with_norm_(list(m.parameters()), 0.05, torch.tensor(float(total)), None)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _worker(rank: int, port: int, q: Any, mode: str) -> None:
    gloo_on_loopback()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = _form(store, rank, 0)
    mesh = fsdp.shard_mesh(list(range(WORLD)), group, rank)
    m = _model(mesh)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for it in range(ITERS):
        if mode != "plain" and it in (2, 4):  # a new generation: new groups under the same module
            fsdp.release(m)
            fsdp.rebind(m, _form(store, rank, it))
        if mode == "abandon" and it == 3:  # a micro-batch's backward as a schedule runs it, then given up
            fsdp.backward_without_sync(m)
            m(torch.ones(4, 8)).square().mean().backward()  # gradients accumulated unsharded, never reduced
            fsdp.discard_unfinished(m)
            m.set_requires_gradient_sync(True)  # what the next schedule step sets again
            m.set_is_last_backward(True)
            m.set_reshard_after_backward(True)
        _step(m, opt, rank, it, "logged" if mode == "logged" else "live")
    buf = io.BytesIO()
    torch.save((rank, fsdp.local_state(m.state_dict()), fsdp.local_state(opt.state_dict())), buf)
    q.put(buf.getvalue())
    dist.destroy_process_group()


def _run(mode: str) -> list[Any]:
    gloo_on_loopback()
    host = loopback_store()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, host.port, q, mode)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = [torch.load(io.BytesIO(q.get(timeout=120)), weights_only=False) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WORLD
    return sorted(got, key=lambda x: x[0])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_a_sharded_module_trains_on_bit_for_bit_across_generations_and_abandoned_iterations() -> None:
    """Rebinding to new groups twice, an abandoned half iteration discarded, and a clip with the
    logged norm: every rank's shards and Adam state equal the uninterrupted run's."""
    plain = _run("plain")
    for mode in ("rebind", "abandon", "logged"):
        got = _run(mode)
        for (r, model, opt), (_, want_model, want_opt) in zip(got, plain, strict=True):
            assert _equal(model, want_model), f"{mode}: rank {r}'s shards differ"
            assert _equal(opt, want_opt), f"{mode}: rank {r}'s optimizer state differs"
