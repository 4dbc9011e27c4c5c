"""The client and the replay on a GPU: device-to-host capture on a side stream, and a replay on
the device the stages trained on, bit for bit.

The hand-written two-stage run runs on CPU everywhere and on CUDA where a GPU is present (the
``cuda`` cases are skipped on a machine without one, e.g. CI; ``pytest -m cuda`` on a GPU
machine runs them). The CUDA writer cases make the GPU busy with ``torch.cuda._sleep`` so that
the side-stream copy is still pending when the training thread goes on: what they check (no
synchronisation on submit, ordering after the training stream, no reuse of a sent tensor's
memory before the copy, a received buffer not overwritten before it was read) holds by
construction, not by timing luck.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic GEMMs

import pytest
import torch
import torch.nn.functional as F

from logstore import Channel, LogStore, RecordKey
from replay.core import replay_device, replay_stage
from replay.errors import ReplayError
from replay.reader import LogReader
from replay.stage import StageState
from trainer_client import ClientConfig, SwiftlogClient, load_checkpoint
from trainer_client.config import WriterConfig
from trainer_client.digest import digest_from_record, tensor_digest
from trainer_client.writer import AsyncLogWriter, auto_encode_threads

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (run `pytest -m cuda` on a GPU machine)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
N_MB = 3


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _stage_modules(device: str) -> list[torch.nn.Module]:
    g = torch.Generator().manual_seed(11)
    m0 = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.LayerNorm(64))
    m1 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.2), torch.nn.GELU(), torch.nn.Linear(64, 5))
    for m in (m0, m1):
        for p in m.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return [m0.to(device).train(), m1.to(device).train()]


def _optim(m: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.5, total_iters=10)


def _train_two_stages(
    root: str, device: str, iterations: int = 4, checkpoint_at: int = 1
) -> tuple[list, list, list[str]]:
    """A hand-written two-stage pipeline in one process (both stages on ``device``), logged through
    the client's explicit API exactly as a custom runtime would: inputs, sends, receive digests,
    targets, seeds. Returns the live modules, optimizers and the checkpoint URIs."""
    clients = [
        SwiftlogClient(ClientConfig(run_id="dev", stage=k, num_stages=2, store_root=root, seed=7)) for k in (0, 1)
    ]
    mods = _stage_modules(device)
    opts = [_optim(m) for m in mods]
    data = torch.Generator().manual_seed(3)
    uris: list[str] = []
    for it in range(iterations):
        if it == checkpoint_at:
            uris = [c.checkpoint(it, m, o, s) for c, m, (o, s) in zip(clients, mods, opts, strict=True)]
        x, y = torch.randn(6, 16, generator=data).to(device), torch.randint(0, 5, (6,), generator=data).to(device)
        for mb, (xm, ym) in enumerate(zip(x.tensor_split(N_MB), y.tensor_split(N_MB), strict=True)):
            clients[0].log_inputs(xm, it, mb)
            clients[0].seed_micro_batch(it, mb)
            act = mods[0](xm)
            clients[0].log_send(act, 1, "activation", it, mb)
            recv = act.detach().clone().requires_grad_()  # stage 1's receive buffer
            clients[1].log_received(recv, 0, it, mb)
            clients[1].log_target(ym, it, mb)
            clients[1].seed_micro_batch(it, mb)
            F.cross_entropy(mods[1](recv), ym).backward()
            grad = recv.grad
            clients[1].log_send(grad, 0, "gradient", it, mb)
            clients[0].log_received(grad, 1, it, mb)
            act.backward(grad)
        for m, (o, s) in zip(mods, opts, strict=True):
            for p in m.parameters():
                p.grad.div_(N_MB)  # the schedules' scale_grads
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
    for c in clients:
        assert c.close().ok
    return mods, [o for o, _ in opts], uris


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_trained_on_a_device_replays_there_bit_for_bit_and_verified(tmp_path, device, deterministic):
    root = str(tmp_path / "store")
    live, live_opts, uris = _train_two_stages(root, device)
    for k in (0, 1):
        fresh = _stage_modules(device)[k]
        opt, sched = _optim(fresh)
        state = StageState.from_checkpoint(load_checkpoint(uris[k]), fresh, opt, sched)
        assert replay_device([state]).type == device
        rep = replay_stage(
            state,
            LogReader(LogStore.open(root, "dev")),
            num_stages=2,
            stop_iteration=4,
            loss_fn=F.cross_entropy,
            n_microbatches=N_MB,
            scale_grads=True,
            prefetch=1,
        )
        assert rep.verified and rep.digests_checked == 3 * N_MB, rep.to_dict()
        for a, b in zip(fresh.parameters(), live[k].parameters(), strict=True):
            assert a.device == b.device and torch.equal(a, b)
        got, want = opt.state_dict()["state"], live_opts[k].state_dict()["state"]
        for i in want:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[i][name], want[i][name]), (k, i, name)
        assert sched.last_epoch == 4


def test_a_replay_refuses_stages_spread_over_devices(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ReplayError, match="several devices"):
        replay_device([StageState(0, m, torch.optim.SGD(m[0].parameters(), lr=0.1))])
    assert replay_device(
        [StageState(0, torch.nn.ReLU(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))]
    ) == torch.device("cpu")


# ------------------------------------------------------------------------------ the writer's CUDA path
@pytest.fixture
def store(tmp_path):
    s = LogStore.open(tmp_path / "store", "w", writer="stage0")
    yield s
    s.close()


def _busy_gpu(seconds: float = 0.3) -> None:
    """Keep the current stream busy for about ``seconds`` (a spin kernel): work enqueued after
    this runs only then, so a synchronising call would be seen waiting for it."""
    torch.cuda._sleep(int(seconds * 2e9))  # cycles: ~seconds at 2 GHz, longer at lower clocks


@pytest.mark.cuda
@needs_cuda
def test_cuda_records_are_the_device_tensors_bit_for_bit(store):
    w = AsyncLogWriter(store, WriterConfig(encode_threads=2))
    base = torch.randn(33, 17, device="cuda")
    sent = [
        base,
        base.to(torch.bfloat16),
        base.to(torch.float16),
        torch.arange(100, device="cuda") * 7,
        base.t(),
        base[::2, 3:],
    ]
    for mb, t in enumerate(sent):
        assert w.submit(Channel.activation(0), 0, mb, [t])
    assert w.drain(30)
    for mb, t in enumerate(sent):
        got = store.get(RecordKey(Channel.activation(0), 0, mb))
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t.cpu()), mb
    st = w.stats()
    assert st.faults == 0 and st.records_written == len(sent) and st.queue_bytes == 0 and st.pinned_bytes > 0
    assert w.close(10)


@pytest.mark.cuda
@needs_cuda
def test_cuda_submit_never_waits_for_the_gpu_and_copies_after_the_training_stream(store):
    w = AsyncLogWriter(store, WriterConfig(encode_threads=1))
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    _busy_gpu()
    x.add_(5)  # enqueued behind the spin kernel
    assert w.submit(Channel.activation(0), 0, 0, [x])
    assert not torch.cuda.current_stream().query(), "submit synchronised with the GPU"
    ptr = x.data_ptr()
    del x  # the training loop lets go of its send
    y = torch.empty(1 << 20, device="cuda")
    assert y.data_ptr() != ptr, "the caching allocator recycled the sent tensor before the copy ran"
    y.fill_(-1)
    assert w.drain(30)
    assert torch.equal(store.get(RecordKey(Channel.activation(0), 0, 0)), torch.full((1 << 20,), 5.0))
    assert w.close(10)


@pytest.mark.cuda
@needs_cuda
def test_cuda_received_buffer_is_hashed_before_the_next_receive_overwrites_it(store):
    w = AsyncLogWriter(store, WriterConfig(encode_threads=1))
    buf = torch.zeros(4096, device="cuda")
    torch.cuda.synchronize()
    _busy_gpu()
    buf.add_(7)
    w.submit_digests(Channel.digest(1, 0), 0, 0, [buf])
    assert not torch.cuda.current_stream().query(), "submit_digests synchronised with the GPU"
    buf.fill_(-1)  # the next receive into the same buffer: must wait for the copy
    assert w.drain(30)
    assert digest_from_record(store.get(RecordKey(Channel.digest(1, 0), 0, 0))) == tensor_digest(
        torch.full((4096,), 7.0)
    )
    assert torch.equal(buf.cpu(), torch.full((4096,), -1.0))
    assert w.close(10)


@pytest.mark.cuda
@needs_cuda
def test_cuda_stage_gets_more_encode_threads_by_default(store):
    w = AsyncLogWriter(store, WriterConfig(encode_threads=None))  # the client's default
    assert w.submit(Channel.activation(0), 0, 0, [torch.randn(64, device="cuda")]) and w.drain(30)
    assert w.stats().encode_threads == auto_encode_threads(on_gpu=True) > 1 or (os.cpu_count() or 1) < 2
    assert w.close(10)


@pytest.mark.cuda
@needs_cuda
def test_cuda_pinned_buffers_are_reused_and_bounded_when_shapes_keep_changing(store):
    bound = 1 << 20
    w = AsyncLogWriter(store, WriterConfig(encode_threads=1, max_queue_bytes=bound))
    t = torch.randn(1 << 16, device="cuda")  # 256 KiB
    for mb in range(8):
        assert w.submit(Channel.activation(0), 0, mb, [t]) and w.drain(30)
    assert w.stats().pinned_bytes == t.numel() * 4  # one buffer, reused
    for n in range(1, 40):  # a new shape every time (variable sequence lengths)
        assert w.submit(Channel.activation(0), 1, n, [torch.randn(n * 1000, device="cuda")])
    assert w.drain(30)
    st = w.stats()
    assert st.faults == 0 and st.pinned_bytes <= bound, st.pinned_bytes
    assert torch.equal(store.get(RecordKey(Channel.activation(0), 0, 7)), t.cpu())
    assert w.close(10)


# ------------------------------------------------------------------------------ a real schedule on CUDA
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_one_stage_gpt_pipeline_on_cuda_replays_there_bit_for_bit(tmp_path, schedule, deterministic):
    """The client's pipeline stage and schedule on a GPU (a one-stage pipeline needs no p2p, so a
    one-rank gloo group will do): CUDA inputs and targets captured through pinned copies (GPipe),
    or host batches from a data source that the client and the replay move to the GPU (1F1B);
    META, a checkpoint of CUDA state; the replay on the GPU equals the live stage bit for bit."""
    import torch.distributed as dist

    from trainer_client.examples.gpt import (
        GPTConfig,
        SyntheticTokens,
        build_stage_module,
        example_io,
        loss_fn,
        make_lr_scheduler,
        make_optimizer,
    )

    root = str(tmp_path / "store")
    cfg = GPTConfig(n_microbatches=3)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        source = SyntheticTokens(cfg, seed=5) if schedule == "1f1b" else None
        client = SwiftlogClient(
            ClientConfig(run_id="g", stage=0, num_stages=1, store_root=root, seed=5, log_data=source is None),
            data_source=source,
        )
        mod = build_stage_module(cfg, 0, 1, seed=5).to("cuda")
        opt = make_optimizer(mod)
        sched, data = make_lr_scheduler(opt), SyntheticTokens(cfg, seed=5)
        inp, out = example_io(cfg, 0, 1)
        stage = client.pipeline_stage(mod, "cuda", input_args=inp.to("cuda"), output_args=out.to("cuda"))
        client.schedule(stage, schedule, n_microbatches=3, loss_fn=loss_fn)
        for it in range(4):
            if it == 1:
                uri = client.checkpoint(1, mod, opt, sched)
            if source is None:
                x, y = data(it)
                client.step(it, x.cuda(), target=y.cuda())
            else:
                client.step(it)  # the client fetches the batch and moves it to the stage's device
            assert client.commit(it).logging_faults == []
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        assert client.close().ok
    finally:
        dist.destroy_process_group()
    fresh = build_stage_module(cfg, 0, 1, seed=5).to("cuda")
    fopt = make_optimizer(fresh)
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt, make_lr_scheduler(fopt))
    rep = replay_stage(
        state,
        LogReader(LogStore.open(root, "g")),
        num_stages=1,
        stop_iteration=4,
        loss_fn=loss_fn,
        prefetch=2,
        data_source=source,
    )
    assert rep.ok and rep.micro_batches == 9 and not rep.warnings, rep.to_dict()
    for a, b in zip(fresh.parameters(), mod.parameters(), strict=True):
        assert a.is_cuda and torch.equal(a, b)
    got, want = fopt.state_dict()["state"], opt.state_dict()["state"]
    assert all(torch.equal(got[i]["exp_avg_sq"], want[i]["exp_avg_sq"]) for i in want)
    # the same through a job (what `swiftlog replay --device cuda` runs): the example factory builds on CPU,
    # the job moves it
    from replay import ReplayJob, SourceSpec, replay

    job = ReplayJob(
        run="g",
        num_stages=1,
        stages=[0],
        stop_iteration=4,
        checkpoints={0: uri},
        sources=[SourceSpec(kind="store", location=root)],
        model="trainer_client.examples.factories:gpt_stage",
        model_args=cfg.to_dict(),
        data_source=None if source is None else "trainer_client.examples.factories:gpt_data",
        device="cuda",
        output=str(tmp_path / "out"),
    )
    res = replay(job)
    assert res.report.ok and res.report.micro_batches == 9
    assert all(
        a.is_cuda and torch.equal(a, b)
        for a, b in zip(res.states[0].module.parameters(), mod.parameters(), strict=True)
    )
    assert torch.equal(load_checkpoint(res.outputs[0]).model["blocks.0.fc1.weight"], mod.blocks[0].fc1.weight.cpu())
    # the same logs replayed on CPU: the replay says it cannot be the GPU run's kernels or masks
    cpu = build_stage_module(cfg, 0, 1, seed=5)
    copt = make_optimizer(cpu)
    state = StageState.from_checkpoint(load_checkpoint(uri), cpu, copt, make_lr_scheduler(copt))
    rep = replay_stage(
        state, LogReader(LogStore.open(root, "g")), num_stages=1, stop_iteration=2, loss_fn=loss_fn, data_source=source
    )
    assert any("cuda_device" in w and "replay on cpu" in w for w in rep.warnings), rep.warnings
