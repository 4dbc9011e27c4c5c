"""Shared by the trainer client's tests: a small first stage with keyword inputs, its loss, and
runs of it as a one-stage pipeline in this process (trained, checkpointed, replayed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from logstore import LogStore
from replay import LogReader, StageState, replay_stage
from trainer_client import (
    ClientConfig,
    SwiftlogClient,
    load_checkpoint,
)

__all__ = [
    "Masked",
    "mse",
    "plain_step",
    "train_one_stage",
    "single_rank_run",
    "same_state",
    "run_with_scheduler",
    "replay_with_scheduler",
]


class Masked(torch.nn.Module):
    """A first stage whose forward takes keyword inputs (an attention-mask-like tensor and a shift;
    not in name order, so passing the logged keywords positionally would mix them up)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = torch.nn.Linear(8, 5)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(5, 8, generator=g))
        self.drop = torch.nn.Dropout(0.3)

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.drop(self.lin(x))
        if mask is not None:
            h = h * mask
        return h if scale is None else h + scale


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def plain_step(
    client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
) -> None:
    client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))


def train_one_stage(
    client: SwiftlogClient,
    mod: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    iters: int = 4,
    schedule: str = "1f1b",
    sched: Any = None,
    out_dtype: torch.dtype = torch.float32,
    loss_fn: Callable[..., torch.Tensor] = mse,
    step: Callable[[SwiftlogClient, torch.nn.Module, torch.optim.Optimizer, int, torch.Generator], None] | None = None,
    apply: Callable[[int], Any] | None = None,
    sched_after: Callable[[int], bool] = lambda it: True,
) -> str:
    """``mod`` (8 features in, 5 out) as ``client``'s one-stage pipeline for ``iters`` iterations, a
    checkpoint at 1 (with ``sched``); per iteration ``step(client, module, optimizer, it, generator)``
    (default: the schedule step on random data), the commit, ``apply(it)`` (default: the optimizer
    step), the scheduler step (if ``sched_after(it)``), zero_grad. Returns the checkpoint's URI."""
    stage = client.pipeline_stage(
        mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, dtype=out_dtype, requires_grad=True)
    )
    client.schedule(stage, schedule, n_microbatches=2, loss_fn=loss_fn)
    uri = ""
    for it in range(iters):
        if it == 1:
            uri = client.checkpoint(1, mod, opt, sched)
        (step or plain_step)(client, mod, opt, it, torch.Generator().manual_seed(it))
        client.commit(it)
        if apply is None:
            opt.step()
        else:
            apply(it)
        if sched is not None and sched_after(it):
            sched.step()
        opt.zero_grad(set_to_none=True)
    return uri


def single_rank_run(
    tmp_path: Path,
    run_id: str,
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    step: Callable[[SwiftlogClient, torch.nn.Module, torch.optim.Optimizer, int, torch.Generator], None],
    *,
    schedule: str = "1f1b",
    out_dtype: torch.dtype = torch.float32,
    loss_fn: Callable[..., torch.Tensor] = mse,
    replay_loss: Callable[..., torch.Tensor] | None = mse,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, LogStore, torch.nn.Module, torch.optim.Optimizer, Any]:
    """Train ``Masked`` as a one-stage pipeline for 4 iterations (checkpoint at 1; ``step(client, module,
    optimizer, it, generator)`` runs the schedule step and whatever goes before the commit), then replay it from the
    checkpoint on a fresh module. ``loss_fn``: the schedule's; ``replay_loss``: the replay's (None:
    the one META names). Returns (live module, live optimizer, logs, replayed module, its
    optimizer, replay report)."""
    client = SwiftlogClient(
        ClientConfig(run_id=run_id, stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = make_opt(mod)
    uri = train_one_stage(client, mod, opt, schedule=schedule, out_dtype=out_dtype, loss_fn=loss_fn, step=step)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", run_id)
    fresh = Masked()
    fopt = make_opt(fresh)
    rep = replay_stage(
        StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
        LogReader(logs),
        num_stages=1,
        stop_iteration=4,
        loss_fn=replay_loss,
    )
    return mod, opt, logs, fresh, fopt, rep


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    from replay import states_equal

    return states_equal({"model": dict(a.named_parameters())}, {"model": dict(b.named_parameters())}) == []


def run_with_scheduler(
    tmp_path: Path, run_id: str, commit_store: Any, set_after_commit: Callable[[int, torch.optim.Optimizer], None]
) -> tuple[SwiftlogClient, Any, str, torch.nn.Module]:
    """``Masked`` as a one-stage pipeline, 4 iterations, AdamW under OneCycleLR (which also cycles
    the betas), a checkpoint at 1; ``set_after_commit(it, optimizer)`` runs between each commit and
    the optimizer step. Returns the client (closed), its close report, the checkpoint and the module."""
    client = SwiftlogClient(
        ClientConfig(run_id=run_id, stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9),
        commit_store=commit_store,
    )
    mod = Masked()
    opt = torch.optim.AdamW(mod.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    uri = train_one_stage(client, mod, opt, sched=sched, apply=lambda it: (set_after_commit(it, opt), opt.step()))
    return client, client.close(), uri, mod


def replay_with_scheduler(tmp_path: Path, run_id: str, uri: str, stop: int) -> tuple[Any, torch.nn.Module]:
    fresh = Masked()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    state = StageState.from_checkpoint(
        load_checkpoint(uri), fresh, fopt, torch.optim.lr_scheduler.OneCycleLR(fopt, max_lr=0.1, total_steps=10)
    )
    return replay_stage(
        state, LogReader(LogStore.open(tmp_path / "store", run_id)), num_stages=1, stop_iteration=stop, loss_fn=mse
    ), fresh
