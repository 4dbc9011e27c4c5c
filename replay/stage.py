"""What the replay loop is given: each stage's live objects and the loop's extension points.

:class:`StageState` holds one stage's module, optimizer and lr scheduler, loaded from its
checkpoint and advanced in place by the replay. :class:`ReplayHooks` are the points through which
parallel replay (``replay.parallel``) drives the same loop: which micro-batches this process
replays, what happens around each backward and before the optimizer step.

Never: loads a checkpoint with aliasing (``Checkpoint.apply`` copies).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from logstore import Channel
from trainer_client import Checkpoint

__all__ = ["ReplayHooks", "StageState"]


@dataclass(slots=True)
class StageState:
    """The live objects of one stage being replayed (they are advanced in place).

    Build with :meth:`from_checkpoint` to load a checkpoint into fresh objects.
    """

    stage: int
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any | None = None
    checkpoint: Checkpoint | None = None

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None = None,
    ) -> StageState:
        """Load ``checkpoint`` into ``module``/``optimizer``/``lr_scheduler`` (no aliasing)."""
        checkpoint.apply(module, optimizer, lr_scheduler)
        module.train()
        return cls(checkpoint.stage, module, optimizer, lr_scheduler, checkpoint)


@dataclass(slots=True)
class ReplayHooks:
    """Extension points of the replay loop (used by parallel replay; all optional).

    select(iteration, backward_order) -> micro-batches this process replays (default: all);
        forward and backward keep the live order restricted to them.
    before_backward(iteration, micro_batch): called just before the micro-batch's backward pass
        (e.g. to arm gradient hooks for the last one).
    after_backward(iteration, micro_batch): called after the micro-batch's backward through every
        replayed stage, before the next one (its parameter gradients are in ``.grad``, summed with
        those of earlier micro-batches unless the hook took them out).
    before_step(iteration, scale): called after the last backward, before gradients are divided
        by ``scale`` and the optimizers step (e.g. to all-reduce the gradients).
    verify(iteration) -> whether to check this iteration's sends (default: all iterations).
    verify_step(iteration) -> whether to check the gradients of this iteration's optimizer step
        against META's ``grad_digests`` (default: as ``verify``; a replay that sums the gradients
        in another order than the live stage says no).
    shadow_forwards(iteration) -> whether this process also runs the forwards of the micro-batches
        ``select`` left out, for their effect on module buffers (BatchNorm's running statistics):
        every forward then runs in the live forward order, so the buffers evolve as in the live
        run; a left-out micro-batch's outputs are discarded (no check, no loss, no backward).
    claim(iteration) -> one more micro-batch to replay here, or None: asked after the passes of
        ``select``'s micro-batches, again after each one it gave (forward, then backward at once),
        until it says None (a dynamic share, e.g. taken from a queue other workers draw from too).
        Never asked in an iteration with shadow forwards; a micro-batch given twice is an error.
    likely(iteration, backward_order) -> micro-batches ``claim`` will probably give: the prefetch
        thread fetches their records ahead with ``select``'s (one it did not is fetched when
        claimed; one fetched but never claimed is dropped when the iteration is over).
    replica_group: the process group of the data-parallel replicas of the stage replayed together
        (every replica of it was lost), ranked in replica order. A live average over the replicas
        (META ``replica_average``) is repeated over it; without it such a replay stops.
    send(channel, iteration, micro_batch, tensors) -> whether the regenerated send went to a peer
        replaying the receiving stage (``replay.group_replay``): then it is not checked against the
        receiver's digests (a boundary inside a logging group has none). Called with the sends of
        the first replayed stage's gradients and the last one's activations.
    live_order: run every iteration's passes in the live stage's order (META ``order``), even
        without module buffers that need it: a member of a group replayed as a pipeline
        (``replay.group_replay``) must exchange with its neighbours in the live interleaving, or
        the members wait for each other at every micro-batch.
    """

    select: Callable[[int, Sequence[int]], Collection[int]] | None = None
    before_backward: Callable[[int, int], None] | None = None
    after_backward: Callable[[int, int], None] | None = None
    before_step: Callable[[int, int], None] | None = None
    verify: Callable[[int], bool] | None = None
    verify_step: Callable[[int], bool] | None = None
    shadow_forwards: Callable[[int], bool] | None = None
    claim: Callable[[int], int | None] | None = None
    likely: Callable[[int, Sequence[int]], Collection[int]] | None = None
    replica_group: Any = None
    send: Callable[[Channel, int, int, Sequence[torch.Tensor]], bool] | None = None
    live_order: bool = False
