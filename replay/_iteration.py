"""One replayed iteration: every micro-batch's forward and backward, then the optimizer step.

:class:`IterationReplay` runs an iteration as its :class:`~replay._iteration_plan.IterationPlan`
says: the passes in their order (:func:`~replay._iteration_plan.passes`), one method per phase:

1. :meth:`~IterationReplay.forward`: a micro-batch through the replayed stages, chained in
   process inside a logging group, each stage seeded as the live forward was and run under its
   live autocast region; the last stage of the pipeline computes the loss, the group's last stage
   has its sends checked;
2. :meth:`~IterationReplay.backward`: the micro-batch's backward with the logged gradients (the
   last stage of the pipeline from its loss), the group's first stage has its sends checked, and a
   change of module buffers is checked against the live order;
3. :meth:`~IterationReplay.step`: the ``before_step`` hook (parallel replay reduces the gradients
   there), then per stage the scale, the live clip and reduce calls, the checks, the optimizer and
   scheduler steps (``replay._checks``).

A dynamic share (``ReplayHooks.claim``) adds micro-batches one at a time after the planned ones.

Never: consumes RNG outside the seeded forwards; runs a pass out of the plan's order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from logstore import Channel
from replay._checks import (
    average_as_live,
    check_grad_digests,
    check_hyperparameters,
    check_live_interleaving,
    check_scheduled_rates,
    check_sends,
    clip_as_logged,
    grad_ops,
    live_steps,
    reduce_as_logged,
    step_scheduler,
)
from replay._context import Context
from replay._iteration_plan import IterationPlan, passes
from replay.errors import ReplayError
from replay.reader import LogReader
from replay.report import ReplayReport
from replay.stage import StageState
from replay.user_code import user_code
from trainer_client import fsdp
from trainer_client.data import data_inputs, on_device
from trainer_client.determinism import autocast_as, seed_micro_batch

__all__ = ["IterationReplay"]

#: a micro-batch's forward through the replayed stages: per stage (its input leaves, its outputs or
#: the loss on the last stage of the pipeline)
PerStage = list[tuple[tuple[torch.Tensor, ...], Any]]


class IterationReplay:
    """Iteration ``it`` of a replay, run by :meth:`run` as ``plan`` says; counts go into ``report``."""

    def __init__(self, ctx: Context, it: int, plan: IterationPlan, report: ReplayReport) -> None:
        self.ctx, self.it, self.plan, self.report = ctx, it, plan, report
        self.is_last = ctx.last == ctx.num_stages - 1  # the last stage of the pipeline is replayed
        self.check = ctx.checks(it)
        self.src_inputs: list[tuple[Any, ...]] | None = None
        self.src_kwargs: list[dict[str, Any]] | None = None
        self.src_targets: list[Any] | None = None
        if ctx.data_source is not None and (ctx.first == 0 or self.is_last):
            inputs, target = ctx.data_source(it)
            self.src_inputs, self.src_kwargs = _split_inputs(inputs, plan.n_mb)
            self.src_targets = None if target is None else [c[0] for c in _split(target, plan.n_mb)]
        self.losses: list[float] = []  # the last stage's, in forward order
        self.loss_mbs: list[int] = []
        self.passes = passes(plan)
        #: the replayed stages that are ``fully_shard``-ed: torch's schedules drive their gradient sync
        self.sharded = {st.stage for st in ctx.states if fsdp.is_sharded(st.module)}

    def run(self) -> None:
        """The planned passes, then the micro-batches a dynamic share claims, then the step."""
        plan, hooks = self.plan, self.ctx.hooks
        forwarded: dict[int, PerStage] = {}  # mb -> forward's per-stage record
        for kind, mb in self.passes:
            if kind == "F":
                forwarded[mb] = self.forward(mb)
            elif kind == "S":
                self.forward(mb, shadow=True)
            else:
                self.backward(mb, forwarded.pop(mb))
        if hooks.claim is not None and not plan.shadow:  # a dynamic share: one micro-batch at a time
            while (mb := hooks.claim(self.it)) is not None:
                if mb not in plan.bwd_order or mb in plan.mine:
                    raise ReplayError(
                        f"iteration {self.it}: claimed micro-batch {mb} does not exist or was replayed here already"
                    )
                plan.mine.append(mb)
                self.backward(mb, self.forward(mb))
        self.step()

    # -- forward ------------------------------------------------------------------------
    def forward(self, mb: int, shadow: bool = False) -> PerStage:
        """Micro-batch ``mb`` through the stages: per stage (input leaves, outputs or the loss).
        ``shadow``: only for the modules' buffers (no loss, no check of the sends, not counted)."""
        ctx, plan, it, states = self.ctx, self.plan, self.it, self.ctx.states
        x, kw = self._inputs(mb)  # kw: stage 0's keyword inputs (the other stages': _stage_kwargs)
        per_stage = []
        for i, st in enumerate(states):
            seed_micro_batch(ctx.run_seed, st.stage, it, mb)
            kw_st = {
                **(plan.logged(st.stage, "input_consts") or {}),
                **(kw if st.stage == 0 else _stage_kwargs(ctx.reader, plan, st.stage, it, mb, ctx.device)),
            }
            with (
                user_code("stage's forward", st.stage, it, mb),
                autocast_as(plan.logged(st.stage, "autocast")),
            ):  # the live forward's autocast regions
                out = st.module(*x, **kw_st)
            outs = out if isinstance(out, tuple) else (out,)
            if shadow:
                if i + 1 < len(states):
                    x = _leaves([o.detach() for o in outs], plan.logged(states[i + 1].stage, "recv_requires_grad"))
                continue
            if st.stage == ctx.num_stages - 1:
                per_stage.append((x, self._loss(st, mb, out)))
            else:
                per_stage.append((x, outs))
                if i + 1 < len(states):
                    x = _leaves([o.detach() for o in outs], plan.logged(states[i + 1].stage, "recv_requires_grad"))
                elif not self._sent_to_peer(Channel.activation(st.stage), mb, outs):
                    check_sends(
                        ctx,
                        Channel.activation(st.stage),
                        Channel.digest(st.stage, st.stage + 1),
                        it,
                        mb,
                        outs,
                        self.check,
                        self.report,
                    )
        return per_stage

    def _sent_to_peer(self, channel: Channel, mb: int, tensors: Sequence[Any]) -> bool:
        """Hand a regenerated boundary send to the ``send`` hook; whether a peer took it."""
        send = self.ctx.hooks.send
        return send is not None and send(channel, self.it, mb, [t for t in tensors if t is not None])

    def _inputs(self, mb: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The first replayed stage's inputs of micro-batch ``mb``: stage 0's from the data source
        or its logged inputs (positional, then keyword), another stage's received activations."""
        ctx, plan, it, dev = self.ctx, self.plan, self.it, self.ctx.device
        kw: dict[str, Any] = {}
        if ctx.first == 0:
            if self.src_inputs is not None and self.src_kwargs is not None:
                x, kw = on_device(self.src_inputs[mb], dev), on_device(self.src_kwargs[mb], dev)
            else:
                x = on_device(tuple(ctx.reader.require_parts(Channel.input(0), it, mb)), dev)
                if plan.input_kwargs:
                    n_pos = len(x) - len(plan.input_kwargs)
                    x, kw = x[:n_pos], dict(zip(plan.input_kwargs, x[n_pos:], strict=True))
        else:
            x = _leaves(
                [on_device(t, dev) for t in ctx.reader.require_parts(Channel.activation(ctx.first - 1), it, mb)],
                plan.logged(ctx.first, "recv_requires_grad"),
            )
        return x, kw

    def _loss(self, st: StageState, mb: int, out: Any) -> torch.Tensor:
        """The last stage's loss of micro-batch ``mb``, on its target (the data source's or the
        logged one), computed as the schedule did: inside the step's autocast region."""
        ctx, it = self.ctx, self.it
        if self.src_targets is not None:
            target = self.src_targets[mb]
        else:
            tparts = ctx.reader.require_parts(Channel.target(st.stage), it, mb)
            target = tparts[0] if len(tparts) == 1 else tuple(tparts)
        target = on_device(target, ctx.device)
        with (
            user_code("loss function", st.stage, it, mb),
            autocast_as(self.plan.logged(st.stage, "autocast")),
        ):  # the schedule computed the loss inside the step too
            loss = ctx.loss_fn(out, target)  # type: ignore[misc]
        self.losses.append(float(loss.detach()))
        self.loss_mbs.append(mb)
        return loss

    # -- backward -----------------------------------------------------------------------
    def backward(self, mb: int, per_stage: PerStage) -> None:
        """Micro-batch ``mb``'s backward through the stages, last to first, from the logged
        gradients (or the loss); the first stage's sends are checked, and a change of module
        buffers is checked against the live order."""
        ctx, plan, it, states = self.ctx, self.plan, self.it, self.ctx.states
        if ctx.hooks.before_backward is not None:
            ctx.hooks.before_backward(it, mb)
        versions = [b._version for _, _, b in ctx.buffers]
        # not in the live order: in the first iteration also compare the bytes (a kernel that updates a buffer in
        # place, e.g. F.batch_norm on the module's own statistics, or an update through .data, leaves the version)
        snapshot = (
            [_bytes_of(b).clone() for _, _, b in ctx.buffers]
            if ctx.buffers and plan.live_order is None and it == self.report.start_iteration
            else None
        )
        grads_in: list[torch.Tensor | None] | None = None
        for i in range(len(states) - 1, -1, -1):
            st = states[i]
            x, out = per_stage[i]
            self._backward_stage(st, mb, out, grads_in)
            sent = [t.grad for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
            grads_in = sent
            if st.stage > 0 and i == 0 and not self._sent_to_peer(Channel.gradient(st.stage), mb, sent):
                check_sends(
                    ctx,
                    Channel.gradient(st.stage),
                    Channel.digest(st.stage, st.stage - 1),
                    it,
                    mb,
                    [g for g in sent if g is not None],
                    self.check,
                    self.report,
                )
        self.report.micro_batches += 1  # its backward ran through every replayed stage
        changed = [(k, name) for (k, name, b), v in zip(ctx.buffers, versions, strict=True) if b._version != v]
        if snapshot is not None:
            changed += [
                (k, name)
                for (k, name, b), c in zip(ctx.buffers, snapshot, strict=True)
                if (k, name) not in changed and not torch.equal(_bytes_of(b), c)
            ]
        if changed:
            check_live_interleaving(plan, self.passes, it, mb, changed)
        if ctx.hooks.after_backward is not None:
            ctx.hooks.after_backward(it, mb)

    def _backward_stage(self, st: StageState, mb: int, out: Any, grads_in: list[torch.Tensor | None] | None) -> None:
        """Stage ``st``'s backward of micro-batch ``mb``: from its loss on the last stage of the
        pipeline, else from ``grads_in`` (what the next replayed stage sent back; for the group's
        last stage, None: read from the logs)."""
        ctx, it = self.ctx, self.it
        autocast = self.plan.logged(st.stage, "autocast")
        if st.stage in self.sharded:  # as the live schedule: accumulate, reduce-scatter once in step()
            fsdp.backward_without_sync(st.module)
        if st.stage == ctx.num_stages - 1:
            with user_code("stage's backward", st.stage, it, mb), autocast_as(autocast):
                torch.autograd.backward([out])
            return
        if grads_in is None:  # last stage of the group, not of the pipeline: logged gradients
            grads_in = [
                on_device(g, ctx.device) for g in ctx.reader.require_parts(Channel.gradient(st.stage + 1), it, mb)
            ]
        with_grad = [o for o in out if o.requires_grad or o.grad_fn is not None]
        if len(with_grad) != len(grads_in):
            raise ReplayError(
                f"stage {st.stage} iteration {it} micro-batch {mb}: {len(with_grad)} outputs need gradients "
                f"but {len(grads_in)} were received"
            )
        with user_code("stage's backward", st.stage, it, mb), autocast_as(autocast):
            torch.autograd.backward(with_grad, grad_tensors=grads_in)

    # -- the step -----------------------------------------------------------------------
    def step(self) -> None:
        """The ``before_step`` hook, then per stage what the live loop did before and after its
        optimizer step (``replay._checks``); the last stage's losses go into the report."""
        ctx, plan, it, report = self.ctx, self.plan, self.it, self.report
        t_reduce = time.perf_counter()
        if ctx.hooks.before_step is not None:
            ctx.hooks.before_step(it, plan.scale)
        t_step = time.perf_counter()
        report.reduce_seconds += t_step - t_reduce
        for st in ctx.states:
            if st.stage in self.sharded:  # the live schedule's reduce-scatter, before its scale
                fsdp.reduce_gradients(st.module)
            if plan.scale != 1:
                for p in st.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(plan.scale)
            meta = plan.metas.get(st.stage)
            for kind, op in grad_ops(meta):  # the live clip_grad_norm_ / all_reduce_grads_ calls, in their order
                if kind == "clip":
                    clip_as_logged(st, it, op, ctx.device)
                elif kind == "average":
                    average_as_live(ctx, st, it, op, report)
                else:
                    reduce_as_logged(ctx, st, it, op, report)
            check_hyperparameters(st, it, meta)
            if meta and meta.get("grad_digests") is not None and ctx.checks_step(it):
                check_grad_digests(st, it, meta["grad_digests"], report)
            sched_steps = live_steps(st, it, meta)
            st.optimizer.step()
            for _ in range(sched_steps if st.lr_scheduler is not None else 0):
                step_scheduler(st, it)
            if sched_steps == 1 and st.lr_scheduler is not None and meta and meta.get("sched_next") is not None:
                check_scheduled_rates(st, it, meta["sched_next"])
            st.optimizer.zero_grad(set_to_none=True)
        report.step_seconds += time.perf_counter() - t_step
        if self.is_last:
            report.losses[it] = self.losses
            report.loss_micro_batches[it] = self.loss_mbs


def _split(batch: Any, n: int) -> list[tuple[Any, ...]]:
    """Split a whole batch into micro-batches exactly as the schedules do (dim 0, tensor_split)."""
    args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    chunks, _ = split_args_kwargs_into_chunks(args, None, n)
    return [tuple(c) for c in chunks]


def _stage_kwargs(
    reader: LogReader, plan: IterationPlan, stage: int, it: int, mb: int, dev: torch.device
) -> dict[str, Any]:
    """The keyword tensor inputs the step gave stage ``stage`` > 0 (logged under ``input_{stage}``,
    named in its META's ``input_kwargs``), for micro-batch ``mb``; {} when it had none."""
    names = plan.logged(stage, "input_kwargs")
    if not names:
        return {}
    parts = on_device(tuple(reader.require_parts(Channel.input(stage), it, mb)), dev)
    if len(parts) != len(names):
        raise ReplayError(
            f"stage {stage} iteration {it} micro-batch {mb}: META names keyword inputs {names} but input_{stage} holds "
            f"{len(parts)} tensor(s)"
        )
    return dict(zip(names, parts, strict=True))


def _split_inputs(inputs: Any, n: int) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """A data source's stage-0 inputs (positional and keyword, ``trainer_client.data.data_inputs``)
    split into micro-batches as the schedules split a step's arguments."""
    args, kwargs = data_inputs(inputs)
    chunks, kw_chunks = split_args_kwargs_into_chunks(args, kwargs or None, n)
    return [tuple(c) for c in chunks], [dict(k) for k in kw_chunks]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (NaN compares equal to itself)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _leaves(received: Sequence[torch.Tensor], requires_grad: Sequence[bool] | None) -> tuple[torch.Tensor, ...]:
    """Received tensors as the live receive buffers were: leaves requiring grad as the receiving
    stage declared them (META ``recv_requires_grad``, from its ``input_args``), else (older
    records) every float one. A float input declared without grad gets none live (its sender
    expects no gradient for it), so it must get none here either."""
    if requires_grad is None or len(requires_grad) != len(received):
        return tuple(t.requires_grad_(t.is_floating_point() or t.is_complex()) for t in received)
    return tuple(
        t.requires_grad_(bool(rg) and (t.is_floating_point() or t.is_complex()))
        for t, rg in zip(received, requires_grad, strict=True)
    )
