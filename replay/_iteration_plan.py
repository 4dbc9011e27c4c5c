"""How one iteration of a replay runs: :func:`plan_iteration` and :func:`passes`.

:func:`plan_iteration` reads the replayed stages' META records of the iteration (or, without
them, another stage's of an ascending schedule) and returns an :class:`IterationPlan`: the number
of micro-batches, the live forward and backward orders, the gradient scale, the thread count,
which micro-batches this process replays (``ReplayHooks.select``) and whether it runs the other
workers' forwards too (``ReplayHooks.shadow_forwards``). :func:`passes` turns a plan into the
order of forwards and backwards the replay runs.

Never: consumes RNG or touches a module (the prefetch thread plans iterations ahead too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from logstore import Channel, RecordKey
from replay._context import Context
from replay.errors import ReplayError, ReplayInputMissingError
from replay.report import ReplayReport
from trainer_client.determinism import SEED_SCHEME, environment_differences

__all__ = ["ASCENDING_SCHEDULES", "IterationPlan", "passes", "plan_iteration"]

logger = logging.getLogger(__name__)

#: schedules whose every stage runs forward and backward in ascending micro-batch order
ASCENDING_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


@dataclass(slots=True)
class IterationPlan:
    n_mb: int
    fwd_order: list[int]
    bwd_order: list[int]
    scale: int
    threads: int | None
    mine: list[int]  # micro-batches replayed here, in backward order
    input_kwargs: tuple[str, ...] = ()  # stage 0: names of the logged inputs after the positional ones
    shadow: bool = False  # also the forwards of the other micro-batches (module buffers; ReplayHooks.shadow_forwards)
    metas: dict[int, dict[str, Any]] = field(
        default_factory=dict
    )  # stage -> its META record of the iteration (when logged)
    live_order: list[tuple[str, int]] | None = (
        None  # run the passes exactly as the live stage interleaved them (see passes)
    )

    def logged(self, stage: int, key: str) -> Any:
        """Field ``key`` of ``stage``'s META (None without it): its ``grad_clip`` calls, ``autocast``
        regions, ``lrs``."""
        return self.metas.get(stage, {}).get(key)


def plan_iteration(ctx: Context, it: int, report: ReplayReport | None) -> IterationPlan:
    """How iteration ``it`` ran live (from META), restricted to the micro-batches replayed here.

    ``report`` None (the prefetch thread) records no warnings.
    """
    reader, states = ctx.reader, ctx.states
    metas = {s.stage: reader.meta(s.stage, it) for s in states}
    present = {k: m for k, m in metas.items() if m is not None}
    stand_in: tuple[int, dict[str, Any]] | None = None
    if not present:
        for k in sorted(range(ctx.num_stages), key=lambda k: (abs(k - ctx.first), k)):
            if k in metas:
                continue
            m = reader.meta(k, it)
            if m is not None and m.get("schedule") in ASCENDING_SCHEDULES and not m.get("split_backward"):
                stand_in = (k, m)
                break
    if not present and stand_in is None:
        if ctx.n_mb_arg is None:
            key = RecordKey(Channel.meta(states[0].stage), it, 0)
            raise ReplayInputMissingError(
                f"iteration {it}: no META record of stages {list(metas)} (nor of another stage) and n_microbatches "
                "not given",
                key=key,
                hint="pass n_microbatches (and scale_grads) explicitly, or ship META to the cold tier",
            )
        if report is not None and it == report.start_iteration:
            report.warnings.append(f"no META for stages {list(metas)}: assuming ascending micro-batch order")
        n = ctx.n_mb_arg
        scale = n if ctx.scale_arg in (None, True) else 1
        order = list(range(n))
        return IterationPlan(n, order, order, scale, None, _select(ctx, it, order), shadow=_shadow(ctx, it))
    if present:
        m0 = next(iter(present.values()))
    else:
        assert stand_in is not None
        k_in, m0 = stand_in
        note = (
            f"iteration {it}: no META of stages {list(metas)}; using stage {k_in}'s ({m0.get('schedule')}: ascending "
            "micro-batch order on every stage); what only a stage's own META says (its autocast regions, "
            "clip_grad_norm_ calls, learning rates) is unknown, so a run that used them does not verify: give the "
            "replay the stage's META (a replacement reads it from the commit store)"
        )
        if report is not None:
            if it not in report.unknown_steps:
                report.unknown_steps.append(it)
            if it == report.stop_iteration - 1:
                last = (
                    f"the last iteration ({it}) was replayed with stage {k_in}'s META: no later send checks its "
                    "optimizer step, so the result is not verified"
                )
                if last not in report.warnings:
                    report.warnings.append(last)
            if not any("no META of stages" in w for w in report.warnings):
                report.warnings.append(note)
                logger.warning("replay: %s (further iterations alike are not reported)", note)
    if m0.get("seed_scheme") != SEED_SCHEME:
        raise ReplayError(f"iteration {it}: logged seed scheme {m0.get('seed_scheme')!r} is not {SEED_SCHEME!r}")
    n = ctx.n_mb_arg or int(m0["n_microbatches"])
    if present:
        # the order the weight gradients were summed in: whole backwards ("B") and the weight halves
        # ("W") of split ones; the replay runs whole backwards in it (the input halves' order is moot)
        bwd = {k: [mb for kind, mb in m["order"] if kind in ("B", "W")] for k, m in present.items()}
        fwd = [mb for kind, mb in m0["order"] if kind == "F"]
        orders = {tuple(v) for v in bwd.values()}
        if len(orders) != 1:
            raise ReplayError(
                f"iteration {it}: stages {sorted(bwd)} ran backward in different micro-batch orders {orders}; a group "
                "replay needs one order"
            )
        bwd_order = list(orders.pop())
        if sorted(bwd_order) != list(range(n)) or sorted(fwd) != list(range(n)):
            raise ReplayError(
                f"iteration {it}: META order {m0['order']} does not cover {n} micro-batches once each (incomplete "
                "iteration?)"
            )
    else:
        fwd = bwd_order = list(range(n))
    if ctx.scale_arg is None:
        scale = int(m0.get("grad_scale_factor", n))
    else:
        scale = n if ctx.scale_arg else 1
    env = m0.get("env", {})
    if report is not None and it == report.start_iteration:
        diff = environment_differences(env)
        if (
            env.get("cuda_device") and ctx.device.type != "cuda"
        ):  # its kernels and dropout masks are not reproducible here
            diff["cuda_device"] = (env["cuda_device"], f"replay on {ctx.device}")
        if diff:
            report.warnings.append(f"environment differs from the live run: {diff}")
            logger.warning("replay: environment differs from the live run: %s", diff)
    kw = tuple(present[0].get("input_kwargs") or ()) if 0 in present else ()
    varies = sorted(k for k, m in present.items() if m.get("autocast_varies"))
    if varies:
        raise ReplayError(
            f"iteration {it}: stages {varies} ran their forwards under different autocast settings in one iteration; "
            "the replay cannot tell which ran how",
            hint="enter torch.autocast around the whole schedule step (client.step), not around some micro-batches",
        )
    shadow = _shadow(ctx, it)
    live_order = None
    if (
        (ctx.buffers or ctx.hooks.live_order)
        and all(st.stage in present for st in states)
        and ctx.hooks.select is None
        and ctx.hooks.claim is None
        and not shadow
    ):
        # a split backward runs whole where its weight half ran (the gradients are summed in that order)
        orders = {
            tuple(
                ("B" if kind == "W" else str(kind), int(mb)) for kind, mb in present[st.stage]["order"] if kind != "I"
            )
            for st in states
        }
        if len(orders) == 1:  # one stage, or a group whose stages ran one order (GPipe)
            live_order = list(orders.pop())
    return IterationPlan(
        n, fwd, bwd_order, scale, env.get("num_threads"), _select(ctx, it, bwd_order), kw, shadow, present, live_order
    )


def _shadow(ctx: Context, it: int) -> bool:
    return ctx.hooks.shadow_forwards is not None and bool(ctx.hooks.shadow_forwards(it))


def _select(ctx: Context, it: int, bwd_order: list[int]) -> list[int]:
    if ctx.hooks.select is None:
        return list(bwd_order)
    chosen = set(ctx.hooks.select(it, bwd_order))
    if not chosen <= set(bwd_order):
        raise ReplayError(f"iteration {it}: selected micro-batches {sorted(chosen - set(bwd_order))} do not exist")
    return [mb for mb in bwd_order if mb in chosen]


def passes(plan: IterationPlan) -> list[tuple[str, int]]:
    """The order this replay runs its micro-batches' passes: ("F", mb), ("B", mb) and ("S", mb).

    Forwards in the live forward order (module buffers such as running statistics are updated in
    that order), backwards in the live backward order (the order of the gradient sums), and each
    backward as soon as its forward has run: with equal orders (GPipe and 1F1B replayed alone)
    F0 B0 F1 B1 ..., so one micro-batch's activations are alive instead of all of them (less
    memory than the live GPipe schedule, warm caches). Only this replay's micro-batches
    (``plan.mine``); with ``plan.shadow`` the others' forwards too ("S": shadow forwards, for the
    buffers only), each at its place in the forward order.

    A stage replayed alone whose module has buffers (or a group whose stages all ran one order)
    runs its passes exactly as the live stage interleaved them (``plan.live_order``, META
    ``order``): a buffer that a backward changes
    (BatchNorm inside activation recomputation updates its statistics again when the backward
    re-runs its forward) ends as it did live only in the live order. Memory is then the live
    schedule's (GPipe: every micro-batch's activations at once).
    """
    if plan.live_order is not None:
        return list(plan.live_order)
    mine = set(plan.mine)
    pending = iter([mb for mb in plan.fwd_order if mb in mine or plan.shadow])
    done: set[int] = set()
    out: list[tuple[str, int]] = []
    for mb in plan.bwd_order:
        if mb not in mine:
            continue
        while mb not in done:
            f = next(pending)
            out.append(("F" if f in mine else "S", f))
            done.add(f)
        out.append(("B", mb))
    out += [("S", f) for f in pending]  # every forward of this replay's own micro-batches has run
    return out
