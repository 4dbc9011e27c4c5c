"""Checkpoints of the trainer client: atomic files that never alias the model, registration
(also once a dead object store is back), retention (``CheckpointConfig.keep``) and a close that
leaves no garbage in the cold tier."""

from __future__ import annotations

import os
import time

import pytest
import torch

from logstore import LogStore
from logstore.errors import ConfigError
from trainer_client import (
    CheckpointError,
    ClientConfig,
    SwiftlogClient,
    load_checkpoint,
    save_checkpoint,
)
from trainer_client.config import CheckpointConfig, StorageConfig


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
        match=r"(?s)checkpoint file://\S+s0.pt of stage 0 \(iteration 1\) does not fit the model Linear: "
        r".*size mismatch for weight",
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
            ClientConfig(
                run_id="tail",
                stage=k,
                num_stages=2,
                store_root=str(root),
                cold_url=cold,
                storage=StorageConfig(segment_iters=4),
            )
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
            storage=StorageConfig(cold_options=moto_server.storage_options),
            checkpoints=CheckpointConfig(url=str(tmp_path / "ckpt")),
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

    with pytest.raises(ConfigError, match=r"CheckpointConfig\.keep must be None or an int >= 2"):
        ClientConfig(
            run_id="keep",
            stage=0,
            num_stages=2,
            store_root=str(tmp_path / "s"),
            checkpoints=CheckpointConfig(keep=1),
        )
    cold = f"file://{tmp_path / 'cold'}"
    client = SwiftlogClient(
        ClientConfig(
            run_id="keep",
            stage=1,
            num_stages=2,
            store_root=str(tmp_path / "store"),
            cold_url=cold,
            checkpoints=CheckpointConfig(keep=2),
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
