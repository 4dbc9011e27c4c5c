"""The checks and repeated live calls around each replayed optimizer step, and the checks of sends.

A replay is exact only if it repeats what the live loop did between the schedule's backward and
the next iteration, and proves it where it can:

1. the live ``clip_grad_norm_`` and ``all_reduce_grads_`` calls, in their order, with their logged
   norms and sums (:func:`grad_ops`, :func:`clip_as_logged`, :func:`reduce_as_logged`);
2. the learning rates and hyperparameters the live step used (:func:`check_hyperparameters`);
3. the gradients the live step used, where META has their digests (:func:`check_grad_digests`);
4. the live scheduler steps, their count and the rates they set (:func:`live_steps`,
   :func:`step_scheduler`, :func:`check_scheduled_rates`, and after the last step
   :func:`check_next_rates`);
5. the regenerated boundary sends, against the receivers' digests (:func:`check_sends`);
6. module buffers a backward changed, which end as they did live only in the live order
   (:func:`check_live_interleaving`).

A check that fails on something the replay cannot repeat raises ReplayError naming the stage,
iteration and the difference; a difference the replay can report (a send, a step's gradients)
goes into the report.

Never: guesses a value META does not hold; calls a replay verified that skipped a check it could
make.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from logstore import Channel, RecordKey
from logstore.errors import SwiftlogError
from replay._context import Context
from replay._iteration_plan import IterationPlan
from replay.errors import ReplayError, ReplayInputMissingError, ReplayOrderError
from replay.reader import LogReader
from replay.report import ReplayReport
from replay.stage import StageState
from trainer_client.digest import grad_digest_changes, grad_digests, hex_digests, tensor_digest
from trainer_client.fsdp import clip_grads_with_norm_, local_tensor
from trainer_client.meta import decode_meta, hparam_changes, optimizer_hparams
from trainer_client.replicas import average_gradients_

__all__ = [
    "average_as_live",
    "check_grad_digests",
    "check_hyperparameters",
    "check_live_interleaving",
    "check_next_rates",
    "check_scheduled_rates",
    "check_sends",
    "clip_as_logged",
    "grad_ops",
    "live_steps",
    "reduce_as_logged",
    "step_scheduler",
]


def check_live_interleaving(
    plan: IterationPlan, passes: list[tuple[str, int]], it: int, mb: int, changed: list[tuple[int, str]]
) -> None:
    """A backward changed module buffers (``changed``: (stage, name)): they end as they did live
    only if this replay ran its forwards and backwards exactly as each live stage interleaved them
    (META ``order``). Raises ReplayOrderError naming the buffers otherwise: a parallel replay (shares of
    the micro-batches, shadow forwards) or a group replay of stages whose live orders differ
    cannot reproduce them, and nothing it sends would show it."""
    stages = sorted({k for k, _ in changed})
    ran = [(k, m) for k, m in passes if k != "S"]
    if all(k in plan.metas and [(str(a), int(b)) for a, b in plan.metas[k]["order"]] == ran for k in stages):
        return
    names = ", ".join(f"stage {k} {n}" for k, n in changed[:4]) + (" ..." if len(changed) > 4 else "")
    how = (
        "its live interleaving of forwards and backwards is unknown (no META of the stage)"
        if any(k not in plan.metas for k in stages)
        else "this replay does not run the forwards and backwards as the live stage interleaved them "
        "(a parallel replay splits the micro-batches over workers; a group replay runs one order for stages whose "
        "live orders differ)"
    )
    raise ReplayOrderError(
        f"iteration {it} micro-batch {mb}: the backward changed module buffers ({names}), e.g. a BatchNorm whose "
        "forward activation recomputation re-runs; their values depend on the order of every forward and backward, "
        f"and {how}",
        hint="replay the stage alone with one worker: it then follows the live order",
    )


def check_hyperparameters(st: StageState, it: int, meta: dict[str, Any] | None) -> None:
    """The replay's optimizer is about to step with the learning rates and other hyperparameters
    the live step used (META ``lrs`` and ``hparams``, when the client tracked the optimizer; an
    amended META when the live loop changed them after the commit); raises ReplayError naming the
    first difference otherwise: the live loop changed them in a way the replay does not repeat,
    and every later state would differ."""
    if not meta:
        return
    if meta.get("grads_carried"):
        carried = list(meta["grads_carried"])
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop did not zero the gradients after the previous optimizer "
            "step, so this iteration's backward added to them "
            f"({', '.join(carried[:3])}{', ...' if len(carried) > 3 else ''}); a replay starts every iteration from "
            "no gradients",
            hint="call optimizer.zero_grad() after each optimizer step (a run accumulating across iterations is "
            "recovered from its checkpoint)",
        )
    if meta.get("grads_changed"):
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop changed gradients after the schedule's backward in a way "
            f"the replay does not repeat: {'; '.join(meta.get('changed_after_commit') or [])}",
            hint="clip through client.clip_grad_norm_, sum over ranks through client.all_reduce_grads_; a GradScaler "
            "(fp16) or another change of the gradients before the optimizer step cannot be replayed",
        )
    live_lrs, live_hp = meta.get("lrs"), meta.get("hparams")
    diff = hparam_changes(
        live_lrs,
        live_hp,
        None if live_lrs is None else [float(g["lr"]) for g in st.optimizer.param_groups],
        None if live_hp is None else optimizer_hparams(st.optimizer),
    )
    if not diff:
        return
    after = meta.get("changed_after_commit")
    when = f" (the live step differed from its META as committed: {'; '.join(after)})" if after else ""
    raise ReplayError(
        f"stage {st.stage} iteration {it}: the live optimizer step and the replay's differ: {'; '.join(diff)} (live "
        f"-> replay){when}",
        hint="the replay steps the lr scheduler once after every optimizer step; a loop that sets the learning rate "
        "or another hyperparameter otherwise (a scheduler stepped per epoch, a hand-set value) or a stage factory "
        "whose optimizer / scheduler differs cannot be replayed",
    )


def check_grad_digests(st: StageState, it: int, live: list[str | None], report: ReplayReport) -> None:
    """Compare the gradients the replay's optimizer is about to step with (scaled and clipped as
    logged) with the digests of those the live step used (META ``grad_digests``); a difference is
    recorded in ``report.grad_mismatches`` (the replay is then not verified). Gradients on
    another device than the CPU are not hashed (and the client hashed none there)."""
    mine = grad_digests(st.module)
    if mine is None:
        return
    report.steps_checked += 1
    changed = grad_digest_changes([n for n, _ in st.module.named_parameters()], live, mine)
    if changed:
        report.grad_mismatches.append({"stage": st.stage, "iteration": it, "params": changed})


def check_next_rates(st: StageState, stop: int, reader: LogReader) -> None:
    """After the last replayed step: where the stage's META of iteration ``stop`` is in the logs (a
    replay to a target below the newest logged iteration, or a commit its stage made before dying),
    its learning rates and hyperparameters are what the replay's last scheduler step must have
    produced; raises ReplayError naming the difference otherwise (a stage factory whose scheduler
    computes other rates, e.g. another lambda: no later step of this replay would show it)."""
    key = RecordKey(
        Channel.meta(st.stage), stop, 0
    )  # the document as committed (an amendment says what a later change made)
    try:
        meta = decode_meta(reader.get(key)) if reader.has(key) else None
    except (SwiftlogError, ValueError):
        return
    if not meta or meta.get("lrs") is None:
        return
    live_hp = meta.get("hparams")
    diff = hparam_changes(
        meta.get("lrs"),
        live_hp,
        [float(g["lr"]) for g in st.optimizer.param_groups],
        None if live_hp is None else optimizer_hparams(st.optimizer),
    )
    if diff:
        raise ReplayError(
            f"stage {st.stage}: after the replay's last step, its optimizer has other values than the live one had for "
            f"iteration {stop}: {'; '.join(diff)} (live -> replay)",
            hint="the replacement's lr scheduler computes other learning rates than the live one: build it with the "
            "training's class, arguments and functions (a LambdaLR's lambda)",
        )


def check_scheduled_rates(st: StageState, it: int, live_next: list[float]) -> None:
    """After the scheduler step that follows iteration ``it``'s optimizer step: the rates must be
    those the live scheduler's formula gave for its next epoch (META ``sched_next``: a LambdaLR's
    or MultiplicativeLR's, whose functions the checkpoint cannot carry); raises ReplayError
    naming them otherwise (a replacement factory with another lambda or other arguments to it,
    which, after the last replayed iteration, nothing else would show)."""
    mine = [float(g["lr"]) for g in st.optimizer.param_groups]
    if mine != [float(x) for x in live_next]:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: after the step, the lr scheduler {type(st.lr_scheduler).__name__} set "
            f"the learning rates {mine} where the live one set {list(live_next)}",
            hint="the replacement's stage factory builds its scheduler with another function or other arguments to it "
            "(e.g. a schedule's length) than the training: pass the training's (--model-arg)",
        )


def step_scheduler(st: StageState, it: int) -> None:
    """``lr_scheduler.step()`` as the live loop made it; raises ReplayError when the scheduler's step
    needs arguments the replay does not have (``ReduceLROnPlateau`` steps on a metric)."""
    try:
        st.lr_scheduler.step()
    except TypeError as e:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the lr scheduler {type(st.lr_scheduler).__name__} cannot step without "
            f"arguments ({e})",
            hint="a scheduler stepped on a metric (ReduceLROnPlateau) or an explicit epoch is not replayed: such a "
            "run is recovered from its checkpoint",
        ) from e


def live_steps(st: StageState, it: int, meta: dict[str, Any] | None) -> int:
    """How many times the live loop stepped the stage's lr scheduler after iteration ``it``'s
    optimizer step: once, unless META's ``apply`` (counted by the client before the next
    iteration) says otherwise (a scheduler stepped per epoch). Raises ReplayError when the live
    loop made no optimizer step after ``it`` (gradients accumulated over iterations), when the
    scheduler's step count before this step differs from the live one (``sched_epoch``), and when
    the live loop was seen stepping its scheduler irregularly but the count after ``it`` never
    reached META (the stage died before its next iteration): every later state would differ."""
    if not meta:
        return 1
    apply = meta.get("apply") or {}
    if apply.get("optimizer_steps") == 0:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop made no optimizer step after this iteration (gradients "
            "accumulated over iterations?); a replay makes one after every iteration",
            hint="accumulate within one schedule step (more micro-batches) instead: such a run is recovered from its "
            "checkpoint",
        )
    live_epoch = meta.get("sched_epoch")
    if (
        st.lr_scheduler is not None
        and isinstance(live_epoch, int)
        and getattr(st.lr_scheduler, "last_epoch", live_epoch) != live_epoch
    ):
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live lr scheduler had made {live_epoch} steps (last_epoch) before "
            f"this iteration's optimizer step, the replay's {st.lr_scheduler.last_epoch}",
            hint="the replay repeats the scheduler steps the client counted; a scheduler stepped outside the loop's "
            "apply, or a stage factory whose scheduler differs from the live one, cannot be replayed",
        )
    n = apply.get("scheduler_steps")
    if isinstance(n, int) and n >= 0:
        return n
    if not apply and meta.get("apply_irregular") is not None:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop did not make exactly one optimizer and one lr-scheduler "
            f"step after every iteration (first seen after iteration {meta['apply_irregular']}), and what it made "
            "after this iteration is not logged (the stage died before its next iteration began)",
            hint="recover from the checkpoint; a loop that steps both once per iteration needs no count",
        )
    return 1


def grad_ops(meta: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """The live loop's ``clip_grad_norm_`` ("clip") and ``all_reduce_grads_`` ("reduce"; with its
    call number as ``"call"``) calls of META, in the order they were made (their ``seq``; records
    without one: the clips in their order)."""
    if not meta:
        return []
    ops: list[tuple[int, int, str, dict[str, Any]]] = []
    for j, c in enumerate(meta.get("grad_clip") or ()):
        ops.append((int(c.get("seq", j)), j, "clip", c))
    for j, r in enumerate(meta.get("grad_reduce") or ()):
        ops.append((int(r.get("seq", 0)), j, "reduce", {**r, "call": j}))
    for j, r in enumerate(meta.get("replica_average") or ()):
        ops.append((int(r.get("seq", 0)), j, "average", r))
    ops.sort(key=lambda o: (o[0], o[1]))
    return [(kind, op) for _, _, kind, op in ops]


def average_as_live(ctx: Context, st: StageState, it: int, op: dict[str, Any], report: ReplayReport) -> None:
    """Repeat the live average over the stage's replicas (META ``replica_average``) over the group
    of the replicas replayed together (``ReplayHooks.replica_group``). Raises ReplayError without
    such a group, or when its size is not the live one's: no gradient was logged, only the
    replicas can repeat it."""
    group = ctx.hooks.replica_group
    world = int(op["world"])
    if group is None or dist.get_world_size(group) != world:
        have = "no group of replicas" if group is None else f"a group of {dist.get_world_size(group)}"
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live stage averaged its gradients over {world} replicas "
            f"(ranks {op.get('ranks')}), and this replay has {have}",
            hint="a stage with a live replica is copied from it; when every replica was lost, they are replayed "
            "together (one replacement per replica, ReplayHooks.replica_group)",
        )
    params = [p for p in st.module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # checked after it, with every step: META's grad_digests are those the average left
    average_gradients_([local_tensor(p.grad) for p in params], group, int(op["bucket_bytes"]))  # FSDP: shards


def reduce_as_logged(ctx: Context, st: StageState, it: int, op: dict[str, Any], report: ReplayReport) -> None:
    """Repeat one live ``client.all_reduce_grads_`` call: check the replay's own gradients of its
    parameters against the digests taken before the live reduction (META ``pre``, CPU; a difference
    goes into ``report.grad_mismatches``), then put the logged reduced gradients in their place
    (record ``reduced_{stage}`` / iteration / call, a part per parameter). Raises
    ReplayInputMissingError when the record is missing, ReplayError when it does not fit."""
    params = list(st.module.parameters())
    names = [n for n, _ in st.module.named_parameters()]
    call = int(op["call"])
    try:
        chosen = [params[i] for i in op["params"]]
    except (KeyError, IndexError, TypeError) as e:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: META's grad_reduce entry {op!r} does not fit the stage's {len(params)} "
            f"parameters ({e})"
        ) from e
    for p in chosen:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    pre = op.get("pre")
    mine = hex_digests([p.grad for p in chosen]) if pre is not None and ctx.checks_step(it) else None
    if mine is not None:
        changed = grad_digest_changes([names[i] for i in op["params"]], pre, mine)
        if changed:
            report.grad_mismatches.append(
                {"stage": st.stage, "iteration": it, "params": changed, "at": f"before all_reduce_grads_ call {call}"}
            )
    logged = ctx.reader.require_parts(Channel.reduced(st.stage), it, call)
    if len(logged) != len(chosen) or any(
        t.shape != p.shape or t.dtype != p.grad.dtype for t, p in zip(logged, chosen, strict=False)
    ):
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the logged reduced gradients of all_reduce_grads_ call {call} "
            f"({[(tuple(t.shape), str(t.dtype)) for t in logged]}) do not fit its parameters "
            f"({[(tuple(p.shape), str(p.grad.dtype)) for p in chosen]})"
        )
    with torch.no_grad():
        for p, t in zip(chosen, logged, strict=True):
            p.grad.copy_(t)


def clip_as_logged(st: StageState, it: int, clip: dict[str, Any], dev: torch.device) -> None:
    """Repeat one live ``client.clip_grad_norm_`` call: the same parameters, max norm and total norm
    (the logged value: the norm may have spanned other stages' gradients), through the same torch
    function, so the clipped gradients are bit-identical."""
    params = list(st.module.parameters())
    idx = clip.get("params")
    try:
        chosen = params if idx is None else [params[i] for i in idx]
        total = torch.tensor(float(clip["total_norm"]), dtype=getattr(torch, str(clip["dtype"])), device=dev)
        max_norm = float(clip["max_norm"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: META's grad_clip entry {clip!r} does not fit the stage's {len(params)} "
            f"parameters ({e})"
        ) from e
    clip_grads_with_norm_(chosen, max_norm, total, clip.get("foreach"))  # sharded gradients too


def check_sends(
    ctx: Context,
    data_channel: Channel,
    digest_channel: Channel,
    it: int,
    mb: int,
    tensors: Sequence[torch.Tensor],
    check: bool,
    report: ReplayReport,
) -> None:
    reader = ctx.reader
    for part, sent in enumerate(tensors):
        key = RecordKey(data_channel, it, mb, part)
        report.sends_generated += 1
        if not (ctx.keep_sends or (check and (ctx.verify or ctx.compare_logged))):
            continue
        t = sent.detach().cpu()  # digests and logged records are host bytes (no copy on CPU)
        if ctx.keep_sends:
            report.sends[key] = t.clone() if sent.device.type == "cpu" else t
        if ctx.verify and check:
            want = reader.digest(digest_channel.src, digest_channel.dst, it, mb, part)
            if want is None:
                report.digests_missing.append(str(key))
            else:
                report.digests_checked += 1
                if tensor_digest(t) != want:
                    report.digest_mismatches.append(str(key))
        if ctx.compare_logged and check:
            try:
                logged = reader.get(key)
            except ReplayInputMissingError:
                continue
            report.records_checked += 1
            if logged.dtype != t.dtype or logged.shape != t.shape or not torch.equal(logged, t):
                report.record_mismatches.append(str(key))
    if (
        ctx.verify and check
    ):  # a part the live stage sent (its receiver kept a digest) that the replay did not send differs too
        for part in reader.logged_parts(digest_channel, it, mb):
            if part >= len(tensors):
                report.digest_mismatches.append(str(RecordKey(data_channel, it, mb, part)))
