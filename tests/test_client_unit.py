"""Trainer-client pieces on their own: config, seeds, digests, the async writer, commit, checkpoints,
the explicit logging API, and a one-stage pipeline in this process."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import trainer_client
from logstore import Channel, LogStore, RecordKey, codec
from logstore.errors import ConfigError
from replay.core import replay_stage
from replay.errors import ReplayError, ReplayMismatchError
from replay.reader import LogReader
from replay.report import ReplayReport
from replay.stage import StageState
from trainer_client import (
    CheckpointError,
    ClientConfig,
    CommitCoordinator,
    CommitStoreError,
    FlushReport,
    IterationAbortedError,
    SwiftlogClient,
    UnsupportedScheduleError,
    derive_seed,
    load_checkpoint,
    save_checkpoint,
    seed_micro_batch,
    tensor_digest,
)
from trainer_client.commit import loopback_store, stored_metas
from trainer_client.config import group_starts
from trainer_client.digest import digest_from_record, digest_record
from trainer_client.meta import importable_name
from trainer_client.writer import AsyncLogWriter, auto_encode_threads


def test_public_api_is_pinned():
    assert sorted(trainer_client.__all__) == sorted(
        [
            "ClientConfig",
            "SwiftlogClient",
            "LoggingPipelineStage",
            "CommitReport",
            "FlushReport",
            "DataSource",
            "SUPPORTED_SCHEDULES",
            "encode_meta",
            "decode_meta",
            "CommitCoordinator",
            "CommitResult",
            "Checkpoint",
            "save_checkpoint",
            "load_checkpoint",
            "derive_seed",
            "seed_micro_batch",
            "tensor_digest",
            "AsyncLogWriter",
            "Fault",
            "WriterStats",
            "ClientError",
            "CommitError",
            "IterationAbortedError",
            "CommitStoreError",
            "CheckpointError",
            "UnsupportedScheduleError",
            "ResilientLoop",
            "RecoveryConfig",
            "RecoveryFailedError",
            "RecoveryTimeoutError",
        ]
    )
    for name in trainer_client.__all__:
        assert getattr(trainer_client, name) is not None


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stage": 4}, "stage"),
        ({"num_stages": 0}, "num_stages"),
        ({"logging_groups": [2, 1]}, "logging_groups"),
        ({"logging_groups": [4, 0]}, "logging_groups"),
        ({"overflow": "drop"}, "overflow"),
        ({"codec": "lz4"}, "codec"),
        ({"max_queue_bytes": 0}, "max_queue_bytes"),
        ({"encode_threads": -1}, "encode_threads"),
        ({"seed": -1}, "seed"),
        ({"commit_timeout": 5}, "commit_timeout"),
        ({"run_id": "../x"}, "run id"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(tmp_path, kwargs, field):
    base = {"run_id": "r", "stage": 0, "num_stages": 4, "store_root": str(tmp_path)}
    with pytest.raises(ConfigError) as ei:
        ClientConfig(**{**base, **kwargs})
    assert field in str(ei.value)


def test_config_defaults_and_boundaries(tmp_path):
    c = ClientConfig(run_id="r", stage=2, num_stages=4, store_root=str(tmp_path))
    assert c.writer == "stage2" and c.commit_prefix == "swiftlog/r" and c.logs_forward_send() and c.logs_backward_send()
    assert c.resolved_checkpoint_url() == os.path.join(str(tmp_path), "r", "checkpoint-files")
    assert group_starts([2, 2], 4) == {0, 2} and group_starts(None, 3) == {0, 1, 2}
    g = [
        ClientConfig(run_id="r", stage=k, num_stages=4, store_root=str(tmp_path), logging_groups=[2, 2])
        for k in range(4)
    ]
    assert [x.logs_forward_send() for x in g] == [False, True, False, False]
    assert [x.logs_backward_send() for x in g] == [False, False, True, False]
    assert [x.group_of() for x in g] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    cold = ClientConfig(run_id="r", stage=0, num_stages=1, store_root=str(tmp_path), cold_url="s3://b/p")
    assert cold.resolved_checkpoint_url() == "s3://b/p/r/checkpoint-files"
    assert c.encode_threads is None  # chosen by the writer at the first record


def test_a_torchrun_restart_commits_under_its_own_prefix(tmp_path, monkeypatch):
    """torchrun --max-restarts restarts every worker while its agent's store (the commit store)
    lives on: the redone iterations must not find the first attempt's decisions."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path)).commit_prefix == "swiftlog/r"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert (
        ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path)).commit_prefix == "swiftlog/r/restart2"
    )
    assert (
        ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path), commit_prefix="mine").commit_prefix
        == "mine"
    )


# ------------------------------------------------------------------------------ seeds and digests
def test_seeds_are_pure_distinct_and_reproduce_dropout():
    assert derive_seed(1, 2, 3, 4) == derive_seed(1, 2, 3, 4) < 2**63
    seeds = {derive_seed(7, s, it, mb) for s in range(4) for it in range(50) for mb in range(8)}
    assert len(seeds) == 4 * 50 * 8
    with pytest.raises(ValueError):
        derive_seed(0, -1, 0, 0)
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(1000)
    seed_micro_batch(7, 1, 5, 2)
    a = drop(x)
    torch.rand(3)
    seed_micro_batch(7, 1, 5, 2)
    assert torch.equal(drop(x), a)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**16 - 1), st.integers(0, 2**40), st.integers(0, 2**20))
@settings(max_examples=200, deadline=None)
def test_seed_and_digest_encodings_property(seed, stage, iteration, mb):
    s = derive_seed(seed, stage, iteration, mb)
    assert 0 <= s < 2**63 and s == derive_seed(seed, stage, iteration, mb)
    assert digest_from_record(digest_record(seed)) == seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_digest_is_the_codec_checksum_of_the_logical_tensor(dtype):
    t = (torch.randn(3, 5, 7) * 10).to(dtype)
    assert tensor_digest(t) == codec.read_header(codec.encode_tensor(t)).checksum
    nc = t.transpose(0, 2)  # non-contiguous: digest of the logical (C-order) tensor
    assert tensor_digest(nc) == codec.read_header(codec.encode_tensor(nc)).checksum == tensor_digest(nc.contiguous())
    for d in (0, 1, 2**63 - 1, 2**63, 2**64 - 1):
        assert digest_from_record(digest_record(d)) == d


# ------------------------------------------------------------------------------ async writer
@pytest.fixture
def store(tmp_path):
    s = LogStore.open(tmp_path / "store", "w", writer="stage0")
    yield s
    s.close()


def test_writer_writes_in_order_and_markers_see_everything_before(store):
    w = AsyncLogWriter(store, encode_threads=2, batch_records=3)
    seen = []
    sent = {}
    for it in range(3):
        for mb in range(4):
            ts = [torch.randn(8, 16), torch.randn(4)]
            sent[(it, mb)] = ts
            assert w.submit(Channel.activation(0), it, mb, ts)
        w.mark(lambda it=it: seen.append((it, len(store.keys(Channel.activation(0))))))
    assert w.drain(30)
    assert seen == [(0, 8), (1, 16), (2, 24)]  # each marker ran after every earlier record was written
    for (it, mb), ts in sent.items():
        for part, t in enumerate(ts):
            assert torch.equal(store.get(RecordKey(Channel.activation(0), it, mb, part)), t)
    st = w.stats()
    assert (
        st.records_written == 24 and st.bytes_written == st.bytes_submitted and st.queue_bytes == 0 and st.faults == 0
    )
    assert w.close(10)


def test_writer_chooses_its_encode_threads_at_the_first_record(store):
    w = AsyncLogWriter(store, encode_threads=None)
    assert w.stats().encode_threads == 0  # nothing captured yet: the device is not known
    assert w.submit(Channel.activation(0), 0, 0, [torch.randn(16)]) and w.drain(30)
    assert (
        w.stats().encode_threads == 1 == auto_encode_threads(on_gpu=False)
    )  # a CPU stage: its compute needs the cores
    assert 1 <= auto_encode_threads(on_gpu=True) <= 4
    assert store.get(RecordKey(Channel.activation(0), 0, 0)).shape == (16,)
    assert w.close(10)
    fixed = AsyncLogWriter(store, encode_threads=3)
    assert fixed.stats().encode_threads == 3 and fixed.close(10)


def test_writer_copy_protects_reused_buffers_and_digests_hash_now(store):
    w = AsyncLogWriter(store, encode_threads=0)
    gate = threading.Event()
    w.mark(gate.wait)  # hold the writer so the buffers are reused before they are written
    buf, recv = torch.arange(10.0), torch.randn(64)
    want = tensor_digest(recv)
    w.submit(Channel.input(0), 0, 0, [buf], copy=True)
    w.submit_digests(Channel.digest(1, 0), 0, 0, [recv])
    buf.fill_(-1)
    recv.fill_(0)  # the next receive overwrites the buffer
    gate.set()
    assert w.drain(30)
    assert torch.equal(store.get(RecordKey(Channel.input(0), 0, 0)), torch.arange(10.0))
    assert digest_from_record(store.get(RecordKey(Channel.digest(1, 0), 0, 0))) == want
    w.close()


@pytest.mark.parametrize("pool_first", [False, True], ids=["settled-inline", "hashed-by-pool"])
def test_deferred_digests_see_the_buffer_as_received_once_settled(store, pool_first):
    w = AsyncLogWriter(store, encode_threads=1)
    gate = threading.Event()
    if not pool_first:
        w.mark(gate.wait)  # hold the writer: settle_digests must hash on the calling thread
    recv = [torch.randn(64), torch.randn(3, 5)]
    want = [tensor_digest(t) for t in recv]
    w.submit_digests(Channel.digest(1, 0), 0, 0, recv, defer=True)
    if pool_first:
        w.kick()
        assert w.drain(30)  # the pool hashed the buffers by reference
    w.settle_digests()
    for t in recv:
        t.fill_(0)  # the next step's receive overwrites the buffers
    gate.set()
    assert w.drain(30)
    got = [digest_from_record(store.get(RecordKey(Channel.digest(1, 0), 0, 0, part))) for part in range(2)]
    assert got == want
    st = w.stats()
    assert st.digests_settled_inline == (0 if pool_first else 2) and st.faults == 0
    w.settle_digests()  # nothing pending: a no-op
    w.close()


def test_received_buffers_are_found_in_the_recv_info_of_each_torch_layout():
    """The stage hooks find what was received in torch's ``args_recv_info`` / ``grad_recv_info``.
    torch 2.13 (installed): ``_RecvInfo`` with ``is_root_arg``. torch 2.11 (seen on a GPU machine;
    it cannot be installed beside 2.13, so its two classes are written out as its source defines
    them): ``_RecvInfo(input_name, source, buffer)`` and a ``_RootArgPlaceholder`` with no buffer.
    Reading ``is_root_arg`` there failed every forward's hook: no activation digest was logged."""
    import inspect

    from torch.distributed.pipelining import stage as torch_stage

    from trainer_client.stage import _received_buffers

    a, b = torch.randn(2, 3), torch.randn(4)
    if "is_root_arg" in inspect.signature(torch_stage._RecvInfo).parameters:  # the installed torch's own classes
        infos = (
            torch_stage._RecvInfo("x", None, None, None, is_root_arg=True),
            torch_stage._RecvInfo("h", 0, a, None),
            torch_stage._RecvInfo("g", 0, None, None),
        )
    else:
        infos = (torch_stage._RootArgPlaceholder(a), torch_stage._RecvInfo("h", 0, a))
    assert _received_buffers(infos) == [a]

    class OldRecvInfo:  # torch 2.11's _RecvInfo
        def __init__(self, input_name: str, source: int, buffer: torch.Tensor) -> None:
            self.input_name, self.source, self.buffer = input_name, source, buffer

    class OldRootArgPlaceholder:  # torch 2.11's placeholder of a model input
        def __init__(self, tensor: torch.Tensor) -> None:
            self.meta = tensor.to("meta")

    got = _received_buffers((OldRootArgPlaceholder(a), OldRecvInfo("h", 0, a), OldRecvInfo("k", 0, b)))
    assert len(got) == 2 and got[0] is a and got[1] is b


