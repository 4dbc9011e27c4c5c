"""Plain torchrun (``--max-restarts 1``) with a killed rank: survivor snapshots make the restart cheap.

Real torchrun, real workers (the example GPT pipeline through ``torchrun_resilient``), rank 1
SIGKILLed in a backward of iteration 3 of the first attempt. With ``--snapshot-dir`` the
survivors save their state when the failure reaches them and torchrun stops them; in the
restart they resume from it and only rank 1 replays from its checkpoint. Without, every rank
restarts from the newest common checkpoint. Both end bit-exact against the failure-free run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from replay.agent.local import torchrun_command
from server.testing import subprocess_env
from tests._recovery_helpers import Reference, assert_same_as, pipeline_args


def torchrun(base: Path, extra: list[str]) -> subprocess.CompletedProcess[str]:
    args = [
        *pipeline_args(base, "1f1b", ("--data-source",)),
        "--kill-rank",
        "1",
        "--kill-at",
        "3,1,backward",
        *extra,
    ]
    cmd = torchrun_command(base, "rec", args)
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "rollback"])
def test_torchrun_restart(tmp_path: Path, references: Any, snapshots: bool) -> None:
    snap = tmp_path / "shm"  # node-local in production (/dev/shm); any directory that outlives the workers
    r = torchrun(tmp_path, ["--snapshot-dir", str(snap)] if snapshots else [])
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    res = Reference({k: torch.load(tmp_path / "out" / f"stage{k}.pt", weights_only=False) for k in range(4)})
    assert_same_as(res, references.get("1f1b", extra=("--data-source",)))
    starts = {k: (res.results[k]["start"], (res.results[k]["recovered"] or {}).get("path")) for k in range(4)}
    if snapshots:
        # the survivors resumed where they stood; rank 1 replayed from its checkpoint at 2
        assert starts == {0: (3, "snapshot"), 1: (3, "replay"), 2: (3, "snapshot"), 3: (3, "snapshot")}, starts
        assert not list((snap / "rec").glob("*.pt"))  # used snapshots are removed
    else:
        assert {s for s, _ in starts.values()} == {2}, starts  # everyone from the checkpoint at 2


def _snap(directory: Path, rank: int, iteration: int, prefix: str = "swiftlog/rec") -> None:
    from trainer_client.snapshots import save_snapshot

    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    save_snapshot(
        directory,
        run_id="rec",
        rank=rank,
        stage=rank,
        replica=0,
        iteration=iteration,
        generation=0,
        commit_prefix=prefix,
        module=m,
        optimizer=opt,
        lr_scheduler=None,
    )


@pytest.mark.parametrize(
    ("iterations", "prefix", "why"),
    [
        ((3, 4), "swiftlog/rec", "the snapshots disagree"),
        ((3, 3), "swiftlog/rec/restart5", "no survivor left a snapshot"),  # an older attempt's: not used
    ],
    ids=["disagree", "stale"],
)
def test_snapshots_that_cannot_be_used_roll_every_rank_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, iterations: tuple[int, int], prefix: str, why: str
) -> None:
    import threading

    from replay import recover_on_restart
    from trainer_client import loopback_store

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for rank, it in enumerate(iterations):
        _snap(tmp_path / "snap", rank, it, prefix)
    host = loopback_store()
    out: dict[int, Any] = {}

    def rank_main(stage: int) -> None:
        import datetime

        store = torch.distributed.TCPStore("127.0.0.1", host.port, is_master=False)
        out[stage] = recover_on_restart(
            store,
            run_id="rec",
            stage=stage,
            num_stages=2,
            checkpoint_url=f"file://{tmp_path / 'ckpt'}",
            snapshot_dir=str(tmp_path / "snap"),
            timeout=datetime.timedelta(seconds=30),
        )

    threads = [threading.Thread(target=rank_main, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for d in out.values():
        assert d.how == "rollback" and d.start is None and why in d.why, d  # no common checkpoint: from scratch
    assert len(out) == 2
    assert os.path.exists(tmp_path / "snap" / "rec" / "rank00000.pt")  # unused: kept
