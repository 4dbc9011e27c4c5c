"""Module buffers in parallel replay: whether the forwards change them, found out and then watched.

A forward may update module buffers (BatchNorm's running statistics), and the live run updated
them with every micro-batch in the live forward order. A worker that ran only its own forwards
would end with statistics of its share alone. :class:`BufferWatch` makes every worker run the
other workers' forwards too ("shadow" forwards) in the first iteration and compares the buffers'
contents before and after: if any worker saw a change, every later iteration runs them as well; if
none did, later iterations skip them, and a change that shows up later anyway is an error naming
the buffer. ``docs/parallel-replay.md`` ("Buffers") says more.

Never: lets a buffer change go unnoticed in a worker that skips the shadow forwards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from replay.errors import ReplayError
from replay.stage import StageState
from trainer_client.buffers import BufferSnapshot, named_buffers

__all__ = ["BufferWatch"]

logger = logging.getLogger(__name__)


class BufferWatch:
    """The replayed stages' module buffers, for one of ``world`` workers replaying from ``start``.

    ``buffers_mutate``: whether the forwards change them (None: not known yet; the first iteration
    runs every forward and finds out).
    """

    def __init__(self, states: Sequence[StageState], world: int, start: int) -> None:
        self.states = list(states)
        self.world = world
        self.first_it = start
        # module buffers (running statistics) follow every micro-batch's forward: None = not known yet
        # whether the forwards change them; the first iteration runs all forwards and finds out
        self.buffers_mutate: bool | None = None if world > 1 and self.named() else False
        self._snapshot = BufferSnapshot()  # the buffers at the start of the current iteration

    def named(self) -> dict[str, torch.Tensor]:
        return named_buffers({f"stage {st.stage} ": st.module for st in self.states})

    def watching(self) -> bool:
        """Whether a buffer change could still be missed: several workers, and not every forward runs here."""
        return self.world > 1 and self.buffers_mutate is not True

    def snap(self) -> None:
        """Copy the buffers at the start of an iteration, while it is still open whether the forwards
        change them (contents are compared: BatchNorm's kernel updates its running statistics
        without bumping their version counters)."""
        if self.watching():
            self._snapshot.take(self.named())

    def shadow_forwards(self, it: int) -> bool:
        """Whether iteration ``it`` runs every micro-batch's forward here (ReplayHooks.shadow_forwards):
        in the first iteration whenever the stages have buffers (to find out whether the forwards
        change them), later iff they did. Until the first iteration has shown it, the prefetch
        thread asking ahead hears no (a record it did not fetch is fetched when needed)."""
        if self.buffers_mutate is None:
            return it == self.first_it
        return self.buffers_mutate

    def settle(self, it: int, changed_here: list[str], changed_anywhere: bool) -> None:
        """After iteration ``it``'s forwards: the first iteration decides whether later ones run
        every forward; a change after a first iteration without any is an error (the other
        workers' forwards did not run here, so the buffers would be wrong), never silent."""
        if self.buffers_mutate is None:
            self.buffers_mutate = changed_anywhere
            if changed_anywhere:
                logger.info(
                    "parallel replay: the forwards change module buffers (%s): every worker runs every forward",
                    ", ".join(changed_here[:3]) or "seen by another worker",
                )
        elif changed_anywhere and not self.buffers_mutate:
            where = ", ".join(changed_here[:5]) or "on another worker"
            raise ReplayError(
                f"parallel replay: module buffers changed in iteration {it} ({where}) but not in iteration "
                f"{self.first_it}, so this worker did not run the other workers' forwards and its buffers would "
                "differ from the live run's",
                hint="replay these stages with one worker (sequential replay reproduces every buffer update)",
            )

    def changed(self) -> list[str]:
        return self._snapshot.changed(self.named()) if self.watching() else []
