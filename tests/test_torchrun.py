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
import sys
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
@pytest.mark.parametrize(
    ("snapshots", "helpers"), [(True, 0), (True, 2), (False, 0)], ids=["snapshots", "snapshots-helpers", "rollback"]
)
def test_torchrun_restart(tmp_path: Path, references: Any, snapshots: bool, helpers: int) -> None:
    snap = tmp_path / "shm"  # node-local in production (/dev/shm); any directory that outlives the workers
    extra = ["--snapshot-dir", str(snap), "--replay-helpers", str(helpers)] if snapshots else []
    r = torchrun(tmp_path, extra)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    res = Reference({k: torch.load(tmp_path / "out" / f"stage{k}.pt", weights_only=False) for k in range(4)})
    assert_same_as(res, references.get("1f1b", extra=("--data-source",)))
    starts = {k: (res.results[k]["start"], (res.results[k]["recovered"] or {}).get("path")) for k in range(4)}
    if snapshots:
        # the survivors resumed where they stood; rank 1 replayed from its checkpoint at 2
        assert starts == {0: (3, "snapshot"), 1: (3, "replay"), 2: (3, "snapshot"), 3: (3, "snapshot")}, starts
        assert not list((snap / "rec").glob("*.pt"))  # used snapshots are removed
        # with helpers, survivors 0 and 2 shared rank 1's replay (SWIFT's parallel recovery)
        assert res.results[1]["recovered"]["timings"]["workers"] == helpers + 1, res.results[1]["recovered"]
    else:
        assert {s for s, _ in starts.values()} == {2}, starts  # everyone from the checkpoint at 2


def test_helpers_are_the_lowest_survivors_per_lost_rank_while_they_last() -> None:
    from replay.restart import helper_assignment

    assert helper_assignment([1], [0, 2, 3], 2) == {0: (1, 1), 2: (1, 2)}
    assert helper_assignment([1, 4], [0, 2, 3], 2) == {0: (1, 1), 2: (1, 2), 3: (4, 1)}
    assert helper_assignment([1], [0, 2], 0) == {}


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


@pytest.mark.slow
def test_sigterm_to_every_rank_saves_snapshots_and_the_restart_loses_nothing(tmp_path: Path, references: Any) -> None:
    """What torchrun does to a whole job it stops (a preemption, another node's failure): SIGTERM to
    every rank. Each takes it at its next iteration boundary, stands down, saves its snapshot at
    the same iteration and exits. The next attempt (TORCHELASTIC_RESTART_COUNT=1, the same store)
    resumes every rank from its snapshot: nothing replays, nothing rolls back, bit-exact."""
    import signal
    import time

    from replay.launcher import stage_argv
    from trainer_client import RecoveryKeys, loopback_store
    from trainer_client.mesh import MeshLayout

    host, layout, snap = loopback_store(), MeshLayout(4, 1), tmp_path / "shm"
    args = [*pipeline_args(tmp_path, "1f1b", ("--data-source",)), "--snapshot-dir", str(snap)]

    def start(attempt: int) -> list[subprocess.Popen[str]]:
        env = {**subprocess_env(), "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        procs = []
        for k in range(4):
            argv = stage_argv(
                layout, k, store_host="127.0.0.1", store_port=host.port, out=str(tmp_path / "out"), run_id="rec",
                store_root=str(tmp_path / "node"), checkpoint_url=f"file://{tmp_path / 'ckpt'}", args=args,
            )  # fmt: skip
            cmd = [sys.executable, "-m", "trainer_client.examples.train_resilient", *argv]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return procs

    first = start(0)
    keys, deadline = RecoveryKeys("rec"), time.monotonic() + 120
    applied: list[int] = []
    while max(applied, default=-1) < 2:  # the job's progress: "iteration:time:generation;" per applied iteration
        assert time.monotonic() < deadline and all(p.poll() is None for p in first)
        time.sleep(0.05)
        if host.check([keys.progress()]):
            applied = [int(e.split(":")[0]) for e in host.get(keys.progress()).decode().split(";") if e]
    for p in first:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120)[0] for p in first]
    assert all(p.returncode == 1 for p in first), outs
    assert all("RESTART" in o for o in outs), outs
    saved = {int(f.stem[4:]) for f in (snap / "rec").glob("rank*.pt")}
    assert saved == {0, 1, 2, 3}
    again = start(1)
    outs = [p.communicate(timeout=180)[0] for p in again]
    assert all(p.returncode == 0 for p in again), [o[-3000:] for o in outs]
    res = Reference({k: torch.load(tmp_path / "out" / f"stage{k}.pt", weights_only=False) for k in range(4)})
    assert_same_as(res, references.get("1f1b", extra=("--data-source",)))
    assert {res.results[k]["recovered"]["path"] for k in range(4)} == {"snapshot"}
    assert len({res.results[k]["start"] for k in range(4)}) == 1 and res.results[0]["start"] >= 3
