"""Watching the optimizer and lr-scheduler steps a replay must repeat.

The client holds one :class:`StepWatcher`. It tracks one optimizer (``track_optimizer``) and one
lr scheduler (``track_lr_scheduler``) and gives META what they will do: each param group's
learning rate and other hyperparameters, the scheduler's ``last_epoch`` and next rates. Then it
checks what the loop did:

1. An optimizer step that uses other values than its iteration's META says, or gradients changed
   after the schedule's step other than by the client's gradient operations, amends the META
   (``changed_after_commit``, ``grads_changed``) and is a ``step_after_commit`` fault.
2. Before each schedule step it counts the optimizer and scheduler steps made since the last
   commit. From the first iteration not followed by exactly one of each, every iteration's META is
   amended with its counts (``apply``); an iteration without an optimizer step is a
   ``no_optimizer_step`` fault.
3. Gradients the last optimizer step used and nothing zeroed are reported once
   (``grads_not_zeroed``) and named in META (``grads_carried``).

A replay stops at such a step instead of taking it for another.

Never: raises into the training step (a failed check is a "hook" fault); changes what a step does
or the scheduler's state.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainer_client._meta_log import MetaLog
from trainer_client.checkpoint import scheduler_next_rates
from trainer_client.digest import grad_digest_changes, grad_digests
from trainer_client.meta import hparam_changes, optimizer_hparams
from trainer_client.writer import AsyncLogWriter

__all__ = ["StepWatcher"]

logger = logging.getLogger(__name__)


class StepWatcher:
    """The optimizer and lr scheduler of one stage, as META records them and the loop steps them.

    ``stage_module`` returns the module of the client's pipeline stage (None without one);
    ``stepped`` the iteration whose schedule step finished and is not yet committed or aborted.
    """

    def __init__(
        self,
        stage: int,
        writer: AsyncLogWriter,
        meta: MetaLog,
        *,
        stage_module: Callable[[], torch.nn.Module | None],
        stepped: Callable[[], int | None],
    ) -> None:
        self._stage = stage
        self._writer = writer
        self._meta = meta
        self._stage_module = stage_module
        self._stepped = stepped
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None  # META "lrs", "hparams"
        self._step_hook: Any = None  # its step pre-hook's handle
        self._lr_scheduler: weakref.ref[Any] | None = None  # META "sched_epoch"
        # (iteration, META) committed, its optimizer step not yet seen
        self.step_expect: tuple[int, dict[str, Any]] | None = None
        self._grad_versions: list[int] | None = None  # the gradients' version counters after the schedule's step
        self._apply_checked: int | None = None  # the last iteration whose optimizer / scheduler steps were counted
        # the first iteration not followed by exactly one of each (META "apply_irregular")
        self.apply_irregular: int | None = None
        self._warned_carried = False  # grads_not_zeroed reported (once)
        self._early_step: int | None = None  # an iteration whose optimizer step came before its commit
        self._stepped_grads: list[tuple[Any, int] | None] | None = None  # each gradient at the last step
        # parameters whose gradients the current iteration's schedule step added to, not zeroed
        self.carried: list[str] = []

    # ================================================================ tracking
    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``SwiftlogClient.track_optimizer``: watch ``optimizer``'s steps from now on."""
        if self._optimizer is not None and self._optimizer() is optimizer:
            return
        if self._step_hook is not None:
            self._step_hook.remove()
        self._optimizer = weakref.ref(optimizer)
        me = weakref.ref(self)

        def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            watcher = me()
            if watcher is not None:
                watcher.check_step(opt, kwargs)

        self._step_hook = optimizer.register_step_pre_hook(pre_step)

    def track_lr_scheduler(self, lr_scheduler: Any) -> None:
        """``SwiftlogClient.track_lr_scheduler``: count ``lr_scheduler``'s steps from now on."""
        if lr_scheduler is not None and _last_epoch(lr_scheduler) is not None:
            self._lr_scheduler = weakref.ref(lr_scheduler)

    def close(self) -> None:
        """Stop watching the optimizer's steps."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    # ================================================================ what META records
    def meta_fields(self) -> dict[str, Any]:
        """What META records of the optimizer and scheduler at the commit, and of the gradients the
        loop did not zero: ``grads_carried``, ``lrs``, ``hparams``, ``sched_epoch``, ``sched_next``,
        ``apply_irregular``."""
        return {
            "grads_carried": list(self.carried),
            "lrs": self.learning_rates(),
            "hparams": self.hparams(),
            "sched_epoch": self.sched_epoch(),
            "sched_next": self.sched_next(),
            "apply_irregular": self.apply_irregular,
        }

    def learning_rates(self) -> list[float] | None:
        """Each param group's learning rate now (at commit: what the coming optimizer step uses), of
        the tracked optimizer; None before there is one."""
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is None:
            return None
        try:
            return [float(g["lr"]) for g in opt.param_groups]
        except (KeyError, TypeError, ValueError):  # an optimizer without a scalar lr
            return None

    def hparams(self) -> list[dict[str, Any]] | None:
        """The tracked optimizer's other hyperparameters now (``meta.optimizer_hparams``); None without one."""
        opt = self._optimizer() if self._optimizer is not None else None
        return None if opt is None else optimizer_hparams(opt)

    def sched_next(self) -> list[float] | None:
        """The learning rates the tracked scheduler's next step will set (``scheduler_next_rates``);
        None without one."""
        sch = self._lr_scheduler() if self._lr_scheduler is not None else None
        return None if sch is None else scheduler_next_rates(sch)

    def sched_epoch(self) -> int | None:
        """The tracked lr scheduler's ``last_epoch`` now; None without one."""
        sch = self._lr_scheduler() if self._lr_scheduler is not None else None
        return None if sch is None else _last_epoch(sch)

    # ================================================================ around the schedule step
    def after_schedule_step(self) -> None:
        """Note what the coming optimizer step should find (see :meth:`check_step`). Only with a
        tracked optimizer, whose steps are checked."""
        self._grad_versions = self._grad_snapshot() if self._optimizer is not None else None

    def note_replayed_change(self) -> None:
        """A gradient operation the replay repeats changed the gradients: not a change to report."""
        if self._grad_versions is not None:
            self._grad_versions = self._grad_snapshot()

    def grads_carried(self) -> list[str]:
        """Before a schedule step: the stage's parameters whose gradient is still the one the last
        optimizer step used, untouched.

        The loop did not zero the gradients: this step adds to them, which a replay, starting from
        None, does not. Reported as a ``grads_not_zeroed`` fault once, and the iteration's META
        says so (``grads_carried``). Only with a tracked optimizer. Never raises."""
        snap, self._stepped_grads = self._stepped_grads, None
        mod = self._stage_module()
        if snap is None or mod is None:
            return []
        try:
            carried = [
                n
                for (n, p), s in zip(mod.named_parameters(), snap, strict=False)
                if s is not None and p.grad is not None and s[0]() is p.grad and p.grad._version == s[1]
            ]
        except Exception as e:
            self._writer.note_fault("hook", f"gradient zeroing check: {type(e).__name__}: {e}")
            return []
        if carried and not self._warned_carried:
            self._warned_carried = True
            self._writer.note_fault(
                "grads_not_zeroed",
                f"the gradients of {len(carried)} parameter(s) ({', '.join(carried[:3])}"
                f"{', ...' if len(carried) > 3 else ''}) were not zeroed after the last optimizer step: "
                "this step adds to them, which a replay does not repeat (call optimizer.zero_grad() after "
                "each step); a replay of such an iteration stops there",
            )
        return carried

    # ================================================================ the optimizer step
    def check_step(self, opt: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
        """The optimizer step after the commit: amend the iteration's META if the step uses
        other learning rates / hyperparameters than it says, or gradients changed since the
        schedule's step (version counters; a GradScaler's step). Never raises."""
        expect, self.step_expect = self.step_expect, None
        versions, self._grad_versions = self._grad_versions, None
        mod = self._stage_module()
        if self._optimizer is not None and self._optimizer() is opt and mod is not None:  # seen again at next step()
            self._stepped_grads = [
                None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in mod.parameters()
            ]
        stepped = self._stepped()
        if expect is None and stepped is not None:  # stepped before its commit (not the documented order)
            self._early_step = stepped  # counted all the same
        if expect is None or self._optimizer is None or self._optimizer() is not opt:
            return
        it, doc = expect
        try:
            fields = self._step_changes(opt, kwargs, doc, versions)
            if fields is None:
                return
            self._meta.amend(it, doc, fields)
            self._writer.note_fault(
                "step_after_commit",
                f"iteration {it}: the optimizer step is not what its META says: "
                f"{'; '.join(fields['changed_after_commit'])}; "
                "a replay of this iteration stops there (recovery falls back to the checkpoint): change "
                "hyperparameters before client.commit or through the lr scheduler, and gradients only "
                "through client.clip_grad_norm_ and client.all_reduce_grads_",
                iteration=it,
            )
        except Exception as e:
            self._writer.note_fault("hook", f"optimizer step check: {type(e).__name__}: {e}", iteration=it)

    def _step_changes(
        self, opt: torch.optim.Optimizer, kwargs: dict[str, Any], doc: dict[str, Any], versions: list[int] | None
    ) -> dict[str, Any] | None:
        """The META fields to amend when the coming step differs from ``doc`` (the iteration's
        META): what it uses, what differs, described, and the parameters whose gradients changed.
        None when nothing differs."""
        lrs, hparams = self.learning_rates(), optimizer_hparams(opt)
        grads = self._grads_changed(versions)
        mod = self._stage_module()
        scaled = _stepped_by_grad_scaler(opt, kwargs)
        how = "a GradScaler unscaled them" if scaled else "torch's clip_grad_norm_, a manual scaling"
        if scaled and not grads:  # its unscale kernel leaves the version counters alone
            grads = [n for n, p in (mod.named_parameters() if mod is not None else []) if p.grad is not None]
        if not grads and doc.get("grad_digests") is not None and mod is not None:  # what leaves the counters alone
            now = grad_digests(mod)
            if now is not None:
                grads = grad_digest_changes([n for n, _ in mod.named_parameters()], doc["grad_digests"], now)
                how = (
                    "without touching their version counters: a collective such as dist.all_reduce, "
                    "a write through .data"
                )
        if lrs == doc["lrs"] and hparams == doc["hparams"] and not grads:
            return None
        changed = hparam_changes(doc["lrs"], doc["hparams"], lrs, hparams)
        if grads:
            changed.append(
                f"the gradients of {len(grads)} parameter(s) ({', '.join(grads[:3])}"
                f"{', ...' if len(grads) > 3 else ''}), changed after the schedule's backward other than by "
                f"client.clip_grad_norm_ or client.all_reduce_grads_ ({how})"
            )
        changed = changed or ["the optimizer's hyperparameters"]
        return {"lrs": lrs, "hparams": hparams, "changed_after_commit": changed, "grads_changed": grads}

    # ================================================================ steps between iterations
    def check_apply(self, iteration: int) -> None:
        """Before the schedule step of ``iteration``: count the optimizer and lr-scheduler steps
        made since the commit of ``iteration - 1`` (a replay makes one of each after every
        iteration).

        From the first iteration with another count on, every iteration's META is amended with its
        counts (``apply``): a replay repeats the scheduler's, and stops at an iteration without an
        optimizer step (gradients accumulated over iterations), which is also reported as a
        ``no_optimizer_step`` fault. Never raises."""
        last = self._meta.committed
        if last is None or last[0] != iteration - 1 or self._apply_checked == iteration - 1:
            return
        prev, doc = last
        self._apply_checked = prev
        expect, self.step_expect = self.step_expect, None  # a step still expected for `prev` did not come
        try:
            missed = expect is not None and expect[0] == prev and self._early_step != prev
            opt_steps = None if doc.get("lrs") is None else (0 if missed else 1)
            now, then = self.sched_epoch(), doc.get("sched_epoch")
            sched_steps = None if now is None or then is None else now - then
            irregular = opt_steps == 0 or (sched_steps is not None and sched_steps != 1)
            if irregular and self.apply_irregular is None:
                self.apply_irregular = prev
                logger.info(
                    "stage %d: iteration %d was followed by %s optimizer step(s) and %s lr-scheduler step(s); "
                    "META records them from now on",
                    self._stage,
                    prev,
                    opt_steps,
                    sched_steps,
                )
            if self.apply_irregular is None:
                return
            self._meta.amend(prev, doc, {"apply": {"optimizer_steps": opt_steps, "scheduler_steps": sched_steps}})
            if opt_steps == 0:
                self._writer.note_fault(
                    "no_optimizer_step",
                    f"iteration {prev}: no optimizer step between client.commit({prev}) and "
                    f"client.step({iteration}) (gradients accumulated over iterations?): a replay makes one "
                    "after every iteration, so a replay of this iteration stops there (recovery falls back to "
                    "the checkpoint)",
                    iteration=prev,
                )
        except Exception as e:
            self._writer.note_fault(
                "hook", f"optimizer / scheduler step count: {type(e).__name__}: {e}", iteration=prev
            )

    # ================================================================ internals
    def _grad_snapshot(self) -> list[int] | None:
        """The version counter of each gradient of the stage's module (-1: none); None without a module."""
        mod = self._stage_module()
        return None if mod is None else [-1 if p.grad is None else p.grad._version for p in mod.parameters()]

    def _grads_changed(self, versions: list[int] | None) -> list[str]:
        """Names of the stage's parameters whose gradient changed in place (or was replaced) since
        ``versions`` was taken. Sees what bumps a version counter (torch's in-place ops); not a
        collective (an all_reduce of the gradients) or a write through ``.data``."""
        mod = self._stage_module()
        if versions is None or mod is None:
            return []
        now = self._grad_snapshot() or []
        names = [n for n, _ in mod.named_parameters()]
        return [n for n, a, b in zip(names, versions, now, strict=False) if a != b]


def _last_epoch(sch: Any) -> int | None:
    """A scheduler's ``last_epoch``, or its first part's for a composite without one; None if neither is an int."""
    epoch = getattr(sch, "last_epoch", None)
    if isinstance(epoch, int):
        return epoch
    inner = getattr(sch, "_schedulers", None)
    return _last_epoch(inner[0]) if isinstance(inner, (list, tuple)) and inner else None


def _stepped_by_grad_scaler(opt: torch.optim.Optimizer, kwargs: dict[str, Any]) -> bool:
    """Whether this optimizer step comes from a ``torch.amp.GradScaler`` that unscaled the gradients.

    Its kernel changes them without bumping their version counters. The scaler hands itself or its
    scale to optimizers that take them; otherwise its ``_maybe_opt_step`` is a few frames up."""
    if kwargs.get("grad_scaler") is not None or getattr(opt, "grad_scale", None) is not None:
        return True
    f = sys._getframe(1)
    for _ in range(12):  # this check, the step watcher's, the step hook, torch's step wrappers, then the scaler
        if f is None:
            return False
        if f.f_code.co_name == "_maybe_opt_step" and f.f_code.co_filename.endswith("grad_scaler.py"):
            return True
        f = f.f_back
    return False
