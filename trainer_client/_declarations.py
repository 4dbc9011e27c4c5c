"""What neighbouring stages declare they send and receive, compared before the first step.

torch receives into buffers of the receiver's declared dtype and shape without conversion: a
receiver whose ``input_args`` differ from its sender's ``output_args`` gets another tensor than
was sent (or gloo aborts it). Each stage puts its declaration into the commit store
(:meth:`Declarations.publish`); the next stage compares its own with it (:meth:`Declarations.check`).

Never: fails a stage for a declaration it cannot read (another client version, a store hiccup):
only a mismatch it sees raises.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import torch

from logstore.errors import ConfigError
from trainer_client.commit import CommitCoordinator

__all__ = ["Declarations", "example_tensors"]

logger = logging.getLogger(__name__)


class Declarations:
    """One stage's declared inputs, and whether they were compared with its sender's outputs."""

    def __init__(self, stage: int, is_first: bool, coordinator: CommitCoordinator | None) -> None:
        self._stage = stage
        self._is_first = is_first
        self._coordinator = coordinator
        self._inputs: list[list[Any]] | None = None  # [dtype, shape] of each part input_args declare (None: not given)
        self.checked = False  # input_args compared with what the stage before declares it sends

    def publish(self, input_args: Any, output_args: Any) -> None:
        """Put what this stage declares it receives and sends (dtype and shape of each part) into the
        commit store, where the next stage compares it with its own (:meth:`check`)."""
        self._inputs, self.checked = _part_specs(input_args), self._is_first
        if self._coordinator is None:
            return
        try:
            self._coordinator.store.set(
                _declaration_key(self._coordinator.prefix, self._stage),
                json.dumps({"inputs": self._inputs, "outputs": _part_specs(output_args)}),
            )
        except Exception as e:  # the store is the commit's: if it is gone, the commit says so
            logger.debug("stage %d: declaration not published: %s", self._stage, e)

    def check(self) -> None:
        """Before the first step: compare this stage's ``input_args`` with the ``output_args`` of the
        stage before it (from the commit store, waiting up to 30 s for it to be built).

        Raises ConfigError naming both declarations. Skipped without a commit store or a declaration
        to compare."""
        self.checked = True
        if self._coordinator is None or self._inputs is None:
            return
        key = _declaration_key(self._coordinator.prefix, self._stage - 1)
        try:
            self._coordinator.store.wait([key], datetime.timedelta(seconds=30))
            sent = json.loads(self._coordinator.store.get(key))["outputs"]
        except Exception as e:  # not published (another client version, a store hiccup): nothing to compare
            logger.info(
                "stage %d: the declaration of stage %d is not in the commit store (%s); not compared",
                self._stage,
                self._stage - 1,
                e,
            )
            return
        if sent is not None and sent != self._inputs:
            k = self._stage
            raise ConfigError(
                f"stage {k} declares that it receives {_fmt_parts(self._inputs)} (input_args), but stage {k - 1} "
                f"declares that it sends {_fmt_parts(sent)} (output_args): torch receives into the declared "
                "buffers without conversion, so what arrives would not be what was sent (or gloo aborts the "
                "receiver)",
                hint="declare input_args exactly as the previous stage's output_args "
                "(dtype, shape, one tensor per part, in order)",
            )


def example_tensors(args: Any) -> list[torch.Tensor]:
    """The tensors of an example-arguments structure (a tensor, or tuples / lists of them)."""
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (tuple, list)):
        return [t for a in args for t in example_tensors(a)]
    return []


def _part_specs(args: Any) -> list[list[Any]] | None:
    """``[dtype, shape]`` of each tensor of example arguments, in order; None when not given."""
    if args is None:
        return None
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in example_tensors(args)]


def _fmt_parts(parts: list[list[Any]]) -> str:
    return ", ".join(f"{d} {shape}" for d, shape in parts) or "nothing"


def _declaration_key(prefix: str, stage: int) -> str:
    """The commit-store key of what ``stage`` declares it receives and sends (JSON)."""
    return f"{prefix}/declared/{stage}"
