"""Gradient operations a replay repeats: ``clip_grad_norm_`` and ``all_reduce_grads_``.

The client holds one :class:`GradOps`. It runs the operations on the stage's gradients and keeps
the iteration's calls for META: ``grad_clip`` and ``grad_reduce``, each call with its place
``seq`` among them. A reduction's sums are logged as well (channel ``reduced_{stage}``, one record
per call, a part per parameter): the replay puts them in place of its own.

Never: changes a gradient other than by the torch clip or the reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from logstore import Channel
from trainer_client.digest import hex_digests
from trainer_client.fsdp import clip_grads_with_norm_, full_value, local_tensor
from trainer_client.replicas import average_gradients_
from trainer_client.stage import StageRecorder
from trainer_client.writer import AsyncLogWriter

__all__ = ["GradOps", "group_norm"]


def group_norm(total: torch.Tensor, norm_type: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The norm of every rank's ``total`` over ``group`` (None: ``total``), in ``total``'s dtype.
    Summed in float64: every rank's part has one dtype whatever its parameters' dtype (a float64
    stage among float32 ones)."""
    if group is None:
        return total
    inf = norm_type == float("inf")
    part = (total if inf else total.pow(norm_type)).to(torch.float64)
    dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return (part if inf else part.pow(1.0 / norm_type)).to(total.dtype)


class GradOps:
    """The iteration's ``clip_grad_norm_`` and ``all_reduce_grads_`` calls of one stage.

    ``stage_module`` returns the module of the client's pipeline stage (None without one).
    """

    def __init__(
        self,
        stage: int,
        writer: AsyncLogWriter,
        recorder: StageRecorder,
        stage_module: Callable[[], torch.nn.Module | None],
    ) -> None:
        self._stage = stage
        self._writer = writer
        self._recorder = recorder
        self._stage_module = stage_module
        self.clips: list[dict[str, Any]] = []  # the current iteration's clip_grad_norm_ calls (META "grad_clip")
        self.reduces: list[dict[str, Any]] = []  # its all_reduce_grads_ calls (META "grad_reduce")
        self.averages: list[dict[str, Any]] = []  # its averages over the replicas (META "replica_average")

    def begin(self) -> None:
        """A new iteration: no calls yet."""
        self.clips = []
        self.reduces = []
        self.averages = []

    def meta_fields(self) -> dict[str, Any]:
        """The iteration's calls as META has them: ``grad_clip``, ``grad_reduce`` and
        ``replica_average``."""
        return {
            "grad_clip": list(self.clips),
            "grad_reduce": list(self.reduces),
            "replica_average": list(self.averages),
        }

    def average_replicas_(self, group: dist.ProcessGroup, bucket_bytes: int) -> None:
        """Average the stage module's gradients over the replicas' ``group`` (a collective; see
        ``trainer_client.replicas.average_gradients_``). Every parameter that requires grad takes
        part, in ``parameters()`` order; one without a gradient takes part with zeros (and keeps
        them). META records the layout; nothing is logged: the replicas repeat it among themselves
        when they are replayed."""
        mod = self._stage_module()
        if mod is None:
            raise RuntimeError("the replicas' gradient average needs the stage built by client.pipeline_stage()")
        params = [p for p in mod.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_tensor(cast("torch.Tensor", p.grad)) for p in params]  # FSDP: this rank's shards
        # no digests before it: they differ per replica, and the replicas of a stage share one
        # META; the gradients after it (META grad_digests) are the same on every replica
        self.averages.append({"seq": self._seq(), **average_gradients_(grads, group, bucket_bytes)})

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
        foreach: bool | None,
        *,
        group: dist.ProcessGroup | None,
        module: torch.nn.Module | None,
        total: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``SwiftlogClient.clip_grad_norm_`` once an iteration is known to be in progress.
        ``total``: the norm to clip by, taken by the caller (a multi-stage rank's, over all its
        stages); None: this stage's, over ``group`` too."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        index = self._param_positions("clip_grad_norm_", params, module)
        if total is None:
            grads = [p.grad for p in params if p.grad is not None]
            # sharded gradients: the stage's whole norm (over its shard group), a plain tensor
            total = full_value(torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach))
            total = group_norm(total, norm_type, group)
        clip_grads_with_norm_(params, max_norm, total, foreach)
        positions = [index[id(p)] for p in params]
        self.clips.append(
            {
                "seq": self._seq(),
                "max_norm": float(max_norm),
                "total_norm": float(total),  # a float32 / bf16 value is exact as a Python float (and in JSON)
                "dtype": str(total.dtype).removeprefix("torch."),
                "foreach": foreach,
                "params": None if positions == list(range(len(index))) else positions,
            }
        )
        return total

    def all_reduce_grads_(
        self,
        iteration: int,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        *,
        group: dist.ProcessGroup | None,
        average: bool,
        module: torch.nn.Module | None,
    ) -> None:
        """``SwiftlogClient.all_reduce_grads_`` once ``iteration`` is known to be in progress."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        index = self._param_positions("all_reduce_grads_", params, module)
        if not params:
            raise ValueError("all_reduce_grads_: no parameters given")
        if dist.get_rank(group) < 0:
            raise ValueError(
                f"all_reduce_grads_: this rank ({dist.get_rank()}) is not a member of the group given; "
                "call it on the group's ranks only"
            )
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        pre = hex_digests(grads)
        reduced = _all_reduce_flat(grads, group, average)
        for g, r in zip(grads, reduced, strict=True):
            g.copy_(r)
        call = len(self.reduces)
        self.reduces.append(
            {
                "seq": self._seq(),
                "params": [index[id(p)] for p in params],
                "average": bool(average),
                "world": dist.get_world_size(group),
                "pre": pre,
            }
        )
        if self._recorder.enabled:  # `reduced` is ours alone: no copy
            self._writer.submit(Channel.reduced(self._stage), iteration, call, reduced)

    def _seq(self) -> int:
        """The place of the next clip_grad_norm_ / all_reduce_grads_ call among the iteration's ones
        (META ``seq``: the replay repeats them in this order)."""
        return len(self.clips) + len(self.reduces) + len(self.averages)

    def _param_positions(
        self, what: str, params: Sequence[torch.Tensor], module: torch.nn.Module | None
    ) -> dict[int, int]:
        """id -> position in the stage module's ``parameters()``, of every parameter of the stage.

        That is the order a replay's stage has. ``module`` counts only when the client has no stage
        module (a hand-written runtime's). Raises ValueError naming ``params`` not among them."""
        mod = self._stage_module()
        if mod is None:
            mod = module
        if mod is None:
            raise ValueError(
                f"{what} needs the stage's module: pass module=, or build the stage with client.pipeline_stage()"
            )
        index = {id(p): i for i, p in enumerate(mod.parameters())}
        missing = [i for i, p in enumerate(params) if id(p) not in index]
        if missing:
            raise ValueError(
                f"{what}: parameters {missing} (positions in the list given) are not parameters of the stage's module"
            )
        return index


def _all_reduce_flat(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, average: bool
) -> list[torch.Tensor]:
    """The sums of ``grads`` over ``group`` (divided by its size with ``average``), as new tensors:
    one all_reduce per dtype and device over the gradients laid end to end."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.dtype, g.device), []).append(i)
    for idx in by_kind.values():
        flat = torch.cat([grads[i].detach().reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(dist.get_world_size(group))
        off = 0
        for i in idx:
            n = grads[i].numel()
            out[i] = flat[off : off + n].view_as(grads[i])
            off += n
    return cast("list[torch.Tensor]", out)  # every index is in one of the groups
