"""Helpers of the in-place recovery tests: one pipeline run with injected failures, compared bitwise.

Every run is real: a TCPStore hosted in the test process, one process per stage (gloo on CPU,
the example GPT with dropout), each stage's log store in its own directory ("node"), SIGKILL
injected by the training script, the replacement started by :mod:`replay.launcher`.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from replay.launcher import KillSpec, RecoveryRun, run_with_failures, states_equal

__all__ = ["CKPTS", "ITERS", "NUM_STAGES", "PG_TIMEOUT_S", "assert_same_as", "pipeline_args", "run"]

ITERS = 6
CKPTS = "2,4"
NUM_STAGES = 4
PG_TIMEOUT_S = 60  # the stages' process-group and rejoin timeouts


def pipeline_args(base: Path, schedule: str, extra: Sequence[str] = ()) -> list[str]:
    return ["--schedule", schedule, "--iters", str(ITERS), "--ckpt-at", CKPTS, "--seed", "1234", "--segment-iters", "2",
            "--cold-url", f"file://{base / 'cold'}", "--pg-timeout", str(PG_TIMEOUT_S),
            "--rejoin-timeout", str(PG_TIMEOUT_S), *extra]  # fmt: skip


def run(base: Path, schedule: str, kills: Sequence[KillSpec] = (), *, mode: str = "swift", extra: Sequence[str] = ("--data-source",),
        replay_workers: int = 1, timeout_s: float = 150.0, groups: Sequence[int] | None = None) -> RecoveryRun:  # fmt: skip
    """One pipeline run under ``base`` (recreated); asserts that it finished."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    r = run_with_failures(pipeline_args(base, schedule, extra), run_id="rec", base_dir=str(base), checkpoint_url=f"file://{base / 'ckpt'}",
                          kills=kills, mode=mode, num_stages=NUM_STAGES, replay_workers=replay_workers, timeout_s=timeout_s, groups=groups)  # fmt: skip
    assert r.ok, r.describe()
    return r


def assert_same_as(run_: RecoveryRun, reference: RecoveryRun) -> None:
    """Every stage's final parameters, AdamW state and scheduler equal the reference bitwise."""
    diffs = {
        k: states_equal(run_.results[k], reference.results[k])
        for k in range(NUM_STAGES)
    }
    assert not any(diffs.values()), {k: v[:5] for k, v in diffs.items() if v}
