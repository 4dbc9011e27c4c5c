"""Helpers for the trainer-client tests: run a real 4-stage pipeline, read its logs, rebuild stages.

Pipelines run as real processes (one per stage, gloo on CPU) started from a fork server that
imported torch once, with the TCPStore hosted in the test process (outside the training ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logstore import LogStore
from replay.compare import states_equal
from replay.stage import StageState
from trainer_client import load_checkpoint
from trainer_client.examples.gpt import (
    GPTConfig,
    build_stage_module,
    make_lr_scheduler,
    make_optimizer,
)
from trainer_client.examples.launch import (
    LaunchResult,
    launch_pipeline,
    load_stage_result,
)

NUM_STAGES = 4
SEED = 1234
ITERS = 6


@dataclass
class PipelineRun:
    """A finished pipeline run: where its logs are and what every stage reported."""

    run_id: str
    root: str
    cold_url: str | None
    out: str
    launch: LaunchResult
    results: dict[int, dict[str, Any]] = field(default_factory=dict)

    def store(self, *, cold: bool = True) -> LogStore:
        """The run's store opened read-only (every writer's hot tier on the root, + cold tier)."""
        return LogStore.open(self.root, self.run_id, cold_url=self.cold_url if cold else None)

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig(**self.results[0]["gpt"])


def run_pipeline(
    base: Path,
    run_id: str,
    *,
    schedule: str,
    iters: int = ITERS,
    ckpt_at: str = "",
    cold: bool = True,
    extra: list[str] | None = None,
    per_stage: dict[int, list[str]] | None = None,
    timeout_s: float = 150.0,
) -> PipelineRun:
    """Train ``iters`` iterations of the example GPT on 4 stage processes; assert they all succeed."""
    root = str(base / "store")
    cold_url = f"file://{base / 'cold'}" if cold else None
    out = str(base / "out")
    args = [
        "--run-id",
        run_id,
        "--store-root",
        root,
        "--schedule",
        schedule,
        "--iters",
        str(iters),
        "--seed",
        str(SEED),
        "--segment-iters",
        "2",
        *(["--cold-url", cold_url] if cold_url else []),
        *(["--ckpt-at", ckpt_at] if ckpt_at else []),
        *(extra or []),
    ]
    launch = launch_pipeline(
        args, num_stages=NUM_STAGES, out_dir=out, per_stage=per_stage, timeout_s=timeout_s, method="forkserver"
    )
    assert launch.ok, launch.describe()
    run = PipelineRun(run_id, root, cold_url, out, launch)
    run.results = {k: load_stage_result(out, k) for k in range(NUM_STAGES)}
    return run


def stage_from_checkpoint(run: PipelineRun, stage: int, iteration: int) -> StageState:
    """Fresh module/optimizer/scheduler of ``stage`` loaded from the run's checkpoint at ``iteration``."""
    uri = run.results[stage]["checkpoints"][iteration]
    ck = load_checkpoint(uri)
    assert (ck.stage, ck.iteration, ck.seed) == (stage, iteration, SEED)
    mod = build_stage_module(run.gpt, stage, NUM_STAGES, seed=SEED)
    opt = make_optimizer(mod)
    sched = make_lr_scheduler(opt)
    return StageState.from_checkpoint(ck, mod, opt, sched)


def state_differences(state: StageState, result: dict[str, Any]) -> list[str]:
    """Where a stage's live objects differ bit for bit from a stage result (:func:`replay.compare.states_equal`);
    the scheduler is compared when the stage has one."""
    mine = {"model": state.module.state_dict(), "optimizer": state.optimizer.state_dict()}
    if state.lr_scheduler is not None:
        mine["lr_scheduler"] = state.lr_scheduler.state_dict()
    return states_equal(mine, {k: result[k] for k in mine})


def hot_tier_dirs(run: PipelineRun) -> list[str]:
    d = os.path.join(run.root, run.run_id)
    return sorted(os.path.join(d, w) for w in os.listdir(d) if os.path.isdir(os.path.join(d, w, "index")))