def test_overflow_gap_drops_and_records_gaps_without_blocking(store):
    w = AsyncLogWriter(store, max_queue_bytes=1000, overflow="gap")
    gate = threading.Event()
    w.mark(gate.wait)
    results: list[bool] = []
    submits = threading.Thread(
        target=lambda: results.extend(w.submit(Channel.activation(0), 0, mb, [torch.zeros(100)]) for mb in range(5))
    )  # 400 bytes each
    submits.start()
    submits.join(60)
    assert not submits.is_alive() and not gate.is_set()  # every submit returned while the writer was held
    assert results == [True, True, False, False, False]
    gate.set()
    assert w.drain(30)
    st = w.stats()
    assert (st.overflow_drops, st.records_dropped, st.gaps_recorded, st.records_written) == (3, 3, 3, 2)
    assert st.queue_peak_bytes == 800 and st.faults_by_kind == {"overflow": 3}
    assert [(g["channel"], g["micro_batch"]) for g in store.gaps()] == [("act_0_1", 2), ("act_0_1", 3), ("act_0_1", 4)]
    assert len(w.take_faults()) == 3 and w.take_faults() == []
    w.close()


def test_overflow_wait_blocks_until_the_writer_frees_memory(store):
    w = AsyncLogWriter(store, max_queue_bytes=1000, overflow="wait")
    gate = threading.Event()
    w.mark(gate.wait)
    w.submit(Channel.activation(0), 0, 0, [torch.zeros(200)])  # 800 bytes: admitted
    done = threading.Event()
    threading.Thread(
        target=lambda: (w.submit(Channel.activation(0), 0, 1, [torch.zeros(200)]), done.set()), daemon=True
    ).start()
    assert not done.wait(0.3)  # blocked on the bound
    gate.set()
    assert done.wait(10)
    assert w.drain(30)
    st = w.stats()
    assert st.overflow_waits == 1 and st.overflow_wait_s >= 0.25 and st.records_dropped == 0 and st.records_written == 2
    w.close()


def test_logging_faults_never_raise_and_become_gaps(store):
    w = AsyncLogWriter(store, encode_threads=1)
    sparse = torch.eye(3).to_sparse()  # the codec refuses it: an encode fault
    assert w.submit(Channel.activation(0), 0, 0, [sparse])
    w.mark(lambda: 1 / 0)  # a failing marker
    assert w.submit(Channel.activation(0), 0, 1, [torch.ones(3)])
    assert w.drain(30)
    st = w.stats()
    assert st.faults_by_kind == {"encode": 1, "marker": 1} and st.records_written == 1 and st.gaps_recorded == 1
    assert [g["micro_batch"] for g in store.gaps()] == [0]
    store.close()  # the store goes away under the writer: records are dropped, counted, never raised
    assert w.submit(Channel.activation(0), 1, 0, [torch.ones(3)])
    assert w.drain(30)
    st = w.stats()
    assert st.faults_by_kind.get("closed") == 1 and st.records_dropped == 2
    w.close()
    assert w.submit(Channel.activation(0), 2, 0, [torch.ones(3)]) is False  # after close: dropped, no exception


# ------------------------------------------------------------------------------ commit
@pytest.fixture
def tcp_store():
    master = loopback_store(datetime.timedelta(seconds=30))
    yield master


def _coordinators(tcp_store, n=4, timeout=5.0):
    clients = [
        dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        for _ in range(n)
    ]
    return [
        CommitCoordinator(c, stage=k, num_stages=n, prefix="swiftlog/t", timeout=datetime.timedelta(seconds=timeout))
        for k, c in enumerate(clients)
    ]


