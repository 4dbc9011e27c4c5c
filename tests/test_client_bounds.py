"""The training client while its log store hangs: memory stays bounded, the training thread is never
blocked for longer than configured, and every record it could not keep is a recorded gap.

A hung store is a real LogStore whose hot tier does not accept writes: the test holds the hot
tier's write lock, so the writer thread blocks in its first write (as on a stuck disk) until the
test lets go."""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from logstore import Channel, LogStore, RecordKey
from logstore.errors import ConfigError
from trainer_client import ClientConfig, SwiftlogClient
from trainer_client.config import WriterConfig
from trainer_client.digest import digest_from_record, tensor_digest
from trainer_client.writer import AsyncLogWriter

MiB = 1 << 20


@contextlib.contextmanager
def _hung(store: LogStore) -> Iterator[None]:
    """While open, ``store`` accepts no write: this thread holds the lock every hot-tier write takes."""
    lock = store.hot._wlock
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def store(tmp_path):
    s = LogStore.open(tmp_path / "store", "w", writer="stage1")
    yield s
    s.close()


def test_digest_work_stays_bounded_while_the_store_hangs_and_drops_become_gaps(store):
    """A stage keeps training while its store hangs (overflow="gap", a 4 MiB bound). Each micro-batch
    receives into a fresh buffer (as the V-schedules hand a stage its input) and sends 1 MiB. Memory
    stays near the bound, although 40 steps receive 320 MiB: a buffer is let go once hashed, and
    beyond the bound the training thread hashes it on the spot. Every dropped send is a gap, and no
    digest is lost."""
    w = AsyncLogWriter(store, WriterConfig(max_queue_bytes=4 * MiB, overflow="gap", encode_threads=1))
    send, digest = Channel.activation(1), Channel.digest(0, 1)
    want: dict[tuple[int, int], int] = {}
    steps, n_mb = 40, 8
    with _hung(store):
        before = _rss_bytes()
        for it in range(steps):
            w.settle_digests()  # the schedule's step begins: last step's buffers are hashed
            for mb in range(n_mb):
                recv = torch.randn(MiB // 4)
                want[(it, mb)] = tensor_digest(recv)
                w.submit_digests(digest, it, mb, [recv], defer=True)
                w.submit(send, it, mb, [torch.randn(MiB // 4)])
            w.kick()  # the commit
        w.settle_digests()
        grown = _rss_bytes() - before
        held = w.stats()
    assert grown < 64 * MiB, f"memory grew {grown / MiB:.0f} MiB while the store hung"
    assert held.digest_bytes == 0 and held.digests_hashed_at_bound > 0
    assert held.queue_bytes <= 4 * MiB and held.overflow_drops > 0
    assert w.drain(60)
    st = w.stats()
    assert st.faults_by_kind == {"overflow": st.overflow_drops} and st.gaps_recorded == st.overflow_drops
    assert st.records_written == steps * n_mb - st.overflow_drops + steps * n_mb  # every send kept, every digest
    gaps = {(g["channel"], g["iteration"], g["micro_batch"]) for g in store.gaps()}
    assert len(gaps) == st.overflow_drops and {c for c, _, _ in gaps} == {send.name}
    kept = {(k.iteration, k.micro_batch) for k in store.keys(send)}
    for it, mb in ((i, m) for i in range(steps) for m in range(n_mb)):
        assert ((it, mb) in kept) != ((send.name, it, mb) in gaps)
        assert digest_from_record(store.get(RecordKey(digest, it, mb))) == want[(it, mb)]
    assert w.close(30)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `pytest -m cuda` on a GPU machine)")
def test_cuda_digest_copies_are_bounded_while_the_store_hangs_and_beyond_the_bound_are_gaps(store):
    """On a GPU a received buffer is copied to pinned memory to be hashed by the pool. While the store
    hangs those copies stay within the bound; the digests beyond it are recorded gaps."""
    w = AsyncLogWriter(store, WriterConfig(max_queue_bytes=MiB, overflow="gap", encode_threads=1))
    digest, n = Channel.digest(0, 1), 40
    want = {}
    with _hung(store):
        for mb in range(n):
            recv = torch.randn(MiB // 16, device="cuda")  # 256 KiB
            want[mb] = tensor_digest(recv.cpu())
            w.submit_digests(digest, 0, mb, [recv], defer=True)
        held = w.stats()
    assert held.digest_peak_bytes <= MiB and held.digest_gaps > 0
    assert held.pinned_bytes <= 2 * MiB  # at most the bound in flight and the bound kept free
    assert w.drain(60)
    st = w.stats()
    gaps = {g["micro_batch"] for g in store.gaps() if g["channel"] == digest.name}
    kept = {k.micro_batch for k in store.keys(digest)}
    assert len(gaps) == st.digest_gaps and gaps | kept == set(range(n)) and not gaps & kept
    assert all(digest_from_record(store.get(RecordKey(digest, 0, mb))) == want[mb] for mb in kept)
    assert st.digest_bytes == 0 and st.faults_by_kind == {"overflow": st.digest_gaps}
    assert w.close(30)


def test_overflow_wait_gives_up_after_its_limit_records_a_gap_and_says_so(tmp_path):
    """overflow="wait" (the default) on a hung store: a send that does not fit waits
    ``overflow_wait``, then is dropped as a gap with an "overflow_timeout" fault; later sends do not
    wait again until the writer frees memory, and once the store is back they are written again."""
    cfg = ClientConfig(
        run_id="r",
        stage=0,
        num_stages=2,
        store_root=str(tmp_path),
        writer=WriterConfig(max_queue_bytes=1000, overflow_wait=datetime.timedelta(seconds=0.5)),
    )
    client = SwiftlogClient(cfg)
    act = Channel.activation(0)
    with _hung(client.store):
        assert client.log_send(torch.zeros(200), 1, "activation", 0, 0)  # 800 bytes: admitted, the writer hangs on it
        client.writer.kick()
        result: list[bool] = []
        t = threading.Thread(
            target=lambda: result.append(client.log_send(torch.zeros(200), 1, "activation", 0, 1)), daemon=True
        )
        t.start()
        t.join(60)
        assert not t.is_alive(), "the training thread is still blocked on the queue bound"
        assert result == [False]
        assert [client.log_send(torch.zeros(200), 1, "activation", 0, mb) for mb in (2, 3)] == [False, False]
        w = client.stats()["writer"]
        assert w["overflow_waits"] == 1 and w["overflow_timeouts"] == 1 and w["overflow_wait_s"] >= 0.5
        assert w["overflow_drops"] == 3 and w["faults_by_kind"] == {"overflow_timeout": 1, "overflow": 2}
        said = [f for f in client.writer.recent_faults() if f.kind == "overflow_timeout"]
        assert len(said) == 1 and said[0].micro_batch == 1 and "overflow_wait" in said[0].message
    assert client.writer.drain(60)
    assert client.log_send(torch.zeros(200), 1, "activation", 1, 0)  # the store is back: waiting works again
    assert client.writer.drain(60)
    assert sorted(g["micro_batch"] for g in client.store.gaps()) == [1, 2, 3]
    assert {(k.iteration, k.micro_batch) for k in client.store.keys(act)} == {(0, 0), (1, 0)}
    client.close()


def test_overflow_wait_must_be_a_positive_duration(tmp_path):
    base = {"run_id": "r", "stage": 0, "num_stages": 2, "store_root": str(tmp_path)}
    assert ClientConfig(**base).writer.overflow_wait == datetime.timedelta(seconds=10)
    for bad in (None, 5, datetime.timedelta(0)):
        with pytest.raises(ConfigError, match="overflow_wait"):
            ClientConfig(**base, writer=WriterConfig(overflow_wait=bad))
