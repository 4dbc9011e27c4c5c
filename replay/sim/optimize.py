"""Choosing each strategy's checkpoint intervals (and logging groups) before simulating it.

:func:`expected_waste` is a first-order model of a plan: the wall time per second of useful
training is ``slowdown x (1 + stall / interval) / (1 - rate x cost)``, where ``cost`` is the mean
of :meth:`Plan.outcome` over sampled incidents striking at uniform points of the intervals (the
same recovery model the simulation runs). :func:`best_plan` searches the intervals on a
logarithmic grid with it; for logging it keeps the logs of one persistent interval within the
disk budget, and for logging groups it asks the group planner (``replay.group_planner``) for the
grouping that fits each candidate interval.

Never: simulates (it only evaluates the closed form on samples); raises for a strategy that does
not apply (it returns None and the reason).
"""

from __future__ import annotations

import math
import random

from replay.errors import BudgetTooSmallError
from replay.group_planner import plan_groups
from replay.profile import JobProfile
from replay.sim.inputs import HOUR, Layout, ScaleInputs
from replay.sim.strategies import Plan, Strategy, make_plan

__all__ = ["expected_waste", "best_plan", "disk_interval_s"]

_SAMPLES = 200


def expected_waste(plan: Plan, samples: int = _SAMPLES, seed: int = 7) -> float:
    """The first-order wasted fraction of ``plan`` (1 - useful / wall); 1.0 when incidents come
    faster than recoveries end."""
    rng = random.Random(seed)
    x = plan.inputs
    cost = 0.0
    for _ in range(samples):
        failed = plan.incident_nodes(rng.randrange(plan.layout.nodes), rng.random() < x.correlated_fraction)
        ck_p = 0.0
        done = rng.random() * plan.persistent_s
        ck_m = ck_p
        if plan.memory_s is not None:
            ck_m = math.floor(done / plan.memory_s) * plan.memory_s
        resume, parts = plan.outcome(failed, done, ck_p, ck_m)
        cost += sum(parts.values()) + (done - resume) * plan.slowdown
    cost /= samples
    stalls = plan.persistent_stall_s / plan.persistent_s
    if plan.memory_s is not None:
        stalls += plan.memory_stall_s / plan.memory_s
    busy = plan.rate * cost
    if busy >= 1.0:
        return 1.0
    ratio = plan.slowdown * (1.0 + stalls) / (1.0 - busy)
    return 1.0 - 1.0 / ratio


def disk_interval_s(inputs: ScaleInputs, groups: tuple[int, ...] | None, pp: int) -> float:
    """The longest persistent interval whose logs fit the disk budget (a node logs at most one
    boundary's two directions; a grouping logs only at its groups' edges)."""
    if groups is not None and all(g == pp for g in groups):
        return math.inf
    per_s = inputs.logged_bytes_per_node_iteration() / inputs.iteration_s
    return inputs.disk_bytes * inputs.disk_fraction / per_s


def _grid(lo: float, hi: float, n: int = 28) -> list[float]:
    lo, hi = max(lo, 1.0), max(hi, lo * 1.0001)
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _groups_for(layout: Layout, inputs: ScaleInputs, interval_s: float, replicas: bool) -> tuple[int, ...] | None:
    """The planner's grouping for one pipeline whose logs over ``interval_s`` must fit each
    node's disk share (in-place recovery; ``replicas``: a stage with a replica needs no logs);
    None when nothing fits."""
    x, S = inputs, layout.pp
    if S < 2:
        return None
    per_it = x.activation_bytes * x.n_microbatches / x.compression
    step = x.iteration_s
    profile = JobProfile(
        run_id="simulated",
        num_stages=S,
        activation_bytes=(per_it,) * (S - 1),
        gradient_bytes=(per_it,) * (S - 1),
        replay_s=(step * x.replay_ratio(layout),) * S,
        step_s=(step,) * S,
        iteration_s=step,
        checkpoint_interval=max(1, round(interval_s / step)),
        fetch_mbps=x.net_bps / 1e6,
        n_microbatches=x.n_microbatches,
        domains=tuple(range(S)),
        replicated=(replicas and layout.dp_replicate > 1,) * S,
        restart_s=x.detect_s + x.replace_node_s,
    )
    try:
        plan = plan_groups(
            profile,
            disk_fraction=x.disk_fraction,
            disk_bytes=x.disk_bytes,
            failures_per_domain_hour=x.failures_per_node_hour * layout.nodes / S,
            recovery="in_place",
        )
    except (BudgetTooSmallError, ValueError):
        return None
    return tuple(plan.sizes)


def best_plan(strategy: Strategy, layout: Layout, inputs: ScaleInputs) -> tuple[Plan | None, str]:
    """The plan of ``strategy`` with the least first-order waste, or (None, why it does not apply)."""
    if strategy.replicas and not strategy.logging and layout.dp_replicate < 2:
        return None, "no replicas in this layout (dp_replicate = 1)"
    probe = make_plan(strategy, layout, inputs, HOUR)
    lo, hi = probe.min_persistent_s, 7 * 24 * HOUR
    best: tuple[float, Plan] | None = None
    for tau in _grid(max(lo, 60.0), hi):
        groups = None
        if strategy.logging:
            if strategy.groups:
                groups = _groups_for(layout, inputs, tau, strategy.replicas)
                if groups is None:
                    continue
            else:
                groups = (1,) * layout.pp
                cap = disk_interval_s(inputs, groups, layout.pp)
                if tau > cap:
                    continue
        mems = [None]
        if strategy.memory_checkpoints:
            mems = [m for m in _grid(max(probe.min_memory_s, 30.0), tau, 12) if m < tau] or [None]
        for mem in mems:
            plan = make_plan(strategy, layout, inputs, tau, mem, groups)
            w = expected_waste(plan)
            if best is None or w < best[0]:
                best = (w, plan)
    if best is None:
        return None, "no checkpoint interval keeps the logs within the disk budget"
    plan = best[1]
    if strategy.logging and not strategy.groups:
        cap = disk_interval_s(inputs, plan.groups, layout.pp)
        if plan.persistent_s * 1.3 > cap:
            plan.notes.append(f"interval limited by the disk budget ({cap / HOUR:.2f} h of logs)")
    return plan, ""
