"""Full disk: the store refuses new records with StoreFullError, keeps every acknowledged one,
and works again once GC frees space. Two real mechanisms: a small tmpfs (true ENOSPC; needs
mount permission, as root in CI) and RLIMIT_FSIZE in a child process (EFBIG; works anywhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from logstore import Channel, LogStore, RecordKey
from logstore.errors import StoreFullError

ACT = Channel.activation(0)


def _t(it: int, mb: int) -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(it * 10 + mb))  # 64 KiB, incompressible-ish


def _can_mount_tmpfs(where: Path) -> tuple[bool, str]:
    if shutil.which("mount") is None:
        return False, "no mount command"
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"mount -t tmpfs not permitted here: {r.stderr.strip()}"
    subprocess.run(["umount", str(where)], check=False)
    return True, ""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs mounted for the test (real ENOSPC)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    ok, why = _can_mount_tmpfs(mnt)
    if not ok:
        pytest.skip(why + " (the RLIMIT_FSIZE test still covers a full disk)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_on_tmpfs_then_gc_frees_space(small_disk: Path, tmp_path: Path) -> None:
    s = LogStore.open(small_disk, "run1", writer="stage0", cold_url=(tmp_path / "cold").as_uri(), codec="raw", segment_iters=1)
    acked: list[tuple[int, int]] = []
    with pytest.raises(StoreFullError, match="disk full"):
        for it in range(10_000):
            for mb in range(2):
                s.put(RecordKey(ACT, it, mb), _t(it, mb))
                acked.append((it, mb))
    assert len(acked) > 20
    for it, mb in acked:  # nothing acknowledged was lost
        assert torch.equal(s.get(RecordKey(ACT, it, mb)), _t(it, mb))
    # a checkpoint of the receiver + GC frees the disk, and logging resumes
    last = acked[-1][0]
    s.flush()
    s.register_checkpoint(1, last)
    rep = s.gc()
    assert rep.hot_segments > 0
    s.put(RecordKey(ACT, last + 1, 0), _t(last + 1, 0))
    assert torch.equal(s.get(RecordKey(ACT, last + 1, 0)), _t(last + 1, 0))
    assert s.verify().ok
    s.close()


def test_file_size_limit_is_reported_as_store_full(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from logstore import LogStore, Channel, RecordKey
        from logstore.errors import StoreFullError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        s = LogStore.open({str(tmp_path / 'node')!r}, "run1", writer="stage0", codec="raw", segment_max_bytes=64 << 20, segment_iters=100_000)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        n = 0
        try:
            for it in range(1000):
                s.put(RecordKey(Channel.activation(0), it, 0), torch.full((64, 256), float(it)))
                n += 1
        except StoreFullError as e:
            print("FULL", n, e)
        for it in range(n):
            assert torch.equal(s.get(RecordKey(Channel.activation(0), it, 0)), torch.full((64, 256), float(it)))
        print("INTACT", n)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert "FULL" in out.stdout, out.stderr
    n = int(out.stdout.split()[1])
    assert 20 < n < 40
    assert f"INTACT {n}" in out.stdout
