"""The commit step over a real TCPStore: every stage applies an iteration or none does; aborts,
timeouts, a failed generation, the store gone; and the survivors' wait for the replacements."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from trainer_client import (
    CommitStoreError,
    IterationAbortedError,
)
from trainer_client.commit import CommitCoordinator, loopback_store, stored_metas


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
    # some missing: key by key
    assert stored_metas(tcp_store, "swiftlog/t", 1, range(0, 9)) == {it: doc(1, it) for it in range(3, 7)}
    # all there: one multi_get
    assert stored_metas(tcp_store, "swiftlog/t", 0, range(4, 6)) == {4: doc(0, 4), 5: doc(0, 5)}
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


def test_survivors_wake_when_every_replacement_is_ready_or_on_fallback_and_time_out_otherwise(tcp_store):
    from replay.replacement import report_fallback, report_ready
    from trainer_client.errors import RecoveryTimeoutError
    from trainer_client.recovery_keys import RecoveryKeys, wait_until_woken

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