def _commit_all(coords, it, stages=None, meta=None):
    out = {}

    def one(c):
        try:
            out[c.stage] = c.commit(it, meta=None if meta is None else meta(c.stage, it))
        except Exception as e:
            out[c.stage] = e

    threads = [threading.Thread(target=one, args=(c,)) for c in coords if stages is None or c.stage in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_commit_all_stages_agree(tcp_store):
    coords = _coordinators(tcp_store)
    for it in range(3):
        out = _commit_all(coords, it)
        assert all(not isinstance(r, Exception) for r in out.values()), out
        assert len({r.decided_by for r in out.values()}) == 1
        assert coords[0].decision(it) == "commit"


def test_commit_stores_each_meta_with_the_done_mark_and_a_checkpoint_forgets_older_ones(tcp_store):
    """Every committed iteration's META of every stage is in the store (it outlives the stage's
    machine); a checkpoint deletes a stage's older ones, including those a predecessor left."""
    coords = _coordinators(tcp_store, n=2)

    def doc(stage: int, it: int) -> bytes:
        return f'{{"iteration":{it},"stage":{stage}}}'.encode()

    for it in range(3, 7):
        out = _commit_all(coords, it, meta=doc)
        assert all(not isinstance(r, Exception) for r in out.values()), out
    assert stored_metas(tcp_store, "swiftlog/t", 1, range(0, 9)) == {
        it: doc(1, it) for it in range(3, 7)
    }  # some missing: key by key
    assert stored_metas(tcp_store, "swiftlog/t", 0, range(4, 6)) == {
        4: doc(0, 4),
        5: doc(0, 5),
    }  # all there: one multi_get
    assert coords[1].forget_metas(5) == 2  # from the first committed iteration (3) up to the checkpoint
    assert sorted(stored_metas(tcp_store, "swiftlog/t", 1, range(0, 9))) == [5, 6]
    assert coords[1].forget_metas(5) == 0
    other = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    replacement = CommitCoordinator(other, stage=1, num_stages=2, prefix="swiftlog/t")  # a new process: knows nothing
    assert replacement.forget_metas(7) == 2 and stored_metas(tcp_store, "swiftlog/t", 1, range(0, 9)) == {}
    assert sorted(stored_metas(tcp_store, "swiftlog/t", 0, range(0, 9))) == [3, 4, 5, 6]  # another stage's are its own


def test_abort_by_one_stage_aborts_everyone(tcp_store):
    coords = _coordinators(tcp_store)
    assert coords[2].abort(0, "peer closed the connection") == "abort"
    out = _commit_all(coords, 0, stages={0, 1, 3})
    assert all(
        isinstance(r, IterationAbortedError) and r.reason == "aborted by stage 2: peer closed the connection"
        for r in out.values()
    ), out
    assert coords[2].abort(0) == "abort"  # decided once, forever


def test_commit_timeout_aborts_for_everyone_including_latecomers(tcp_store):
    coords = _coordinators(tcp_store, timeout=0.3)
    out = _commit_all(coords, 0, stages={0, 1, 2})
    assert all(isinstance(r, IterationAbortedError) for r in out.values())
    assert {tuple(r.missing) for r in out.values()} == {(3,)} and "had not reported done: [3]" in str(out[0])
    assert all("timeout after 0.3 s" in r.reason for r in out.values())
    late = _commit_all(coords, 0, stages={3})[3]
    assert isinstance(late, IterationAbortedError)  # the late stage sees the same decision, never "commit"


def test_marked_failed_generation_aborts_waiters_and_new_generation_is_clean(tcp_store):
    coords = _coordinators(tcp_store)
    threading.Timer(0.2, lambda: coords[0].mark_failed("orchestrator: stage 3 died")).start()
    out = _commit_all(coords, 5, stages={0, 1, 2})
    assert all(isinstance(r, IterationAbortedError) and "marked failed" in r.reason for r in out.values()), out
    for c in coords:
        c.set_generation(1)
    out = _commit_all(coords, 5)
    assert all(not isinstance(r, Exception) and r.generation == 1 for r in out.values()), out


@pytest.mark.slow
def test_commit_with_the_store_host_gone_raises_commit_store_error_and_abort_never_raises():
    """The decision store dies (its host process is SIGKILLed): commit says so with a retryable
    CommitStoreError naming the iteration, and abort() on the failure path returns "unknown"."""
    import subprocess
    import sys

    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch.distributed as d\n"
            "from trainer_client.commit import loopback_store\ns = loopback_store()\n"
            "print(s.port, flush=True)\ntime.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
        coord = CommitCoordinator(
            client, stage=0, num_stages=1, prefix="swiftlog/t", timeout=datetime.timedelta(seconds=3)
        )
        assert coord.commit(0).iteration == 0  # alone in the pipeline: committed at once
        host.kill()
        host.wait()
        with pytest.raises(CommitStoreError) as ei:
            coord.commit(1)
        assert ei.value.iteration == 1 and ei.value.retryable and "could not reach the store" in str(ei.value)
        assert coord.abort(1, "failure path") == "unknown"
    finally:
        host.kill()
        host.wait()


# ------------------------------------------------------------------------------ checkpoints
def test_checkpoint_is_atomic_and_loading_never_aliases(tmp_path):
    mod = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(mod.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    mod(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    uri = save_checkpoint(
        str(tmp_path / "ck" / "s0.pt"),
        run_id="r",
        stage=0,
        num_stages=1,
        iteration=1,
        seed=9,
        model=mod,
        optimizer=opt,
        lr_scheduler=sched,
        extra={"note": "x"},
    )
    assert uri == f"file://{tmp_path}/ck/s0.pt" and os.listdir(tmp_path / "ck") == ["s0.pt"]
    ck = load_checkpoint(uri)
    assert (ck.stage, ck.iteration, ck.seed, ck.extra) == (0, 1, 9, {"note": "x"})
    pair = []
    for _ in range(2):
        m = torch.nn.Linear(4, 3)
        o = torch.optim.AdamW(m.parameters(), lr=0.1)
        s = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=4)
        ck.apply(m, o, s)
        pair.append((m, o, s))
    (m1, o1, _), (m2, o2, _) = pair
    m1(torch.randn(2, 4)).sum().backward()
    o1.step()
    st1, st2 = o1.state_dict()["state"][0], o2.state_dict()["state"][0]
    assert not torch.equal(st1["exp_avg"], st2["exp_avg"])  # stepping one never moves the other
    assert torch.equal(st2["exp_avg"], ck.optimizer["state"][0]["exp_avg"])
    assert torch.equal(m2.weight, mod.weight) and pair[1][2].state_dict() == sched.state_dict()
    mem = save_checkpoint(
        "memory://swiftlog-test/ck/s0.pt", run_id="r", stage=0, num_stages=1, iteration=2, seed=9, model=mod
    )
    assert load_checkpoint(mem).iteration == 2
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError) as ei:
        save_checkpoint(
            str(blocker / "sub" / "ck.pt"), run_id="r", stage=0, num_stages=1, iteration=0, seed=0, model=mod
        )
    assert "could not write checkpoint" in str(ei.value) and ei.value.__cause__ is not None
    with pytest.raises(CheckpointError):
        load_checkpoint(str(tmp_path / "missing.pt"))
    # loaded into objects it does not fit: an error naming the checkpoint and what does not fit
    with pytest.raises(
        CheckpointError,
        match=r"(?s)checkpoint file://\S+s0.pt of stage 0 \(iteration 1\) does not fit the model Linear: .*size mismatch for weight",
    ):
        ck.apply(torch.nn.Linear(5, 3))
    two_groups = torch.nn.Linear(4, 3)
    with pytest.raises(
        CheckpointError, match=r"its optimizer state does not fit the optimizer AdamW: .*parameter group"
    ) as ei:
        ck.apply(
            two_groups, torch.optim.AdamW([{"params": [two_groups.weight]}, {"params": [two_groups.bias]}], lr=0.1)
        )
    assert "same parameter groups" in (ei.value.hint or "")


def test_close_leaves_no_garbage_in_the_cold_tier(tmp_path):
    """A last checkpoint, then close: the final GC ran before the flush, which sealed and shipped the
    open segments (older iterations among them), so garbage stayed in the cold tier for good (a
    new user's run: grad_1_0 of iterations 8-13 after a checkpoint at 14). A GC follows the flush now."""
    root, cold = tmp_path / "store", f"file://{tmp_path / 'cold'}"
    clients = [
        SwiftlogClient(
            ClientConfig(run_id="tail", stage=k, num_stages=2, store_root=str(root), cold_url=cold, segment_iters=4)
        )
        for k in (0, 1)
    ]
    for it in range(14):
        assert clients[0].log_send(torch.randn(2, 3), 1, "activation", it, 0)
        assert clients[1].log_send(torch.randn(2, 3), 0, "gradient", it, 0)
    mods = [torch.nn.Linear(2, 2) for _ in clients]
    for c, m in zip(clients, mods, strict=True):
        c.checkpoint(14, m, torch.optim.SGD(m.parameters(), lr=0.1))
    for c in clients:
        assert c.close().ok
    with LogStore.open(tmp_path / "reader", "tail", cold_url=cold) as st:
        assert st.watermarks() == {0: 14, 1: 14}
        left = st.gc(dry_run=True)
        assert left.cold_segments == 0 and left.segments == [], left


# ------------------------------------------------------------------------------ explicit logging API
def test_hand_written_runtime_api_logs_boundaries_and_digests(tmp_path):
    root = tmp_path / "store"
    c0 = SwiftlogClient(ClientConfig(run_id="hw", stage=0, num_stages=2, store_root=str(root)))
    c1 = SwiftlogClient(ClientConfig(run_id="hw", stage=1, num_stages=2, store_root=str(root)))
    act = torch.randn(2, 3)
    assert c0.log_send(act, 1, "activation", 0, 0)
    assert c1.log_received(act, 0, 0, 0)
    assert c0.log_inputs(torch.tensor([[1, 2]]), 0, 0) and c1.log_target(torch.tensor([3]), 0, 0)
    with pytest.raises(ValueError):
        c0.log_send(act, 2, "activation", 0, 0)
    with pytest.raises(ValueError):
        c0.log_send(act, 1, "weights", 0, 0)
    assert c0.flush().ok and c1.flush().ok
    reader = LogStore.open(root, "hw")
    assert torch.equal(reader.get(RecordKey(Channel.activation(0), 0, 0)), act)
    assert digest_from_record(reader.get(RecordKey(Channel.digest(0, 1), 0, 0))) == tensor_digest(act)
    assert torch.equal(reader.get(RecordKey(Channel.input(0), 0, 0)), torch.tensor([[1, 2]]))
    c0.close()
    c1.close()
    # inside one logging group nothing is logged, and the bytes saved are counted
    g = SwiftlogClient(ClientConfig(run_id="hw2", stage=0, num_stages=2, store_root=str(root), logging_groups=[2]))
    assert not g.log_send(act, 1, "activation", 0, 0)
    assert g.stats()["selective"]["skipped_send_bytes"] == act.numel() * 4
    g.close()


# ------------------------------------------------------------------------------ a one-stage pipeline in this process
@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_schedules_and_a_one_stage_pipeline_replay_exactly(tmp_path, single_rank_group):
    from trainer_client.examples.gpt import (
        GPTConfig,
        SyntheticTokens,
        build_stage_module,
        example_io,
        loss_fn,
        make_lr_scheduler,
        make_optimizer,
    )

    cfg = GPTConfig(n_microbatches=3)
    config = ClientConfig(
        run_id="one",
        stage=0,
        num_stages=1,
        store_root=str(tmp_path / "store"),
        seed=5,
        cold_url=f"file://{tmp_path}/cold",
    )
    client = SwiftlogClient(config)
    mod = build_stage_module(cfg, 0, 1, seed=5)
    opt, data = make_optimizer(mod), SyntheticTokens(cfg, seed=5)
    sched = make_lr_scheduler(opt)
    inp, out = example_io(cfg, 0, 1)
    stage = client.pipeline_stage(mod, "cpu", input_args=inp, output_args=out)
    with pytest.raises(UnsupportedScheduleError) as ei:
        client.schedule(stage, "interleaved1f1b", n_microbatches=3, loss_fn=loss_fn)
    assert "gpipe" in str(ei.value) and "1f1b" in str(ei.value)
    with pytest.raises(UnsupportedScheduleError):
        client.schedule(stage, "gpipe", n_microbatches=3, loss_fn=None)
    client.schedule(stage, "gpipe", n_microbatches=3, loss_fn=loss_fn)
    with pytest.raises(ValueError):
        client.commit(0)  # no iteration begun
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt, sched)
        x, y = data(it)
        client.step(it, x, target=y)
        assert client.commit(it).logging_faults == []
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    report = client.close()
    assert report.ok and report.uploaded_segments >= 0
    assert uri.startswith("file://") and "checkpoint-files/stage00000/it000000000001.pt" in uri
    st = LogStore.open(tmp_path / "store", "one", cold_url=f"file://{tmp_path}/cold")
    assert st.watermarks() == {0: 1}
    fresh = build_stage_module(cfg, 0, 1, seed=5)
    fopt = make_optimizer(fresh)
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt, make_lr_scheduler(fopt))
    rep = replay_stage(state, LogReader(st), num_stages=1, stop_iteration=4, loss_fn=loss_fn)
    assert rep.ok and rep.digests_checked == 0 and rep.micro_batches == 9
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), mod.parameters(), strict=True))
    assert all(
        torch.equal(fopt.state_dict()["state"][i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"])
        for i in opt.state_dict()["state"]
    )


class _Masked(torch.nn.Module):
    """A first stage whose forward takes keyword inputs (an attention-mask-like tensor and a shift;
    not in name order, so passing the logged keywords positionally would mix them up)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = torch.nn.Linear(8, 5)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(5, 8, generator=g))
        self.drop = torch.nn.Dropout(0.3)

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.drop(self.lin(x))
        if mask is not None:
            h = h * mask
        return h if scale is None else h + scale


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _train_one_stage(
    client: SwiftlogClient,
    mod: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    iters: int = 4,
    schedule: str = "1f1b",
    sched: Any = None,
    out_dtype: torch.dtype = torch.float32,
    loss_fn: Callable[..., torch.Tensor] = _mse,
    step: Callable[[SwiftlogClient, torch.nn.Module, torch.optim.Optimizer, int, torch.Generator], None] | None = None,
    apply: Callable[[int], Any] | None = None,
    sched_after: Callable[[int], bool] = lambda it: True,
) -> str:
    """``mod`` (8 features in, 5 out) as ``client``'s one-stage pipeline for ``iters`` iterations, a
    checkpoint at 1 (with ``sched``); per iteration ``step(client, module, optimizer, it, generator)``
    (default: the schedule step on random data), the commit, ``apply(it)`` (default: the optimizer
    step), the scheduler step (if ``sched_after(it)``), zero_grad. Returns the checkpoint's URI."""
    stage = client.pipeline_stage(
        mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, dtype=out_dtype, requires_grad=True)
    )
    client.schedule(stage, schedule, n_microbatches=2, loss_fn=loss_fn)
    uri = ""
    for it in range(iters):
        if it == 1:
            uri = client.checkpoint(1, mod, opt, sched)
        (step or _plain_step)(client, mod, opt, it, torch.Generator().manual_seed(it))
        client.commit(it)
        if apply is None:
            opt.step()
        else:
            apply(it)
        if sched is not None and sched_after(it):
            sched.step()
        opt.zero_grad(set_to_none=True)
    return uri


def _single_rank_run(
    tmp_path: Path,
    run_id: str,
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    step: Callable[[SwiftlogClient, torch.nn.Module, torch.optim.Optimizer, int, torch.Generator], None],
    *,
    schedule: str = "1f1b",
    out_dtype: torch.dtype = torch.float32,
    loss_fn: Callable[..., torch.Tensor] = _mse,
    replay_loss: Callable[..., torch.Tensor] | None = _mse,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, LogStore, torch.nn.Module, torch.optim.Optimizer, Any]:
    """Train ``_Masked`` as a one-stage pipeline for 4 iterations (checkpoint at 1; ``step(client, module,
    optimizer, it, generator)`` runs the schedule step and whatever goes before the commit), then replay it from the
    checkpoint on a fresh module. ``loss_fn``: the schedule's; ``replay_loss``: the replay's (None:
    the one META names). Returns (live module, live optimizer, logs, replayed module, its
    optimizer, replay report)."""
    client = SwiftlogClient(
        ClientConfig(run_id=run_id, stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = make_opt(mod)
    uri = _train_one_stage(client, mod, opt, schedule=schedule, out_dtype=out_dtype, loss_fn=loss_fn, step=step)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", run_id)
    fresh = _Masked()
    fopt = make_opt(fresh)
    rep = replay_stage(
        StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
        LogReader(logs),
        num_stages=1,
        stop_iteration=4,
        loss_fn=replay_loss,
    )
    return mod, opt, logs, fresh, fopt, rep


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    from replay.compare import states_equal

    return states_equal({"model": dict(a.named_parameters())}, {"model": dict(b.named_parameters())}) == []


@pytest.mark.s3
@pytest.mark.slow
def test_a_dead_object_store_times_the_data_wait_out_once_then_commits_only_check(
    tmp_path, single_rank_group, moto_server, caplog
):
    """A first / last stage's commit waits for its logged inputs / targets to reach the cold tier.
    With the object store down that wait ends at ``ship_wait`` once, as a "ship_timeout" fault
    naming what is missing; later commits only check, so training goes on at its own pace, and
    say every ``ship_lag_report`` that the data is still behind ("ship_lag"); once the store is
    back and the backlog is up, commits wait (and succeed) again."""
    client = SwiftlogClient(
        ClientConfig(
            run_id="dead",
            stage=0,
            num_stages=1,
            store_root=str(tmp_path / "store"),
            seed=9,
            cold_url=moto_server.url(f"dead-{os.getpid()}"),
            cold_options=moto_server.storage_options,
            checkpoint_url=str(tmp_path / "ckpt"),
            ship_wait=datetime.timedelta(seconds=3),
            ship_lag_report=datetime.timedelta(seconds=1),
        )
    )
    stage = client.pipeline_stage(
        _Masked(), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=_mse)

    seen: list[Any] = []

    def iteration(it: int) -> list[Any]:
        g = torch.Generator().manual_seed(it)
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        faults = client.commit(it).logging_faults
        seen.extend(faults)
        return faults

    assert [
        f for f in iteration(0) if f.kind == "ship_timeout"
    ] == []  # the store is up: the commit waited, and it was there
    waited = client.stats()["commit"]["ship_wait_s"]
    moto_server.kill()
    try:
        faults = [f for it in range(1, 5) for f in iteration(it)]
        ship = [f for f in faults if f.kind == "ship_timeout"]
        assert (
            len(ship) == 1
            and ship[0].iteration == 1
            and "input_0/target_0 not in the cold tier after 3 s" in ship[0].message
        ), faults
        assert client.stats()["commit"]["ship_wait_s"] - waited >= 3.0  # one full wait; the others only checked
        time.sleep(1.1)
        lag = [f for f in iteration(5) if f.kind == "ship_lag"]  # still behind, a report interval later: said again
        assert (
            len(lag) == 1 and "input_0/target_0 are still not all in the cold tier since iteration 1" in lag[0].message
        ), lag
    finally:
        moto_server.restart()
    assert client.store.wait_shipped([Channel.input(0), Channel.target(0)], 5, 300)  # the backlog goes up
    it = 6
    with caplog.at_level(logging.INFO, logger="trainer_client.client"):
        assert [f for f in iteration(it) if f.kind == "ship_timeout"] == []  # caught up: waited, in time
    assert f"caught up by iteration {it}" in caplog.text
    it += 1
    assert [f for f in iteration(it) if f.kind in ("ship_timeout", "ship_lag")] == []  # waits again, and ships in time
    assert client.store.wait_shipped([Channel.input(0), Channel.target(0)], it, 0.0)
    rep = client.close()  # everything went up; the faults are still on the record
    assert (
        rep.drained
        and rep.error is None
        and rep.faults_total == len(seen) == 1 + len([f for f in seen if f.kind == "ship_lag"])
    ), seen


@pytest.mark.s3
@pytest.mark.slow
def test_a_checkpoint_the_dead_object_store_refused_is_registered_once_it_is_back(tmp_path, moto_server):
    """Registration retries a few times at once, then every ``retry_s`` in the background (it used
    to give up after four attempts: the checkpoint was never registered, its logs never garbage)."""
    client = SwiftlogClient(
        ClientConfig(
            run_id="reg",
            stage=0,
            num_stages=2,
            store_root=str(tmp_path / "store"),
            seed=9,
            cold_url=moto_server.url(f"reg-{os.getpid()}"),
            cold_options=moto_server.storage_options,
            checkpoint_url=str(tmp_path / "ckpt"),
        )
    )
    client._maint.retry_s = 0.5
    model = torch.nn.Linear(4, 4)
    moto_server.kill()
    try:
        client.checkpoint(3, model)
        deadline = time.monotonic() + 30
        while not client.stats()["checkpoints"]["unregistered"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats()["checkpoints"]["unregistered"] == [
            [0, 3, client.stats()["checkpoints"]["unregistered"][0][2]]
        ]
        time.sleep(1.5)  # a few quiet retries against the dead store
        faults = [f for f in client.writer.take_faults() if f.kind == "checkpoint_register"]
        assert len(faults) == 4 and "attempt 4" in faults[-1].message, faults
    finally:
        moto_server.restart()
    deadline = time.monotonic() + 30
    while client.stats()["checkpoints"]["unregistered"] and time.monotonic() < deadline:
        time.sleep(0.1)
    ck = client.stats()["checkpoints"]
    assert ck["unregistered"] == [] and [r[:2] for r in ck["registered"]] == [[0, 3]]
    assert [(c.stage, c.iteration) for c in client.store.checkpoints()] == [(0, 3)] and client.store.watermarks() == {
        0: 3
    }
    client.close()


def test_keep_checkpoints_withdraws_then_deletes_the_older_ones(tmp_path):
    """Retention: with keep_checkpoints=2 only the newest two of this stage's checkpoint files stay,
    and the older ones' registrations are withdrawn first (no plan starts from a deleted file)."""
    from logstore import LogStore

    with pytest.raises(ConfigError, match="keep_checkpoints must be None or an int >= 2"):
        ClientConfig(run_id="keep", stage=0, num_stages=2, store_root=str(tmp_path / "s"), keep_checkpoints=1)
    cold = f"file://{tmp_path / 'cold'}"
    client = SwiftlogClient(
        ClientConfig(
            run_id="keep", stage=1, num_stages=2, store_root=str(tmp_path / "store"), cold_url=cold, keep_checkpoints=2
        )
    )
    model = torch.nn.Linear(4, 4)
    uris = [client.checkpoint(it, model) for it in (0, 2, 4, 6)]
    client.flush()
    with LogStore.open(tmp_path / "elsewhere", "keep", cold_url=cold) as other:  # another node sees the same
        other.register_checkpoint(0, 6, uri="file:///not/this/clients/0-6.pt")  # another stage's: never touched
    client.checkpoint(8, model)
    rep = client.close()
    assert rep.faults_total == 0, rep
    ck = client.stats()["checkpoints"]
    assert [r[:2] for r in ck["retired"]] == [[1, 0], [1, 2], [1, 4]]
    assert [os.path.exists(u[len("file://") :]) for u in uris] == [False, False, False, True]
    with LogStore.open(tmp_path / "reader", "keep", cold_url=cold) as r:
        assert [(c.stage, c.iteration) for c in r.checkpoints()] == [(0, 6), (1, 6), (1, 8)]


def test_inputs_and_targets_ship_as_soon_as_the_last_micro_batch_logged_them(tmp_path, single_rank_group):
    """The data wait of the commit overlaps the iteration: once the schedule step logged every
    micro-batch's inputs and targets, they are sealed and shipped without waiting for the commit."""
    client = SwiftlogClient(
        ClientConfig(
            run_id="early",
            stage=0,
            num_stages=1,
            store_root=str(tmp_path / "store"),
            seed=9,
            cold_url=f"file://{tmp_path}/cold",
            checkpoint_url=str(tmp_path / "ckpt"),
        )
    )
    stage = client.pipeline_stage(
        _Masked(), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=_mse)
    g = torch.Generator().manual_seed(0)
    client.step(0, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
    deadline, shipped = time.monotonic() + 30, []
    while len(shipped) < 4 and time.monotonic() < deadline:  # no commit yet: what another machine sees
        with LogStore.open(tmp_path / "elsewhere", "early", cold_url=f"file://{tmp_path}/cold") as other:
            shipped = other.keys(Channel.input(0)) + other.keys(Channel.target(0))
        time.sleep(0.05)
    assert sorted(str(k) for k in shipped) == [
        "input_0/it0/mb0/p0",
        "input_0/it0/mb1/p0",
        "target_0/it0/mb0/p0",
        "target_0/it0/mb1/p0",
    ]
    assert client.commit(0).logging_faults == []
    client.close()


def test_a_data_source_may_give_keyword_inputs(tmp_path, single_rank_group):
    """A data source's batch may carry keyword inputs (a dict last): the step passes them to stage 0
    by name, nothing is logged (log_data=False), and a replay given the same source passes them again."""

    def source(it: int) -> tuple[Any, torch.Tensor]:
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        return (
            x,
            {"mask": (torch.rand(4, 5, generator=g) > 0.5).float(), "scale": torch.rand(4, 1, generator=g) + 0.5},
        ), y

    client = SwiftlogClient(
        ClientConfig(run_id="src", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9, log_data=False),
        data_source=source,
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    stage = client.pipeline_stage(
        mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=_mse)
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt)
        client.step(it)
        client.commit(it)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "src")
    assert logs.keys(Channel.input(0)) == []
    fresh = _Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    rep = replay_stage(
        StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
        LogReader(logs),
        num_stages=1,
        stop_iteration=4,
        loss_fn=_mse,
        data_source=source,
    )
    assert rep.ok and _same_state(mod, fresh)


def test_keyword_inputs_of_the_first_stage_are_logged_and_replayed(tmp_path, single_rank_group):
    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        mask, scale = (torch.rand(4, 5, generator=g) > 0.5).float(), torch.rand(4, 1, generator=g) + 0.5
        client.step(it, x, target=y, mask=mask, scale=scale)

    mod, opt, logs, fresh, fopt, rep = _single_rank_run(
        tmp_path, "kw", lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), step
    )
    meta = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    assert (
        meta["input_kwargs"] == ["mask", "scale"] and len(logs.keys(Channel.input(0))) == 3 * 2 * 3
    )  # iterations 1-3 (0 is garbage), 2 micro-batches, x + 2 keywords
    assert rep.ok and rep.micro_batches == 6 and _same_state(fresh, mod)
    assert torch.equal(
        fopt.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )


def test_both_example_scripts_build_the_client_config_from_the_same_arguments():
    from trainer_client.examples import train_pipeline, train_resilient

    argv = [
        "--stage",
        "1",
        "--num-stages",
        "4",
        "--store-port",
        "1",
        "--out",
        "o",
        "--run-id",
        "r",
        "--store-root",
        "/tmp/x",
        "--cold-url",
        "s3://b/p",
        "--cold-endpoint",
        "http://127.0.0.1:9",
        "--max-queue-bytes",
        "1000",
        "--overflow",
        "gap",
        "--max-backlog-bytes",
        "5000",
        "--encode-threads",
        "2",
        "--groups",
        "2,2",
    ]
    for mod in (train_pipeline, train_resilient):
        cfg = train_pipeline.config_from_args(mod.build_parser().parse_args(argv))
        assert (cfg.stage, cfg.max_queue_bytes, cfg.overflow, cfg.max_backlog_bytes, cfg.encode_threads) == (
            1,
            1000,
            "gap",
            5000,
            2,
        )
        assert cfg.cold_options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9" and list(
            cfg.logging_groups
        ) == [2, 2]


def test_survivors_wake_when_every_replacement_is_ready_or_on_fallback_and_time_out_otherwise(tcp_store):
    from replay.replacement import report_fallback, report_ready
    from trainer_client.survivor import RecoveryKeys, RecoveryTimeoutError, wait_until_woken

    keys = RecoveryKeys("w")
    tcp_store.set(keys.failed_stages(0), "[1, 2]")  # two stages lost together
    report_ready(tcp_store, "w", 0, 1, {"ok": True})
    t0 = time.monotonic()
    with pytest.raises(RecoveryTimeoutError, match="not ready after 0.3 s"):  # one replacement still replays
        wait_until_woken(tcp_store, keys, 0, timeout=datetime.timedelta(seconds=0.3), what="survivor 0")
    assert time.monotonic() - t0 > 0.25  # it waited its timeout
    client = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    threading.Timer(0.2, lambda: report_ready(client, "w", 0, 2, {"ok": True})).start()
    assert wait_until_woken(tcp_store, keys, 0, timeout=datetime.timedelta(seconds=10), what="survivor 0") == "ready"
    tcp_store.set(keys.failed_stages(1), "[3]")
    threading.Timer(0.2, lambda: report_fallback(client, "w", 1, "records gone")).start()
    assert wait_until_woken(tcp_store, keys, 1, timeout=datetime.timedelta(seconds=10), what="survivor 0") == "fallback"


def _torch_clip(
    grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What ``torch.nn.utils.clip_grad_norm_`` makes of copies of ``grads``: (total norm, clipped copies)."""
    refs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for r, g in zip(refs, grads, strict=True):
        r.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(refs, max_norm, norm_type)
    return total, [r.grad for r in refs]


def test_clip_grad_norm_clips_as_torch_does_and_the_replay_repeats_it(tmp_path, single_rank_group):
    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        with pytest.raises(
            RuntimeError, match="between client.step"
        ):  # before the first step, or after a commit (META is gone)
            client.clip_grad_norm_(mod.parameters(), 1.0)
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        want_norm, want = _torch_clip([p.grad for p in mod.parameters()], 0.05)
        got_norm = client.clip_grad_norm_(mod.parameters(), 0.05)
        assert torch.equal(got_norm, want_norm) and want_norm > 0.05  # clipping is active
        assert all(torch.equal(p.grad, w) for p, w in zip(mod.parameters(), want, strict=True))
        if it == 2:  # a second call, on a subset and with the inf norm: both replayed, in order
            client.clip_grad_norm_([mod.lin.weight], 0.001, norm_type=float("inf"))
            with pytest.raises(ValueError, match=r"parameters \[0\] .* are not parameters of the stage's module"):
                client.clip_grad_norm_([torch.nn.Parameter(torch.zeros(1))], 1.0)

    mod, opt, logs, fresh, fopt, rep = _single_rank_run(
        tmp_path, "clip", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), step, schedule="gpipe"
    )
    clips = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))["grad_clip"]
    assert (
        [c["params"] for c in clips] == [None, [0]] and clips[1]["max_norm"] == 0.001 and clips[0]["dtype"] == "float32"
    )
    assert rep.ok and rep.micro_batches == 6 and _same_state(fresh, mod)
    assert all(
        torch.equal(fopt.state_dict()["state"][i]["exp_avg_sq"], opt.state_dict()["state"][i]["exp_avg_sq"])
        for i in opt.state_dict()["state"]
    )


def test_a_divergence_after_a_matching_first_iteration_points_at_the_update():
    """A replay whose first iteration matched but a later one did not: the hint names what changes an
    update behind the client's back (torch's clip_grad_norm_ called directly); a divergence in the first
    iteration points at determinism instead."""
    key = lambda it: str(RecordKey(Channel.activation(1), it, 0))  # noqa: E731
    for it, words in ((3, "client.clip_grad_norm_"), (2, "trainer_client.determinism")):
        rep = ReplayReport([1], 2, 5)
        rep.digest_mismatches.append(key(it))
        with pytest.raises(ReplayMismatchError) as ei:
            rep.raise_for_mismatch()
        assert words in (ei.value.hint or "") and f"iteration {it} " in str(ei.value)


def test_example_args_that_cannot_carry_gradients_are_refused_up_front(tmp_path):
    """torch's schedules fail in backward ("grad can be implicitly created only for scalar
    outputs") when a stage's floating output_args (or a later stage's input_args) do not require
    grad: pipeline_stage says so before anything runs (two new users hit it)."""
    mod = torch.nn.Linear(4, 4)
    for stage, kw, needle in (
        (0, {"input_args": torch.zeros(2, 4), "output_args": torch.zeros(2, 4)}, "output_args requires grad"),
        (1, {"input_args": torch.zeros(2, 4), "output_args": torch.zeros(2, 4)}, "input_args requires grad"),
    ):
        client = SwiftlogClient(
            ClientConfig(run_id="args", stage=stage, num_stages=2, store_root=str(tmp_path / f"s{stage}"))
        )
        with pytest.raises(ConfigError, match=needle) as ei:
            client.pipeline_stage(mod, "cpu", **kw)
        assert "requires_grad=True" in (ei.value.hint or "")
        client.close()


def test_a_step_under_autocast_is_recorded_and_replayed_under_it(tmp_path, single_rank_group):
    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))

    mod, _, logs, fresh, _, rep = _single_rank_run(
        tmp_path, "amp", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), step, out_dtype=torch.bfloat16
    )
    meta = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    assert (
        meta["autocast"] == [{"device_type": "cpu", "dtype": "bfloat16", "cache_enabled": True}]
        and not meta["autocast_varies"]
    )
    assert rep.ok and rep.micro_batches == 6 and _same_state(fresh, mod)


def test_a_send_that_differs_from_the_declared_output_is_refused(tmp_path):
    """torch's pipelining receives into buffers of the declared type without converting: a bf16 output
    declared float32 (autocast) corrupts what arrives, so the client raises before the send, naming it
    (and notes the fault)."""
    from types import SimpleNamespace

    client = SwiftlogClient(ClientConfig(run_id="decl", stage=0, num_stages=2, store_root=str(tmp_path / "store")))
    declared = [SimpleNamespace(dtype=torch.float32, shape=torch.Size([4, 32]))]
    client.recorder.check_declared_sends([torch.zeros(4, 32)], declared)
    client.recorder.check_declared_sends([torch.zeros(4, 32)], None)  # nothing declared: nothing to compare
    assert client.writer.take_faults() == []
    with pytest.raises(
        ConfigError, match=r"stage 0 sends output 0 as bfloat16 \[4, 32\] but declared float32 \[4, 32\]"
    ):
        client.recorder.check_declared_sends([torch.zeros(4, 32, dtype=torch.bfloat16)], declared)
    (fault,) = client.writer.take_faults()
    assert fault.kind == "send_mismatch" and "bfloat16 [4, 32] but declared float32 [4, 32]" in fault.message
    client.close()


def test_a_buffer_snapshot_sees_changes_by_content_and_puts_them_back():
    from trainer_client.buffers import BufferSnapshot, named_buffers

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    m.register_buffer("zero", torch.zeros(2))
    snap = BufferSnapshot()
    snap.take(named_buffers({"": m}))
    versions = m[1].running_mean._version
    m(torch.randn(8, 4))  # BatchNorm's kernel moves its statistics without bumping their version counters
    assert m[1].running_mean._version == versions
    assert snap.changed(named_buffers({"": m})) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    m.zero.neg_()  # -0.0: equal as numbers, different bits
    m.register_buffer("grown", torch.ones(3))
    assert snap.changed(named_buffers({"": m})) == [
        "1.num_batches_tracked",
        "1.running_mean",
        "1.running_var",
        "grown",
        "zero",
    ]
    m[1].running_var = torch.ones(7)  # replaced by a tensor of another shape
    snap.restore(m)
    assert (
        torch.equal(m[1].running_mean, torch.zeros(4))
        and torch.equal(m[1].running_var, torch.ones(4))
        and int(m[1].num_batches_tracked) == 0
    )
    assert not torch.signbit(m.zero).any()
    assert m.grown is None and "grown" not in m.state_dict()  # appeared during the discarded iteration: gone again
    assert snap.changed(named_buffers({"": m})) == []


def test_a_learning_rate_set_outside_the_scheduler_stops_the_replay_naming_it(tmp_path, single_rank_group):
    """META records the learning rates each step used (the optimizer given to checkpoint); a loop that
    sets them in a way the replay does not repeat (here by hand, in iteration 2) stops the replay at
    that step, naming both, instead of replaying on to a state that differs."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        if it == 2:
            for group in opt.param_groups:
                group["lr"] = 0.01

    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 2: the live optimizer step and the replay's differ: lr of param group 0: 0\.01 -> 0\.05 \(live -> replay\) \(hint",
    ):
        _single_rank_run(tmp_path, "lr", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), step)
    meta = trainer_client.decode_meta(LogStore.open(tmp_path / "store", "lr").get(RecordKey(Channel.meta(0), 1, 0)))
    assert meta["lrs"] == [0.05]


