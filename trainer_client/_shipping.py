"""Shipping a stage's own data off the node before its commit completes.

Some records only this stage has: stage 0's inputs, the last stage's targets, another stage's
keyword inputs of the step, and the sums of its ``all_reduce_grads_`` calls. A replacement of the
stage needs them to replay an iteration. :class:`DataShipper` has the writer seal them as soon as
they are written (the uploader ships sealed data first), and makes ``commit`` wait until they are
in the cold tier, for at most ``ship_wait``. After a wait timed out, commits only check until the
cold tier has caught up.

Never: raises into the training step (a timeout or a lag is a logging fault); waits without a
cold tier.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

from logstore import Channel, LogStore
from trainer_client._grad_ops import GradOps
from trainer_client.config import ClientConfig
from trainer_client.stage import StageRecorder
from trainer_client.writer import AsyncLogWriter

__all__ = ["DataShipper", "seal_then_set"]

logger = logging.getLogger(__name__)


def seal_then_set(store: LogStore, channels: list[Channel], done: threading.Event) -> None:
    """Writer marker: seal ``channels`` (the uploader ships them first), then set ``done``."""
    try:
        store.seal(channels)
    finally:
        done.set()


class DataShipper:
    """The shipping of one stage's own data, and the state of its wait at the commit."""

    def __init__(
        self,
        config: ClientConfig,
        store: LogStore,
        writer: AsyncLogWriter,
        recorder: StageRecorder,
        grad_ops: GradOps,
    ) -> None:
        self._config = config
        self._store = store
        self._writer = writer
        self._recorder = recorder
        self._grad_ops = grad_ops
        # the inputs / targets this stage logs: a replay of this stage needs them, and only this stage has them
        self._own_data = (
            [
                c
                for c in (
                    Channel.input(config.stage) if config.is_first else None,
                    Channel.target(config.stage) if config.is_last else None,
                )
                if c is not None
            ]
            if config.log_data
            else []
        )
        self.lagging = False  # a ship wait timed out: commits only check until the cold tier catches up
        self.lag_since = 0  # the iteration whose ship wait timed out
        self._lag_noted = 0.0  # time.monotonic() of the last "ship_lag" fault
        self.own_sealed: threading.Event | None = None  # set once this iteration's inputs / targets are sealed
        self.wait_s = 0.0

    @property
    def shipping(self) -> bool:
        """Whether records are sealed for the uploader after every iteration (``ship_data`` and a cold tier)."""
        return self._config.commit.ship_data and self._store.cold is not None

    def begin(self) -> None:
        """A new iteration: its data is not sealed yet."""
        self.own_sealed = None

    def seal_own_data(self) -> None:
        """The recorder queued the last input / target of the iteration: have the writer seal them
        as soon as they are written (the uploader ships sealed data first), so that the commit's
        wait for them (:meth:`wait_shipped`) overlaps the rest of the iteration."""
        if self.shipping and self.own_sealed is None:
            self.own_sealed = threading.Event()
            self._writer.mark(functools.partial(seal_then_set, self._store, self.own_channels(), self.own_sealed))
            self._writer.kick()

    def own_channels(self) -> list[Channel]:
        """What this stage logged this iteration that no other stage has and a replay of it needs:
        stage 0's inputs, the last stage's targets, another stage's keyword inputs of the step, and
        the sums of its ``all_reduce_grads_`` calls."""
        own = list(self._own_data)
        if not self._config.is_first and self._recorder.input_kwargs:
            own.append(Channel.input(self._config.stage))
        if self._grad_ops.reduces:
            own.append(Channel.reduced(self._config.stage))
        return own

    def wait_shipped(self, iteration: int, own: list[Channel], sealed: threading.Event, timeout: float) -> None:
        """Before this stage reports ``iteration`` done: wait until its data of it (``own``) is
        in the cold tier (the writer writes and seals them, the uploader ships them first), so a
        replacement can replay the iteration. Lagging (after a timeout): check only, no wait."""
        t0 = time.perf_counter()
        try:
            if self.lagging:  # caught up when every earlier iteration's data is there (no wait)
                if not self._store.wait_shipped(own, iteration - 1, 0.0):
                    self._still_lagging(iteration, own)
                    return
                self.lagging = False
                logger.info(
                    "stage %d: the cold tier caught up by iteration %d; commits wait for the data again",
                    self._config.stage,
                    iteration,
                )
            if sealed.wait(timeout) and self._store.wait_shipped(
                own, iteration, max(0.0, timeout - (time.perf_counter() - t0))
            ):
                return
            self.lagging, self.lag_since, self._lag_noted = True, iteration, time.monotonic()
            self._writer.note_fault(
                "ship_timeout",
                f"iteration {iteration}'s {'/'.join(c.name for c in own)} not in the cold tier after "
                f"{timeout:g} s: until it catches up, a failure of this stage needs a rollback",
                iteration=iteration,
            )
        finally:
            self.wait_s += time.perf_counter() - t0

    def _still_lagging(self, iteration: int, own: list[Channel]) -> None:
        """Still behind: say so again, now and then (every ``ship_lag_report``)."""
        now = time.monotonic()
        if now - self._lag_noted >= self._config.commit.ship_lag_report.total_seconds():
            self._lag_noted = now
            self._writer.note_fault(
                "ship_lag",
                f"iteration {iteration}: this stage's {'/'.join(c.name for c in own)} are still not all in "
                f"the cold tier since iteration {self.lag_since}: a failure of this stage needs a rollback",
                iteration=iteration,
            )
