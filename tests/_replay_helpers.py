"""Helpers of the replay tests: the runs' handle (:class:`Run`) and bitwise state comparisons.

The runs themselves are session fixtures in ``tests/_replay_fixtures.py`` (load it with
``pytest_plugins = ["tests._replay_fixtures"]``). Every run is a real 4-stage pipeline (one
process per stage, gloo on CPU, the example GPT with dropout), logged by the trainer client,
checkpointed at iteration :data:`CKPT` and run to :data:`ITERS`. They are session-scoped so
that every replay test module shares them:

- ``gpipe_s3_run``: GPipe, cold tier and checkpoints on a moto S3 server;
- ``f1b_run``: 1F1B, cold tier in a directory (``file://``);
- ``groups_run``: 1F1B with logging groups [2, 2] (only the 1|2 boundary is logged);
- ``gap_run``: GPipe whose stage 0 drops records when its tiny queue is full (recorded gaps).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from logstore import LogStore
from logstore.hot import HotTier
from logstore.keys import RecordKey
from replay.compare import states_equal
from replay.job import ReplayJob, SourceSpec
from replay.plan import cold_only_store
from tests._client_mp import NUM_STAGES, SEED, PipelineRun, run_pipeline
from trainer_client import Checkpoint

__all__ = [
    "CKPT",
    "ITERS",
    "NUM_STAGES",
    "SEED",
    "Run",
    "file_run",
    "state_bytes_differ",
    "checkpoint_vs_live",
    "corrupt_hot_record",
    "copy_run_files",
]

CKPT = 2
ITERS = 6
#: the example GPT's stage factory, which every replay of these runs names
EXAMPLE_MODEL = "trainer_client.examples.factories:gpt_stage"


@dataclass
class Run:
    """A finished pipeline run and how to reach its logs."""

    pipe: PipelineRun
    cold_url: str
    cold_options: dict[str, Any]

    @property
    def run_id(self) -> str:
        return self.pipe.run_id

    @property
    def root(self) -> str:
        return self.pipe.root

    @property
    def results(self) -> dict[int, dict[str, Any]]:
        return self.pipe.results

    @property
    def gpt(self) -> Any:
        return self.pipe.gpt

    def store(self, *, cold: bool = True, root: str | None = None) -> LogStore:
        return LogStore.open(
            root or self.root,
            self.run_id,
            cold_url=self.cold_url if cold else None,
            cold_options=dict(self.cold_options),
        )

    def cold_store(self, url: str | None = None) -> LogStore:
        return cold_only_store(url or self.cold_url, self.run_id, self.cold_options)

    def spec(self, *, cold: bool = True) -> SourceSpec:
        return SourceSpec(
            kind="store", location=self.root, cold_url=self.cold_url if cold else None, options=dict(self.cold_options)
        )

    def cold_spec(self, url: str | None = None) -> SourceSpec:
        return SourceSpec(kind="cold", location=url or self.cold_url, options=dict(self.cold_options))

    def job_fields(self) -> dict[str, Any]:
        """ReplayJob fields every job of this run needs (the stage factory and model sizes,
        checkpoint credentials)."""
        return {"model": EXAMPLE_MODEL, "model_args": self.gpt.to_dict(), "checkpoint_options": dict(self.cold_options)}


def file_run(
    base: Path, run_id: str, schedule: str, extra: Sequence[str] = (), per_stage: dict[int, list[str]] | None = None
) -> Run:
    pipe = run_pipeline(
        base, run_id, schedule=schedule, iters=ITERS, ckpt_at=str(CKPT), extra=list(extra), per_stage=per_stage
    )
    assert pipe.cold_url is not None
    return Run(pipe, pipe.cold_url, {})


# ------------------------------------------------------------------------------ comparisons
def state_bytes_differ(model_a: dict, opt_a: dict | None, model_b: dict, opt_b: dict | None) -> list[str]:
    """Where two models and optimizer states differ bit for bit (:func:`replay.compare.states_equal`)."""
    return states_equal({"model": model_a, "optimizer": opt_a}, {"model": model_b, "optimizer": opt_b})


def checkpoint_vs_live(ck: Checkpoint, live: dict[str, Any]) -> list[str]:
    """Differences between a recovered checkpoint and the live stage's final state (bytes, scheduler, iteration)."""
    bad = states_equal({"model": ck.model, "optimizer": ck.optimizer, "lr_scheduler": ck.lr_scheduler}, live)
    if ck.iteration != live["iters"]:
        bad.append(f"iteration {ck.iteration} != {live['iters']}")
    return bad