def test_another_hyperparameter_set_by_hand_stops_the_replay_naming_it(tmp_path, single_rank_group):
    """META also records each param group's other hyperparameters (``hparams``): a weight decay set by
    hand (here before the commit of iteration 2) stops the replay at that step, naming it."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        if it == 2:
            opt.param_groups[0]["weight_decay"] = 0.5

    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 2: .*differ: weight_decay of param group 0: 0\.5 -> 0\.01 \(live -> replay\) \(hint",
    ):
        _single_rank_run(tmp_path, "wd", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01), step)


def _run_with_scheduler(
    tmp_path: Path, run_id: str, commit_store: Any, set_after_commit: Callable[[int, torch.optim.Optimizer], None]
) -> tuple[SwiftlogClient, Any, str, torch.nn.Module]:
    """``_Masked`` as a one-stage pipeline, 4 iterations, AdamW under OneCycleLR (which also cycles
    the betas), a checkpoint at 1; ``set_after_commit(it, optimizer)`` runs between each commit and
    the optimizer step. Returns the client (closed), its close report, the checkpoint and the module."""
    client = SwiftlogClient(
        ClientConfig(run_id=run_id, stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9),
        commit_store=commit_store,
    )
    mod = _Masked()
    opt = torch.optim.AdamW(mod.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    uri = _train_one_stage(client, mod, opt, sched=sched, apply=lambda it: (set_after_commit(it, opt), opt.step()))
    return client, client.close(), uri, mod


def _replay_with_scheduler(tmp_path: Path, run_id: str, uri: str, stop: int) -> tuple[Any, torch.nn.Module]:
    fresh = _Masked()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    state = StageState.from_checkpoint(
        load_checkpoint(uri), fresh, fopt, torch.optim.lr_scheduler.OneCycleLR(fopt, max_lr=0.1, total_steps=10)
    )
    return replay_stage(
        state, LogReader(LogStore.open(tmp_path / "store", run_id)), num_stages=1, stop_iteration=stop, loss_fn=_mse
    ), fresh


def test_a_learning_rate_set_after_the_commit_amends_meta_and_stops_the_replay_at_that_step(
    tmp_path, single_rank_group, tcp_store
):
    """Set between ``client.commit`` and ``optimizer.step()`` (here in the last iteration, which no
    later META reveals), a learning rate was invisible: META holds the values at the commit, and the
    replay said "verified" with another state. The client sees the step (a pre-hook on the tracked
    optimizer), amends the iteration's META in the log (micro-batch 1) and in the commit store (the
    copy a replacement reads), reports it, and the replay stops at that step naming the change.
    The scheduler's own changes (OneCycleLR also cycles the betas) are no such change."""
    store = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=datetime.timedelta(seconds=30))

    def halve_in_last(it: int, opt: torch.optim.Optimizer) -> None:
        if it == 3:
            opt.param_groups[0]["lr"] *= 0.5

    client, report, uri, _ = _run_with_scheduler(tmp_path, "after", store, halve_in_last)
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert (
        len(faults) == 1
        and faults[0].iteration == 3
        and "the optimizer step is not what its META says" in faults[0].message
    ), report.logging_faults
    logs = LogStore.open(tmp_path / "store", "after")
    committed = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))
    amended = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 1)))
    assert amended["lrs"] == [committed["lrs"][0] * 0.5] and amended["changed_after_commit"] == [
        f"lr of param group 0: {committed['lrs'][0]} -> {committed['lrs'][0] * 0.5}"
    ]
    assert (
        committed["hparams"][0]["betas"]
        == amended["hparams"][0]["betas"]
        != trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))["hparams"][0]["betas"]
    )
    in_store = {it: json.loads(b) for it, b in stored_metas(store, client.coordinator.prefix, 0, range(1, 4)).items()}
    assert (
        in_store[3]["lrs"] == amended["lrs"]
        and in_store[3]["changed_after_commit"]
        and "changed_after_commit" not in in_store[2]
    )
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: .*lr of param group 0: .* \(live -> replay\) \(the live step differed from its META as committed: lr of param group 0: ",
    ):
        _replay_with_scheduler(tmp_path, "after", uri, 4)
    rep, _ = _replay_with_scheduler(tmp_path, "after", uri, 3)  # the steps before it are what they were
    assert rep.ok
    from replay import plan_recovery  # the plan says so up front (it said "verifiable" and exit 0)

    plan = plan_recovery(LogStore.open(tmp_path / "store", "after"), [0])
    assert not plan.possible and any(
        "stage 0 iteration 3: the live optimizer step was not what its META says (lr of param group 0" in r
        for r in plan.reasons
    ), plan.reasons


