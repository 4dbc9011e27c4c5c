"""What every part of one replay shares: :class:`Context` (the reader, the stages, the options).

Built once by ``replay.core.replay_stages`` and passed to the per-iteration plan, the iteration's
passes, the checks and the prefetch thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replay.reader import LogReader
from replay.stage import ReplayHooks, StageState

__all__ = ["Context"]


@dataclass(slots=True)
class Context:
    reader: LogReader
    states: list[StageState]
    num_stages: int
    run_seed: int
    loss_fn: Callable[..., torch.Tensor] | None
    data_source: Callable[[int], tuple[Any, Any]] | None
    n_mb_arg: int | None
    scale_arg: bool | None
    verify: bool
    compare_logged: bool
    keep_sends: bool
    hooks: ReplayHooks
    device: torch.device
    buffers: list[tuple[int, str, torch.Tensor]]  # (stage, name, buffer) of every replayed module

    @property
    def first(self) -> int:
        return self.states[0].stage

    @property
    def last(self) -> int:
        return self.states[-1].stage

    def checks(self, it: int) -> bool:
        """Whether the sends of iteration ``it`` are checked at all (hooks may restrict it)."""
        return self.hooks.verify is None or bool(self.hooks.verify(it))

    def checks_step(self, it: int) -> bool:
        """Whether iteration ``it``'s optimizer step is checked against META's gradient digests."""
        if not self.verify:
            return False
        return self.checks(it) if self.hooks.verify_step is None else bool(self.hooks.verify_step(it))
