"""Eviction and the cold copy: a writer drops its hot copy of a segment only once the cold tier
holds exactly its bytes, as their commit marker says. Run over every cold tier (``cold_env``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from logstore import Channel, LogStore, RecordKey
from logstore.hot import EVICTED, UPLOADED

ACT = Channel.activation(0)


def _t(it: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(it))


def _replace(cold_env, name: str, data: bytes) -> None:
    """Write ``data`` under ``name`` as another uploader does: a PUT on s3, a rename over it on file://."""
    if cold_env.root is None:
        cold_env.raw_put(name, data)
        return
    tmp = cold_env.root / f"{name}.other"
    tmp.write_bytes(data)
    os.replace(tmp, cold_env.root / name)


def test_a_segment_whose_cold_copy_is_not_confirmed_is_never_evicted(tmp_path: Path, cold_env, caplog) -> None:
    """M6: a writer with hot_max_bytes evicted a segment right after its upload returned, even when
    another uploader's bytes had replaced the object under its marker (two uploaders of one name;
    a store that does not fence writes lets the second through): its only copy was gone. Eviction
    now confirms the committed copy first; this one stays hot, readable, and is named."""
    s = LogStore.open(
        tmp_path,
        "run1",
        writer="stage0",
        cold_url=cold_env.url,
        cold_options=cold_env.storage_options,
        segment_iters=2,
        hot_max_bytes=1,
    )
    real = s.cold.put_segment
    replaced: list[str] = []

    def raced(name: str, source: str, *, meta: dict) -> object:
        info = real(name, source, meta=meta)
        if not replaced:  # the other uploader's object lands after this commit
            _replace(cold_env, name, bytes(reversed(Path(source).read_bytes())))
            replaced.append(name)
        return info

    s.cold.put_segment = raced  # type: ignore[method-assign]
    for it in range(6):
        s.put(RecordKey(ACT, it, 0), _t(it))
    with caplog.at_level(logging.WARNING, logger="logstore._shipper"):
        s.flush()
    states = {m.cold_name: m.state for m in s.hot.segments()}
    assert states[replaced[0]] == UPLOADED and EVICTED in states.values(), states  # the others are confirmed and go
    assert "not evicted" in caplog.text and replaced[0] in caplog.text
    for it in range(6):
        assert torch.equal(s.get(RecordKey(ACT, it, 0)), _t(it))
    s.close()


def test_a_store_that_ignores_conditional_writes_is_named(tmp_path: Path, cold_env, caplog) -> None:
    """M6: where the object store does not refuse a second conditional write, two uploaders of one
    name are not fenced: stats() and the log say so (a real backend here fences; one that ignores
    the condition, rclone's or s3rver's, is not runnable here and is stood in for by dropping it)."""
    opts = {"cold_url": cold_env.url, "cold_options": cold_env.storage_options, "segment_iters": 2}
    with LogStore.open(tmp_path / "a", "run1", writer="stage0", **opts) as s:
        s.put(RecordKey(ACT, 0, 0), _t(0))
        s.flush()
        assert s.stats()["cold"]["fenced_writes"] is True
    with LogStore.open(tmp_path / "b", "run1", writer="stage0", upload=False, **opts) as s:
        real = s.cold._backend.put_bytes
        s.cold._backend.put_bytes = lambda key, data, *, exclusive=False: real(key, data)
        s.put(RecordKey(ACT, 0, 0), _t(0))
        with caplog.at_level(logging.WARNING):
            s.flush()
        assert s.stats()["cold"]["fenced_writes"] is False
        assert "does not refuse a second conditional write" in caplog.text