def _epoch_run(
    tmp_path: Path, run_id: str, iters: int, *, count_last: bool = True
) -> tuple[FlushReport, str, torch.nn.Module, Any]:
    """``_Masked`` under SGD with momentum and a StepLR stepped per "epoch" of two iterations (after
    even ones), ``iters`` iterations, checkpoint at 1. ``count_last=False``: close as if the stage
    had died before counting the last iteration's steps. Returns the close report, the checkpoint,
    the module and the scheduler."""
    client = SwiftlogClient(
        ClientConfig(run_id=run_id, stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    uri = _train_one_stage(client, mod, opt, iters=iters, sched=sched, sched_after=lambda it: it % 2 == 0)
    if not count_last:
        client._committed = None  # what close would count: nothing, as after a death in the optimizer step
    return client.close(), uri, mod, sched


def _replay_epochs(tmp_path: Path, run_id: str, uri: str, stop: int) -> tuple[Any, torch.nn.Module, Any]:
    fresh = _Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fsched = torch.optim.lr_scheduler.StepLR(fopt, step_size=1, gamma=0.5)
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt, fsched)
    rep = replay_stage(
        state, LogReader(LogStore.open(tmp_path / "store", run_id)), num_stages=1, stop_iteration=stop, loss_fn=_mse
    )
    return rep, fresh, fsched


@pytest.mark.parametrize("iters", [2, 5])
def test_a_scheduler_stepped_per_epoch_is_replayed_as_it_ran(tmp_path, single_rank_group, iters):
    """A QA check: a StepLR stepped every other iteration; the replay of one iteration stepped it
    after its optimizer step, said "verified", and every later state differed (nothing checked the
    rate it carried on with). The client counts the scheduler's steps (given to ``checkpoint``):
    META records its ``last_epoch`` at each commit, and once a count other than one is seen, every
    iteration's META is amended with the steps made after it (counted at the next step, checkpoint
    or close); the replay makes them, so it ends bit-identical, one iteration or several."""
    report, uri, live, live_sched = _epoch_run(tmp_path, "epoch", iters)
    assert report.ok and report.logging_faults == [], report.logging_faults
    logs = LogStore.open(tmp_path / "store", "epoch")
    assert trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 1, 1)))["apply"] == {
        "optimizer_steps": 1,
        "scheduler_steps": 0,
    }
    rep, fresh, fsched = _replay_epochs(tmp_path, "epoch", uri, iters)
    assert rep.ok and _same_state(live, fresh) and fsched.state_dict() == live_sched.state_dict()
    momenta = [
        [st["momentum_buffer"] for st in s.optimizer.state_dict()["state"].values()] for s in (live_sched, fsched)
    ]
    assert len(momenta[0]) == 2 and all(torch.equal(a, b) for a, b in zip(*momenta, strict=True))


