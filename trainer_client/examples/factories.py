"""Stage factory and data source of the example GPT (``trainer_client.examples.gpt``), for a replay.

A replay must rebuild the lost stage's module, optimizer and scheduler exactly as training built
them before loading the checkpoint into them. The engine names the builder as ``"module:function"``
(so a spawned worker or a torchrun rank can import it) and calls

    factory(stage, num_stages, checkpoint, **model_args) -> (module, optimizer, lr_scheduler | None)

and, for runs whose stage-0 inputs / targets came from a deterministic data source,

    data_factory(seed, **model_args) -> DataSource

These are the two for the example GPT. Model sizes come from ``checkpoint.extra["gpt"]`` when the
training script stored them there, overridden by ``model_args`` (``GPTConfig`` field names).

Never: touches the global RNG (the example builders fork it).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_client import Checkpoint, DataSource
from trainer_client.examples.gpt import (
    GPTConfig,
    SyntheticTokens,
    build_stage_module,
    make_lr_scheduler,
    make_optimizer,
    shard_stage_module,
)

__all__ = ["gpt_stage", "gpt_data", "gpt_config"]


def gpt_config(checkpoint: Checkpoint | None = None, **model_args: Any) -> GPTConfig:
    """The GPTConfig of a run: ``checkpoint.extra["gpt"]`` (if present) updated with ``model_args``."""
    base: dict[str, Any] = {}
    if checkpoint is not None and isinstance(checkpoint.extra.get("gpt"), dict):
        base.update(checkpoint.extra["gpt"])
    base.update(model_args)
    return GPTConfig(**base)


def gpt_stage(
    stage: int, num_stages: int, checkpoint: Checkpoint | None, shard_mesh: Any = None, **model_args: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Stage ``stage`` of the example GPT with AdamW and its LinearLR scheduler (fresh, in train
    mode). ``checkpoint`` None: objects whose values a live replica's replace (``model_args``
    then hold the whole config). ``shard_mesh``: FSDP2 over it (``gpt.shard_stage_module``)."""
    cfg = gpt_config(checkpoint, **model_args)
    module = build_stage_module(cfg, stage, num_stages, seed=checkpoint.seed if checkpoint is not None else 0)
    if shard_mesh is not None:
        module = shard_stage_module(module, shard_mesh)
    optimizer = make_optimizer(module)
    return module, optimizer, make_lr_scheduler(optimizer)


def gpt_data(seed: int, **model_args: Any) -> DataSource:
    """The example's deterministic token source (``SyntheticTokens``) for run seed ``seed``."""
    return SyntheticTokens(gpt_config(None, **model_args), seed=seed)
