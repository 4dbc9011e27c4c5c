"""Checkpoints through torch.distributed.checkpoint (DCP): written by the client (sync and async),
registered from one's own DCP code, listed and loaded only once complete, retired with their
directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from logstore import LogStore
from replay.checkpoints import newest_common
from trainer_client import CheckpointError, ClientConfig, SwiftlogClient, load_checkpoint
from trainer_client.checkpoint import read_identity
from trainer_client.config import CheckpointConfig
from trainer_client.dcp_checkpoint import dcp_state


def _objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    o = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01)
    return m, o, torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)


def _train(m: torch.nn.Module, o: torch.optim.Optimizer, s: Any, steps: int) -> None:
    for i in range(steps):
        m(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).sum().backward()
        o.step()
        s.step()
        o.zero_grad()


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    (m1, o1, s1), (m2, o2, s2) = a, b
    ms = all(torch.equal(x, y) for x, y in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True))
    os_ = all(
        torch.equal(o1.state[p][k], o2.state[q][k])
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True)
        for k in o1.state[p]
    )
    return ms and os_ and s1.state_dict() == s2.state_dict() and o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


def _registered(tmp_path: Path) -> list[Any]:
    with LogStore.open(tmp_path / "root", "r") as st:
        return st.checkpoints()


def _client(tmp_path: Path, **ck: Any) -> SwiftlogClient:
    cfg = ClientConfig(
        run_id="r",
        stage=0,
        num_stages=1,
        store_root=str(tmp_path / "root"),
        checkpoints=CheckpointConfig(url=str(tmp_path / "ck"), format="dcp", **ck),
    )
    return SwiftlogClient(cfg)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_dcp_checkpoint_is_registered_once_complete_and_loads_bit_for_bit(tmp_path: Path, asynchronous: bool) -> None:
    live = _objects(0)
    _train(*live, steps=3)
    client = _client(tmp_path, async_save=asynchronous)
    uri = client.checkpoint(3, *live)
    assert uri.endswith("/stage00000/it000000000003.dcp.json")
    report = client.close()
    assert report.ok, report
    assert os.path.exists(tmp_path / "ck" / "stage00000" / "step-000000000003" / ".metadata")
    assert [c.iteration for c in _registered(tmp_path)] == [3]
    found = newest_common(str(tmp_path / "ck"), [0])
    assert found is not None and found[0] == 3 and found[1][0].endswith(".dcp.json")
    ck = load_checkpoint(found[1][0])
    assert (ck.run_id, ck.stage, ck.iteration, ck.dcp is not None) == ("r", 0, 3, True)
    assert read_identity(found[1][0]).iteration == 3
    fresh = _objects(1)
    ck.apply(*fresh)
    assert _same(live, fresh)
    _train(*live, steps=2)
    _train(*fresh, steps=2)
    assert _same(live, fresh)  # the optimizer's state and the scheduler's came back whole
    with pytest.raises(CheckpointError, match="was saved from a AdamW optimizer, not the SGD"):
        m = _objects(2)[0]
        ck.apply(m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_a_dcp_save_that_never_finished_is_never_listed_nor_registered(tmp_path: Path, monkeypatch) -> None:
    """DCP writes ``.metadata`` last: a save that died before it leaves shards but no pointer."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def die(self: Any, *a: Any, **kw: Any) -> None:
        raise OSError("killed before the metadata")

    monkeypatch.setattr(FileSystemWriter, "finish", die)
    live = _objects(0)
    client = _client(tmp_path, async_save=True)
    client.checkpoint(1, *live)  # staged; the write fails on the save's thread
    report = client.close()
    assert any(
        f.kind == "checkpoint_write" and "killed before the metadata" in f.message for f in report.logging_faults
    )
    assert not (tmp_path / "ck" / "stage00000" / "it000000000001.dcp.json").exists()
    assert newest_common(str(tmp_path / "ck"), [0]) is None
    assert _registered(tmp_path) == []


def test_ones_own_dcp_checkpoint_is_registered_and_never_deleted_by_retention(tmp_path: Path) -> None:
    """A torchtitan-style manager's directory (keys model / optimizer / lr_scheduler): registered
    with its pointer; retention withdraws it but leaves the directory, which the client did not
    write, and deletes the directories of the client's own DCP checkpoints."""
    live = _objects(0)
    own = tmp_path / "mine" / "step-2"
    dcp.save(dcp_state(*live), checkpoint_id=str(own), no_dist=True)
    with pytest.raises(CheckpointError, match="not a complete DCP checkpoint"):
        _client(tmp_path / "x").register_checkpoint(2, str(tmp_path / "mine" / "nothing"))
    client = _client(tmp_path, keep=2)
    uri = client.register_checkpoint(2, str(own), live[1], live[2])
    ck = load_checkpoint(uri)
    fresh = _objects(5)
    ck.apply(*fresh)
    assert _same(live, fresh)
    client.checkpoint(4, *live)
    client.checkpoint(6, *live)
    client.checkpoint(8, *live)
    client.close()
    left = sorted(p.name for p in (tmp_path / "ck" / "stage00000").iterdir())
    assert left == ["it000000000006.dcp.json", "it000000000008.dcp.json", "step-000000000006", "step-000000000008"]
    assert (own / ".metadata").exists()  # not ours: withdrawn, kept
    assert [c.iteration for c in _registered(tmp_path)] == [6, 8]


def test_a_torch_format_is_still_the_default_and_async_needs_dcp() -> None:
    from logstore.errors import ConfigError

    assert CheckpointConfig().format == "torch"
    with pytest.raises(ConfigError, match="async_save needs format='dcp'"):
        CheckpointConfig(async_save=True)
    with pytest.raises(ConfigError, match="format must be 'torch' or 'dcp'"):
        CheckpointConfig(format="safetensors")