def test_a_stage_lost_before_its_scheduler_count_reached_meta_is_not_replayed_to_a_guess(tmp_path, single_rank_group):
    """The count after an iteration is taken when the next one begins: a stage that died before
    that (in its optimizer step), in a run seen stepping its scheduler irregularly, leaves the count
    unknown. The plan says so and the replay stops there instead of guessing one step; the
    iterations before it replay."""
    _, uri, _, _ = _epoch_run(tmp_path, "lost", 4, count_last=False)
    logs = LogStore.open(tmp_path / "store", "lost")
    assert trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))["apply_irregular"] == 1
    assert [k.micro_batch for k in logs.keys(Channel.meta(0), 3, 4)] == [0]
    from replay import plan_recovery

    plan = plan_recovery(logs, [0])
    assert not plan.possible and any(
        "stage 0 iteration 3: the live loop did not step its optimizer and lr scheduler once per iteration" in r
        for r in plan.reasons
    ), plan.reasons
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop did not make exactly one optimizer and one lr-scheduler step",
    ):
        _replay_epochs(tmp_path, "lost", uri, 4)
    assert _replay_epochs(tmp_path, "lost", uri, 3)[0].ok


def test_a_second_schedule_step_of_one_iteration_is_refused(tmp_path, single_rank_group):
    """Gradient accumulation over two ``client.step`` calls per optimizer step was accepted, and a
    recovery said "verified" with another state (a QA check): a replay repeats one schedule step
    per iteration. A second step of one iteration before its commit is refused, naming the way out."""
    client = SwiftlogClient(
        ClientConfig(run_id="twice", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    stage = client.pipeline_stage(
        _Masked(), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=_mse)
    x, y = torch.randn(4, 8), torch.randn(4, 5)
    client.step(0, x, target=y)
    with pytest.raises(RuntimeError, match=r"client\.step\(0\) again before client\.commit\(0\).*n_microbatches"):
        client.step(0, x, target=y)
    client.commit(0)
    client.step(1, x, target=y)  # the next iteration is fine
    client.abort(1)
    client.step(1, x, target=y)  # and so is an aborted iteration run again
    assert client.close().ok


def test_an_optimizer_step_before_the_commit_is_counted_too(tmp_path, single_rank_group):
    """The optimizer stepped between the schedule step and the commit (not the documented order, but
    replayable): counted as the iteration's step, no fault, and the replay equals the live run."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        opt.step()

    client = SwiftlogClient(
        ClientConfig(run_id="early", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = _train_one_stage(client, mod, opt, step=step, apply=lambda it: None)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "early")
    assert all(k.micro_batch == 0 for k in logs.keys(Channel.meta(0))), "nothing amended"
    fresh = _Masked()
    state = StageState.from_checkpoint(
        load_checkpoint(uri), fresh, torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    )
    assert replay_stage(state, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=_mse).ok and _same_state(
        fresh, mod
    )


def test_an_iteration_without_an_optimizer_step_stops_the_replay_there(tmp_path, single_rank_group):
    """Accumulating over iterations (an optimizer step every other commit) cannot be replayed: the
    client counts the steps, reports the iteration without one (``no_optimizer_step``), amends its
    META, and the plan and the replay stop there."""
    client = SwiftlogClient(
        ClientConfig(run_id="accum", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    uri = _train_one_stage(client, mod, opt, iters=4, apply=lambda it: opt.step() if it % 2 == 1 else None)
    assert client.close().drained  # not "ok": a fault was reported
    faults = [f for f in client.writer.recent_faults() if f.kind == "no_optimizer_step"]  # reported by commit(3)
    assert [f.iteration for f in faults] == [2] and "gradients accumulated over iterations" in faults[0].message, (
        client.writer.recent_faults()
    )
    from replay import plan_recovery

    logs = LogStore.open(tmp_path / "store", "accum")
    plan = plan_recovery(logs, [0])
    assert not plan.possible and any(
        "stage 0 iteration 2: the live loop made no optimizer step after it" in r for r in plan.reasons
    ), plan.reasons
    fresh = _Masked()
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, torch.optim.SGD(fresh.parameters(), lr=0.05))
    with pytest.raises(
        ReplayError, match=r"stage 0 iteration 2: the live loop made no optimizer step after this iteration"
    ):
        replay_stage(state, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=_mse)


def test_gradients_changed_outside_the_client_stop_the_replay_at_that_step(tmp_path, single_rank_group):
    """torch's own clip_grad_norm_ (instead of the client's) in the last iteration: nothing later
    shows it (no later send depends on that step), and the replay said "verified" with another
    state. The client compares the gradients' version counters after the schedule's step with
    those at the optimizer step, amends META, and the replay stops there naming the parameters.
    The client's own clip is no such change."""

    def clip(it: int, opt: torch.optim.Optimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        if it == 3:
            torch.nn.utils.clip_grad_norm_(params, 1e-3)

    client, report, uri, _ = _run_with_scheduler(tmp_path, "torchclip", None, clip)
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert (
        len(faults) == 1
        and "lin.weight, lin.bias" in faults[0].message
        and "client.clip_grad_norm_" in faults[0].message
    ), report.logging_faults
    amended = trainer_client.decode_meta(
        LogStore.open(tmp_path / "store", "torchclip").get(RecordKey(Channel.meta(0), 3, 1))
    )
    assert amended["grads_changed"] == ["lin.weight", "lin.bias"]
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop changed gradients after the schedule's backward .*lin\.weight",
    ):
        _replay_with_scheduler(tmp_path, "torchclip", uri, 4)
    assert _replay_with_scheduler(tmp_path, "torchclip", uri, 3)[0].ok


def test_a_grad_scaler_step_is_seen_although_its_unscale_leaves_the_version_counters(tmp_path, single_rank_group):
    """torch.amp.GradScaler's unscale kernel changes every gradient without bumping their version
    counters (torch 2.13, CPU): a recovery said "verified" with another state (a QA check). The
    client recognises a step that comes from a GradScaler and amends META; the replay stops there."""
    client = SwiftlogClient(
        ClientConfig(run_id="amp", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # its scale exists from the first scale() on (a loss_fn would scale the loss)
    uri = _train_one_stage(client, mod, opt, iters=3, apply=lambda it: (scaler.step(opt), scaler.update()))
    report = client.close()
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert faults and "a GradScaler unscaled them" in faults[0].message, report.logging_faults
    fresh = _Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with pytest.raises(ReplayError, match=r"stage 0 iteration 1: the live loop changed gradients .*GradScaler"):
        replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(LogStore.open(tmp_path / "store", "amp")),
            num_stages=1,
            stop_iteration=3,
            loss_fn=_mse,
        )


def test_gradients_changed_without_their_version_counters_after_the_commit_stop_the_replay(tmp_path, single_rank_group):
    """A collective on the gradients (an all_reduce of tied weights) or a write through ``.data``
    between ``commit`` and the optimizer step leaves the version counters alone, and the last
    iteration's step was replayed without it and said "verified". META now holds the digests of the
    gradients at the commit (``grad_digests``); the step's pre-hook compares them, amends META and
    reports it, and the replay stops at that step naming the parameters."""

    def halve_through_data(it: int, opt: torch.optim.Optimizer) -> None:
        if it == 3:
            for p in opt.param_groups[0]["params"]:
                p.grad.data.mul_(0.5)  # what a gloo all_reduce does to the version counter: nothing

    client, report, uri, _ = _run_with_scheduler(tmp_path, "dataw", None, halve_through_data)
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert (
        len(faults) == 1 and faults[0].iteration == 3 and "without touching their version counters" in faults[0].message
    ), report.logging_faults
    logs = LogStore.open(tmp_path / "store", "dataw")
    committed = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))
    assert len(committed["grad_digests"]) == 2 and all(
        isinstance(d, str) and len(d) == 16 for d in committed["grad_digests"]
    )
    assert trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 1)))["grads_changed"] == [
        "lin.weight",
        "lin.bias",
    ]
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop changed gradients .*without touching their version counters",
    ):
        _replay_with_scheduler(tmp_path, "dataw", uri, 4)
    rep, _ = _replay_with_scheduler(tmp_path, "dataw", uri, 3)
    assert rep.ok and rep.steps_checked == 2 and rep.grad_mismatches == []  # (one stage: no send to verify)