def corrupt_hot_record(root: str, run: str, key: RecordKey) -> str:
    """Flip one bit in the middle of ``key``'s blob in whichever hot tier holds it; returns the writer."""
    base = Path(root) / run
    for w in sorted(p for p in base.iterdir() if (p / "index").is_dir()):
        hot = HotTier(w, owner=False)
        try:
            loc = hot.lookup(key)
            if loc is None:
                continue
            path = hot.seg_path(loc.segment.id)
        finally:
            hot.close()
        with open(path, "r+b") as f:
            f.seek(loc.offset + loc.length // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
        return w.name
    raise AssertionError(f"{key} is in no hot tier under {base}")


def copy_run_files(run: Run, dst: Path) -> tuple[str, str]:
    """A private copy of the run's store root and (file://) cold tier: (root, cold_url)."""
    assert run.cold_url.startswith("file://"), "only file:// cold tiers can be copied"
    root = dst / "store"
    cold = dst / "cold"
    shutil.copytree(run.root, root)
    shutil.copytree(run.cold_url[len("file://") :], cold)
    return str(root), f"file://{cold}"


def slow_second_worker_gpt_stage(stage: int, num_stages: int, checkpoint: Checkpoint, **model_args: Any) -> Any:
    """``trainer_client.examples.factories.gpt_stage`` whose forward in parallel-replay worker 1 (a
    worker on a busy core) sleeps six times as long as it computed, and at least 30 ms, for the
    balancing tests. The sleep grows with the forward's own time, so worker 1 stays the slower one
    however loaded the machine is. The arithmetic is untouched."""
    import time

    import torch.distributed as dist

    from trainer_client.examples.factories import gpt_stage

    module, optimizer, scheduler = gpt_stage(stage, num_stages, checkpoint, **model_args)
    started: list[float] = []

    def start(mod: Any, args: Any) -> None:
        started[:] = [time.perf_counter()]

    def slow(mod: Any, args: Any, out: Any) -> None:
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(max(0.03, 6 * (time.perf_counter() - started[0])))

    module.register_forward_pre_hook(start)
    module.register_forward_hook(slow)
    return module, optimizer, scheduler


def frozen_ln_gpt_stage(stage: int, num_stages: int, checkpoint: Checkpoint, **model_args: Any) -> Any:
    """``trainer_client.examples.factories.gpt_stage`` with its first LayerNorm frozen (``requires_grad=False``): a
    stage with parameters that get no gradient and no gradient hook."""
    from trainer_client.examples.factories import gpt_stage

    module, optimizer, scheduler = gpt_stage(stage, num_stages, checkpoint, **model_args)
    for p in module.blocks[0].ln1.parameters():
        p.requires_grad_(False)
    return module, optimizer, scheduler


def late_buffer_gpt_stage(stage: int, num_stages: int, checkpoint: Checkpoint, **model_args: Any) -> Any:
    """``trainer_client.examples.factories.gpt_stage`` with a counter buffer that its forward starts to bump only after
    the first ``n_microbatches`` calls (after a parallel replay's first iteration); the outputs are
    untouched. For the test that such a late buffer update is an error, not a silent difference."""
    from trainer_client.examples.factories import gpt_config, gpt_stage

    module, optimizer, scheduler = gpt_stage(stage, num_stages, checkpoint, **model_args)
    quiet_calls = gpt_config(checkpoint, **model_args).n_microbatches
    module.register_buffer("late_count", torch.zeros((), dtype=torch.int64), persistent=False)  # not in the checkpoint
    calls = [0]

    def count(mod: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] > quiet_calls:
            mod.late_count.data.add_(
                1
            )  # through .data: no version-counter bump (as BatchNorm's kernel), only the contents show it

    module.register_forward_pre_hook(count)
    return module, optimizer, scheduler


def job_for(run, stage_or_stages, tmp_path: Path, **kw) -> ReplayJob:
    """A job replaying ``stage_or_stages`` of ``run`` from its checkpoint at CKPT to ITERS."""
    stages = [stage_or_stages] if isinstance(stage_or_stages, int) else list(stage_or_stages)
    kw.setdefault("sources", [run.spec()])
    kw.setdefault("output", str(tmp_path / "out"))
    return ReplayJob(
        run=run.run_id,
        num_stages=NUM_STAGES,
        stages=stages,
        stop_iteration=ITERS,
        checkpoints={k: run.results[k]["checkpoints"][CKPT] for k in stages},
        **{**run.job_fields(), **kw},
    )
