"""The capture path on its own: seeds, digests, the asynchronous writer (order, encode pool,
copies, deferred digests, the memory bound, faults) and the explicit logging API of hand-written
runtimes."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore import Channel, LogStore, RecordKey, codec
from trainer_client import (
    ClientConfig,
    SwiftlogClient,
    derive_seed,
    seed_micro_batch,
)
from trainer_client.config import WriterConfig
from trainer_client.digest import digest_from_record, digest_record, tensor_digest
from trainer_client.writer import AsyncLogWriter, auto_encode_threads


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


@pytest.fixture
def store(tmp_path):
    s = LogStore.open(tmp_path / "store", "w", writer="stage0")
    yield s
    s.close()


def test_writer_writes_in_order_and_markers_see_everything_before(store):
    w = AsyncLogWriter(store, WriterConfig(encode_threads=2, batch_records=3))
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
    w = AsyncLogWriter(store, WriterConfig(encode_threads=None))
    assert w.stats().encode_threads == 0  # nothing captured yet: the device is not known
    assert w.submit(Channel.activation(0), 0, 0, [torch.randn(16)]) and w.drain(30)
    # a CPU stage: its compute needs the cores
    assert w.stats().encode_threads == 1 == auto_encode_threads(on_gpu=False)
    assert 1 <= auto_encode_threads(on_gpu=True) <= 4
    assert store.get(RecordKey(Channel.activation(0), 0, 0)).shape == (16,)
    assert w.close(10)
    fixed = AsyncLogWriter(store, WriterConfig(encode_threads=3))
    assert fixed.stats().encode_threads == 3 and fixed.close(10)


def test_writer_copy_protects_reused_buffers_and_digests_hash_now(store):
    w = AsyncLogWriter(store, WriterConfig(encode_threads=0))
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
    w = AsyncLogWriter(store, WriterConfig(encode_threads=1))
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

    from trainer_client.stage import received_buffers

    a, b = torch.randn(2, 3), torch.randn(4)
    if "is_root_arg" in inspect.signature(torch_stage._RecvInfo).parameters:  # the installed torch's own classes
        infos = (
            torch_stage._RecvInfo("x", None, None, None, is_root_arg=True),
            torch_stage._RecvInfo("h", 0, a, None),
            torch_stage._RecvInfo("g", 0, None, None),
        )
    else:
        infos = (torch_stage._RootArgPlaceholder(a), torch_stage._RecvInfo("h", 0, a))
    assert received_buffers(infos) == [a]

    class OldRecvInfo:  # torch 2.11's _RecvInfo
        def __init__(self, input_name: str, source: int, buffer: torch.Tensor) -> None:
            self.input_name, self.source, self.buffer = input_name, source, buffer

    class OldRootArgPlaceholder:  # torch 2.11's placeholder of a model input
        def __init__(self, tensor: torch.Tensor) -> None:
            self.meta = tensor.to("meta")

    got = received_buffers((OldRootArgPlaceholder(a), OldRecvInfo("h", 0, a), OldRecvInfo("k", 0, b)))
    assert len(got) == 2 and got[0] is a and got[1] is b


def test_overflow_gap_drops_and_records_gaps_without_blocking(store):
    w = AsyncLogWriter(store, WriterConfig(max_queue_bytes=1000, overflow="gap", encode_threads=1))
    gate = threading.Event()
    w.mark(gate.wait)
    results: list[bool] = []
    # 400 bytes each
    submits = threading.Thread(
        target=lambda: results.extend(w.submit(Channel.activation(0), 0, mb, [torch.zeros(100)]) for mb in range(5))
    )
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
    w = AsyncLogWriter(store, WriterConfig(max_queue_bytes=1000, overflow="wait", encode_threads=1))
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
    w = AsyncLogWriter(store, WriterConfig(encode_threads=1))
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