def test_gradients_changed_before_the_commit_outside_the_replay_make_it_unverified(tmp_path, single_rank_group):
    """Gradients changed between the schedule's step and the commit by what a replay does not
    repeat (a data-parallel or tied-weight all_reduce, a hook, a ``.data`` write): the commit's
    digests are of the changed gradients, and the replay's own differ at that very step, the last
    one included, where no later send could show it. The report names the iteration and the
    parameters, is not verified, and ``raise_for_mismatch`` says why."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        _plain_step(client, mod, opt, it, g)
        if it == 3:
            mod.lin.bias.grad.data.add_(1e-3)

    client = SwiftlogClient(
        ClientConfig(run_id="before", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = _train_one_stage(client, mod, opt, step=step)
    assert client.close().ok  # nothing the live stage could see
    logs = LogStore.open(tmp_path / "store", "before")
    fresh = _Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    rep = replay_stage(
        StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
        LogReader(logs),
        num_stages=1,
        stop_iteration=4,
        loss_fn=_mse,
    )
    assert rep.first_mismatch is None and rep.steps_checked == 3
    assert rep.grad_mismatches == [{"stage": 0, "iteration": 3, "params": ["lin.bias"]}] and not rep.ok
    assert (
        "stage 0 iteration 3: the gradients the optimizer step used differ from the live step's (lin.bias)"
        in rep.unverified_reason
    )
    with pytest.raises(
        ReplayMismatchError, match=r"iteration 3: the gradients the optimizer step used differ .*a collective"
    ):
        rep.raise_for_mismatch()
    again = ReplayReport.from_dict(rep.to_dict())
    assert again.grad_mismatches == rep.grad_mismatches and again.steps_checked == 3 and not again.verified


def test_all_reduce_grads_is_logged_ordered_with_clips_and_replayed(tmp_path, single_rank_group):
    """``client.all_reduce_grads_`` between the schedule's step and the commit: META lists the call
    (its place among the clips, the parameters, the digests before it), the reduced gradients are
    a record per call, and the replay checks its own gradients against those digests, puts the
    logged ones in their place and clips after it as the live loop did. Misuse is named."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        _plain_step(client, mod, opt, it, g)
        client.clip_grad_norm_(mod.parameters(), 10.0)
        if it == 3:
            mod.lin.bias.grad.data.add_(1e-3)  # before the reduction: in its digests, not in a replay's gradients
        client.all_reduce_grads_([mod.lin.bias, mod.lin.weight], average=True)  # a world of one: the values stay
        client.clip_grad_norm_(mod.parameters(), 0.01)
        with pytest.raises(ValueError, match=r"parameters \[0\] .*are not parameters of the stage's module"):
            client.all_reduce_grads_([torch.nn.Parameter(torch.zeros(2))])
        with pytest.raises(ValueError, match="no parameters given"):
            client.all_reduce_grads_([])

    client = SwiftlogClient(
        ClientConfig(run_id="reduce", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    with pytest.raises(
        RuntimeError, match=r"all_reduce_grads_ belongs between client.step\(it\) and client.commit\(it\)"
    ):
        client.all_reduce_grads_([torch.nn.Parameter(torch.zeros(2))])
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = _train_one_stage(client, mod, opt, step=step)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "reduce")
    meta = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    (call,) = meta["grad_reduce"]
    assert (
        [c["seq"] for c in meta["grad_clip"]] == [0, 2]
        and call["seq"] == 1
        and call["params"] == [1, 0]
        and call["world"] == 1
    )
    assert call["average"] is True and len(call["pre"]) == 2
    bias, weight = logs.get(RecordKey(Channel.reduced(0), 2, 0, 0)), logs.get(RecordKey(Channel.reduced(0), 2, 0, 1))
    assert bias.shape == mod.lin.bias.shape and weight.shape == mod.lin.weight.shape

    def again(stop: int) -> tuple[Any, torch.nn.Module]:
        fresh = _Masked()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        return replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(logs),
            num_stages=1,
            stop_iteration=stop,
            loss_fn=_mse,
        ), fresh

    rep, fresh = again(3)
    assert rep.ok and rep.steps_checked == 2
    rep, fresh = again(
        4
    )  # the logged sum replaces the replay's own gradients: the state is the live one, but the inputs to the call differed
    assert _same_state(fresh, mod) and rep.steps_checked == 3
    assert (
        rep.grad_mismatches
        == [{"stage": 0, "iteration": 3, "params": ["lin.bias"], "at": "before all_reduce_grads_ call 0"}]
        and rep.diverged
    )
    assert (
        "stage 0 iteration 3: the gradients before all_reduce_grads_ call 0 differ from the live ones (lin.bias)"
        in rep.unverified_reason
    )


def test_a_replacement_scheduler_of_another_kind_or_schedule_is_refused(tmp_path, single_rank_group):
    """A stage factory that builds another lr scheduler than the training's (a StepLR for a
    LambdaLR) took the checkpoint's state without a word (torch loads any state dict) and a replay
    of one iteration said "verified": every stage diverged after it (a QA check). The checkpoint
    names its classes and the load refuses another class, or (older checkpoints) a state with
    other fields; the same class computing other rates (another lambda) is caught after the last
    replayed step wherever the next iteration's META is in the logs."""
    client = SwiftlogClient(
        ClientConfig(run_id="sched", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = _train_one_stage(client, mod, opt, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e)))
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "sched")

    def state(make_sched: Callable[[torch.optim.Optimizer], Any], ck: Any = None) -> StageState:
        fresh = _Masked()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        return StageState.from_checkpoint(ck or load_checkpoint(uri), fresh, fopt, make_sched(fopt))

    assert load_checkpoint(uri).classes == {"optimizer": "SGD", "lr_scheduler": "LambdaLR"}
    with pytest.raises(
        CheckpointError, match=r"was saved from a LambdaLR lr scheduler, not the StepLR it is loaded into"
    ):
        state(lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    with pytest.raises(CheckpointError, match=r"was saved from a SGD optimizer, not the AdamW"):
        StageState.from_checkpoint(load_checkpoint(uri), (m := _Masked()), torch.optim.AdamW(m.parameters()))
    older = load_checkpoint(uri)
    older.classes = {}
    with pytest.raises(
        CheckpointError,
        match=r"its lr scheduler state does not fit the lr scheduler StepLR: fields \['lr_lambdas'\] only in",
    ):
        state(lambda o: torch.optim.lr_scheduler.StepLR(o, 1), older)
    unchecked = load_checkpoint(uri)
    unchecked.sched_next = None  # an older checkpoint: the replay's first step shows it
    other_lambda = state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5), unchecked)
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 1: after the step, the lr scheduler LambdaLR set the learning rates \[0.025\] where the live",
    ):
        replay_stage(other_lambda, LogReader(logs), num_stages=1, stop_iteration=2, loss_fn=_mse)
    # nothing to replay (a stage lost in its checkpoint's iteration): the load itself compares the next step's rates
    with pytest.raises(
        CheckpointError, match=r"would set the learning rates \[0.025\] at its next step, the training's set \[0.0166"
    ):
        state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5))
    resumed = _Masked()  # a user resuming with another schedule on purpose
    ropt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    load_checkpoint(uri).apply(resumed, ropt, torch.optim.lr_scheduler.StepLR(ropt, 1), strict=False)
    # the same lambda until the last replayed step (whose next META no stage wrote): caught by the formula META carries
    late = state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e) if e < 4 else 0.5))
    with pytest.raises(ReplayError, match=r"stage 0 iteration 3: after the step, the lr scheduler LambdaLR set"):
        replay_stage(late, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=_mse)
    meta = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))
    assert meta["sched_next"] == [0.05 * (1.0 / (1 + 4))]  # base_lr * lambda(epoch), as the scheduler computes it
    # where the next META is logged and the formula is not (an older record), the rates are compared with it
    plain = state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5), unchecked)
    metas = {
        RecordKey(Channel.meta(0), it, 0): trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), it, 0)))
        for it in range(1, 4)
    }

    class _OlderMeta:  # the logs, with META documents as an older client wrote them (no sched_next)
        def get(self, key: RecordKey) -> torch.Tensor:
            if key in metas:
                return trainer_client.encode_meta({k: v for k, v in metas[key].items() if k != "sched_next"})
            return logs.get(key)

        def keys(self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None) -> list[RecordKey]:
            return logs.keys(channel, it_lo, it_hi)

        def gaps(self) -> list[dict[str, Any]]:
            return logs.gaps()

    with pytest.raises(
        ReplayError,
        match=r"stage 0: after the replay's last step, its optimizer has other values than the live one had for iteration 2: lr of",
    ):
        replay_stage(plain, LogReader(_OlderMeta()), num_stages=1, stop_iteration=2, loss_fn=_mse)
    assert replay_stage(
        state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))),
        LogReader(logs),
        num_stages=1,
        stop_iteration=2,
        loss_fn=_mse,
    ).ok


def test_gradients_not_zeroed_after_a_step_are_reported_and_stop_the_replay(tmp_path, single_rank_group):
    """A loop that forgot ``optimizer.zero_grad()`` after a step: the next backward adds to the
    gradients the step used, which a replay (starting each iteration from none) cannot repeat; the
    replay said only that gradients differed "by a collective or a .data write". The client sees
    the stepped gradients untouched at the next schedule step (a ``grads_not_zeroed`` fault, META
    ``grads_carried``), and the plan and the replay stop there naming it. Zeroing in place counts."""
    client = SwiftlogClient(
        ClientConfig(run_id="nozero", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    stage = client.pipeline_stage(
        mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=_mse)
    uri = ""
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt)
        _plain_step(client, mod, opt, it, torch.Generator().manual_seed(it))
        client.commit(it)
        opt.step()
        if it != 2:  # forgotten once
            opt.zero_grad(set_to_none=it != 1)  # in place after iteration 1
    assert client.close().drained  # not "ok": a fault was reported (by commit(3))
    faults = [f for f in client.writer.recent_faults() if f.kind == "grads_not_zeroed"]
    assert (
        len(faults) == 1
        and "lin.weight, lin.bias" in faults[0].message
        and "optimizer.zero_grad()" in faults[0].message
    ), client.writer.recent_faults()
    logs = LogStore.open(tmp_path / "store", "nozero")
    metas = {it: trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), it, 0))) for it in (2, 3)}
    assert metas[2]["grads_carried"] == [] and metas[3]["grads_carried"] == ["lin.weight", "lin.bias"]
    from replay import plan_recovery

    plan = plan_recovery(logs, [0])
    assert not plan.possible and any(
        "stage 0 iteration 3: the live loop did not zero the gradients" in r for r in plan.reasons
    ), plan.reasons

    def again(stop: int) -> Any:
        fresh = _Masked()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        return replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(logs),
            num_stages=1,
            stop_iteration=stop,
            loss_fn=_mse,
        )

    assert again(3).ok
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop did not zero the gradients after the previous optimizer step",
    ):
        again(4)


