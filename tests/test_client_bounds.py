"""The training client while its log store hangs: the training thread is never blocked for longer
than configured, and every record it could not keep is a recorded gap.

A hung store is a real LogStore whose hot tier does not accept writes: the test holds the hot
tier's write lock, so the writer thread blocks in its first write (as on a stuck disk) until the
test lets go."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator

import pytest
import torch

from logstore import Channel, LogStore
from logstore.errors import ConfigError
from trainer_client import ClientConfig, SwiftlogClient


@contextlib.contextmanager
def _hung(store: LogStore) -> Iterator[None]:
    """While open, ``store`` accepts no write: this thread holds the lock every hot-tier write takes."""
    lock = store.hot._wlock
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def test_overflow_wait_gives_up_after_its_limit_records_a_gap_and_says_so(tmp_path):
    """overflow="wait" (the default) on a hung store: a send that does not fit waits
    ``overflow_wait``, then is dropped as a gap with an "overflow_timeout" fault; later sends do not
    wait again until the writer frees memory, and once the store is back they are written again."""
    cfg = ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path), max_queue_bytes=1000,
                       overflow_wait=datetime.timedelta(seconds=0.5))  # fmt: skip
    client = SwiftlogClient(cfg)
    act = Channel.activation(0)
    with _hung(client.store):
        assert client.log_send(torch.zeros(200), 1, "activation", 0, 0)  # 800 bytes: admitted, the writer hangs on it
        client.writer.kick()
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(client.log_send(torch.zeros(200), 1, "activation", 0, 1)), daemon=True)
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
    assert ClientConfig(**base).overflow_wait == datetime.timedelta(seconds=10)
    for bad in (None, 5, datetime.timedelta(0)):
        with pytest.raises(ConfigError, match="overflow_wait"):
            ClientConfig(**base, overflow_wait=bad)