def test_reductions_and_clips_name_parameters_by_their_place_in_the_stage_module(tmp_path, single_rank_group):
    """A QA check: ``all_reduce_grads_(..., module=model.head)`` recorded positions in the
    submodule, which the replay looked up in the whole stage (the sum went to another parameter,
    or the shapes clashed); and with ``average=True`` a rank outside the group (torch's all_reduce
    does nothing there) divided by its "size", -1, negating its gradients."""
    client = SwiftlogClient(
        ClientConfig(run_id="pos", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 5))
    client.pipeline_stage(mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True))
    client.begin_iteration(0)
    mod[1].bias.grad = torch.ones(5)
    with pytest.raises(ValueError, match=r"this rank \(0\) is not a member of the group given"):
        client.all_reduce_grads_([mod[1].bias], group=dist.GroupMember.NON_GROUP_MEMBER, average=True)
    assert torch.equal(mod[1].bias.grad, torch.ones(5))
    client.all_reduce_grads_([mod[1].bias], module=mod[1], average=True)
    client.clip_grad_norm_([mod[1].bias], 1.0, module=mod[1])
    assert client._grad_reduces[-1]["params"] == [3] and client._grad_clips[-1]["params"] == [3]
    client.close()


def test_composite_schedulers_are_checked_part_by_part_and_never_changed_by_the_client(tmp_path, single_rank_group):
    """A QA check: a SequentialLR (LinearLR then CosineAnnealingLR) loaded into a factory's
    SequentialLR of LinearLR then ExponentialLR took the state and recovered "verified" with a wrong
    state; a ChainedScheduler with its parts swapped raised a bare KeyError from torch. Checkpoints
    name a composite's parts and a load compares each; the rates a torch scheduler's next step sets
    (found by stepping it and putting it back) go into META, and stepping it so changes nothing."""
    sched_mod = torch.optim.lr_scheduler

    def seq(o: torch.optim.Optimizer, second: Callable[[torch.optim.Optimizer], Any]) -> Any:
        return sched_mod.SequentialLR(
            o, [sched_mod.LinearLR(o, start_factor=0.5, total_iters=2), second(o)], milestones=[2]
        )

    client = SwiftlogClient(
        ClientConfig(run_id="seq", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = _train_one_stage(client, mod, opt, sched=seq(opt, lambda o: sched_mod.LambdaLR(o, lambda e: 1.0 / (1 + e))))
    assert client.close().ok
    ck = load_checkpoint(uri)
    assert ck.classes["lr_scheduler"] == "SequentialLR[LinearLR,LambdaLR]"
    fresh = _Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(
        CheckpointError,
        match=r"saved from a SequentialLR\[LinearLR,LambdaLR\] lr scheduler, not the SequentialLR\[LinearLR,ExponentialLR\]",
    ):
        StageState.from_checkpoint(ck, fresh, fopt, seq(fopt, lambda o: sched_mod.ExponentialLR(o, 0.9)))
    ck.classes = {}  # an older checkpoint: the parts' fields are compared
    with pytest.raises(
        CheckpointError,
        match=r"fields \['lr_lambdas'\] only in the checkpoint, \['gamma'\] only in the scheduler \(its scheduler 1\)",
    ):
        StageState.from_checkpoint(ck, fresh, fopt, seq(fopt, lambda o: sched_mod.ExponentialLR(o, 0.9)))
    # the parts' classes agree but the inner lambda does not: the step's rates differ from those META carries
    logs = LogStore.open(tmp_path / "store", "seq")
    fresh = _Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(
        CheckpointError,
        match=r"the lr scheduler SequentialLR\[LinearLR,LambdaLR\] loaded with its state would set the learning rates",
    ):
        StageState.from_checkpoint(
            load_checkpoint(uri), fresh, fopt, seq(fopt, lambda o: sched_mod.LambdaLR(o, lambda e: 0.5))
        )
    older = load_checkpoint(uri)
    older.sched_next = None  # an older checkpoint: a replayed step shows it
    st = StageState.from_checkpoint(older, fresh, fopt, seq(fopt, lambda o: sched_mod.LambdaLR(o, lambda e: 0.5)))
    with pytest.raises(
        ReplayError, match=r"stage 0 iteration \d: after the step, the lr scheduler SequentialLR set the learning rates"
    ):
        replay_stage(st, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=_mse)
    # stepping a scheduler for META and putting it back leaves it as it was, OneCycleLR's momentum included
    for make in (
        lambda o: seq(o, lambda o2: sched_mod.CosineAnnealingLR(o2, 5)),
        lambda o: sched_mod.OneCycleLR(o, max_lr=0.1, total_steps=10),
        lambda o: sched_mod.ChainedScheduler(
            [sched_mod.ExponentialLR(o, 0.9), sched_mod.LambdaLR(o, lambda e: 0.9**e)]
        ),
    ):
        a_opt, b_opt = (torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.05, momentum=0.9) for _ in range(2))
        a, b = make(a_opt), make(b_opt)
        probe = SwiftlogClient(
            ClientConfig(
                run_id="probe", stage=0, num_stages=1, store_root=str(tmp_path / "probe"), seed=9, enabled=False
            )
        )
        probe.track_lr_scheduler(a)
        for _ in range(4):
            nxt = probe._sched_next()
            a_opt.step(), b_opt.step()
            a.step(), b.step()
            assert nxt == [g["lr"] for g in a_opt.param_groups] == [g["lr"] for g in b_opt.param_groups]
            assert [g["momentum"] for g in a_opt.param_groups] == [g["momentum"] for g in b_opt.param_groups]
            assert repr(a.state_dict()) == repr(b.state_dict())
        probe.close()
    # parts swapped: torch's own load fails; named, not a KeyError
    c_opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.05)
    chained = sched_mod.ChainedScheduler(
        [sched_mod.ExponentialLR(c_opt, 0.9), sched_mod.LambdaLR(c_opt, lambda e: 1.0)]
    )
    swapped = sched_mod.ChainedScheduler(
        [sched_mod.LambdaLR(c_opt, lambda e: 1.0), sched_mod.ExponentialLR(c_opt, 0.9)]
    )
    bad = trainer_client.checkpoint.Checkpoint(
        "r", 0, 1, 0, 1, torch.nn.Linear(2, 2).state_dict(), lr_scheduler=chained.state_dict()
    )
    with pytest.raises(CheckpointError, match=r"lr scheduler"):
        bad.apply(torch.nn.Linear(2, 2), None, swapped)


def test_a_scheduler_that_cycles_other_hyperparameters_replays_exactly(tmp_path, single_rank_group):
    _, report, uri, live = _run_with_scheduler(tmp_path, "cycle", None, lambda it, opt: None)
    assert report.ok and report.logging_faults == []
    rep, fresh = _replay_with_scheduler(tmp_path, "cycle", uri, 4)
    assert rep.ok and _same_state(fresh, live)


class _FunctionalBatchNormInRecompute(torch.nn.Module):
    """Running statistics updated by ``F.batch_norm`` on the module's own buffers (the kernel leaves
    their version counters alone), inside activation recomputation: updated in the backward too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)
        self.register_buffer("rm", torch.zeros(5))
        self.register_buffer("rv", torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(h: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.batch_norm(self.lin(h), self.rm, self.rv, training=True, momentum=0.1)

        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


def test_buffers_a_backward_changes_without_a_version_bump_are_caught_outside_the_live_order(
    tmp_path, single_rank_group
):
    """A replay that cannot follow the live order (a parallel share, a group with other orders:
    here a ``select`` hook, as parallel replay uses) compared only the buffers' version counters
    around each backward; F.batch_norm updates a module's statistics without touching them, and
    the replay said "verified" with other statistics. In its first iteration it now compares the
    bytes too and stops with ReplayOrderError. Alone, the live order (GPipe: F0 F1 B0 B1) is exact."""
    from replay import ReplayHooks, ReplayOrderError

    client = SwiftlogClient(
        ClientConfig(run_id="fbn", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _FunctionalBatchNormInRecompute()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    uri = _train_one_stage(client, mod, opt, iters=3, schedule="gpipe")
    assert client.close().ok

    def replay_it(**kw: Any) -> tuple[Any, torch.nn.Module]:
        fresh = _FunctionalBatchNormInRecompute()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        rep = replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(LogStore.open(tmp_path / "store", "fbn")),
            num_stages=1,
            stop_iteration=3,
            loss_fn=_mse,
            **kw,
        )
        return rep, fresh

    rep, fresh = replay_it()
    assert rep.ok and torch.equal(fresh.rm, mod.rm) and torch.equal(fresh.rv, mod.rv) and _same_state(fresh, mod)
    with pytest.raises(
        ReplayOrderError,
        match=r"iteration 1 micro-batch 0: the backward changed module buffers \(stage 0 rm, stage 0 rv\)",
    ):
        replay_it(hooks=ReplayHooks(select=lambda it, order: order))


def _plain_step(
    client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
) -> None:
    client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))


class _Huber(torch.nn.Module):
    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.huber_loss(out, target)


def test_importable_name_names_only_what_another_process_can_import():
    """META names the schedule's loss function only when the name imports back to the same object."""
    assert importable_name(_mse) == f"{_mse.__module__}:_mse"
    assert importable_name(torch.nn.functional.mse_loss) == "torch.nn.functional:mse_loss"
    assert importable_name(_Huber.forward) == f"{_Huber.__module__}:_Huber.forward"
    for unnamed in (
        lambda o, t: _mse(o, t),
        _Huber(),
        __import__("functools").partial(_mse),
        _Huber().forward,
        print.__self__,
    ):
        assert importable_name(unnamed) is None, unnamed


def test_a_replay_of_the_last_stage_imports_the_loss_function_meta_names(tmp_path, single_rank_group):
    """No loss function given: the replay uses the live schedule's, by the name META recorded."""
    mod, _, logs, fresh, _, rep = _single_rank_run(
        tmp_path, "named", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _plain_step, replay_loss=None
    )
    meta = trainer_client.decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    assert meta["loss"] == f"{_mse.__module__}:_mse"
    assert rep.ok and _same_state(mod, fresh)  # (one stage: no sends to verify; the state is the check)


def test_a_loss_function_meta_cannot_name_must_be_passed_to_the_replay(tmp_path, single_rank_group):
    """A callable instance has no importable name: META says what it was, and the replay asks for it
    instead of replaying with some other loss."""
    with pytest.raises(
        ReplayError,
        match=r"replaying the last stage \(0\) needs its loss function: the live schedule's loss_fn \(_Huber\(\)\) has no importable name",
    ) as e:
        _single_rank_run(
            tmp_path,
            "unnamed",
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            _plain_step,
            loss_fn=_Huber(),
            replay_loss=None,
        )
    assert "--loss module:attr" in (e.value.hint or "")
    meta = trainer_client.decode_meta(
        LogStore.open(tmp_path / "store", "unnamed").get(RecordKey(Channel.meta(0), 2, 0))
    )
    assert meta["loss"] is None and meta["loss_repr"] == "_Huber()"
