"""The discrete-event simulation of one job under one plan: a timeline of training, checkpoints,
incidents and recoveries, repeated with independent draws.

Time advances from event to event: the next checkpoint or the end of the work, or an incident
first (incidents arrive as a Poisson process over wall time, during training, checkpoints and
recoveries alike: an incident in a recovery starts the recovery again, from where training
stands then). Each incident takes one node chosen at random, or with ``correlated_fraction`` its
whole domain; :meth:`Plan.outcome` says where training resumes and what the recovery costs.

Every second of wall time lands in one bucket of the breakdown: useful training, logging
overhead (the slowdown on useful training), lost work (training later rolled back, at the
slowdown it ran at), checkpoint stalls, and the recovery components (detection, restart, load,
copy, replay). They add up to the total.

Never: changes the plan; uses a random generator other than the one it is given.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from replay.sim.strategies import Plan

__all__ = ["RunResult", "StrategyResult", "run_once", "simulate_plan", "BUCKETS"]

BUCKETS = (
    "useful",
    "logging_overhead",
    "lost_work",
    "checkpoint",
    "detection",
    "restart",
    "load",
    "copy",
    "replay",
)


@dataclass
class RunResult:
    """One simulated run: total wall seconds, seconds per bucket, incidents, rollbacks."""

    total_s: float
    buckets: dict[str, float]
    incidents: int
    rollbacks: int


def run_once(plan: Plan, rng: random.Random, trace: Sequence[tuple[float, int]] | None = None) -> RunResult:
    """Simulate ``plan`` until ``inputs.work_s`` of failure-free training is done.

    ``trace``: instead of drawn incidents, these: (failure-free seconds done when it strikes,
    the node it takes), in order; nothing strikes during checkpoints and recoveries then."""
    return _Run(plan, rng, trace).run()


class _Run:
    """One timeline: ``done`` failure-free seconds trained, ``total`` wall seconds spent."""

    def __init__(self, plan: Plan, rng: random.Random, trace: Sequence[tuple[float, int]] | None) -> None:
        self.plan, self.rng = plan, rng
        self.pending = list(trace) if trace is not None else None
        self.o = plan.slowdown
        self.b = dict.fromkeys(BUCKETS, 0.0)
        self.done = self.ck_p = self.ck_m = self.total = 0.0
        self.incidents = self.rollbacks = 0

    def run(self) -> RunResult:
        plan, W = self.plan, self.plan.inputs.work_s
        while self.done < W:
            next_p = self.ck_p + plan.persistent_s
            next_m = self.ck_m + plan.memory_s if plan.memory_s is not None else math.inf
            target = min(next_p, next_m, W)
            need = (target - self.done) * self.o
            f = self.gap(training=True)
            if f < need:  # an incident strikes while training
                self.total += f
                self.done += f / self.o
                self.incident()
                continue
            self.total += need
            self.done = target
            if self.done < W:
                self.checkpoint(persistent=target >= next_p)
        self.b["useful"] = W
        self.b["logging_overhead"] = W * (self.o - 1.0)
        return RunResult(self.total, self.b, self.incidents, self.rollbacks)

    def checkpoint(self, persistent: bool) -> None:
        """Take a checkpoint at ``done``, unless an incident strikes during its stall."""
        stall = self.plan.persistent_stall_s if persistent else self.plan.memory_stall_s
        f = self.gap()
        spent = min(f, stall)
        self.total += spent
        self.b["checkpoint"] += spent
        if f < stall:
            self.incident()
        elif persistent:
            self.ck_p = self.ck_m = self.done
        else:
            self.ck_m = self.done

    def gap(self, training: bool = False) -> float:
        """Wall seconds to the next incident."""
        if self.pending is not None:
            return max(0.0, (self.pending[0][0] - self.done) * self.o) if self.pending and training else math.inf
        rate = self.plan.rate
        return self.rng.expovariate(rate) if rate > 0 else math.inf

    def strike(self) -> set[int]:
        if self.pending is not None:
            return {self.pending.pop(0)[1]}
        nodes, x = self.plan.layout.nodes, self.plan.inputs
        return self.plan.incident_nodes(self.rng.randrange(nodes), self.rng.random() < x.correlated_fraction)

    def incident(self) -> None:
        """Recover; a further incident during the recovery starts it again."""
        while True:
            self.incidents += 1
            resume, cost = self.plan.outcome(self.strike(), self.done, self.ck_p, self.ck_m)
            self.b["lost_work"] += (self.done - resume) * self.o
            self.rollbacks += "replay" not in cost and "copy" not in cost
            self.done = resume
            left = self.gap()
            for name, secs in cost.items():
                spent = min(secs, left)
                self.b[name] += spent
                self.total += spent
                left -= spent
                if spent < secs:
                    break
            else:
                return


@dataclass
class StrategyResult:
    """Replicated runs of one plan: mean total and its 95 % confidence half-width, the mean
    breakdown, and the plan's intervals and notes."""

    strategy: str
    total_s: float
    ci95_s: float
    wasted_fraction: float
    wasted_ci95: float
    breakdown: dict[str, float]
    incidents: float
    rollbacks: float
    persistent_s: float
    memory_s: float | None
    groups: list[int] | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def simulate_plan(plan: Plan, reps: int = 20, seed: int = 0) -> StrategyResult:
    """``reps`` independent runs of ``plan`` (seeded: the same inputs give the same result)."""
    if reps < 2:
        raise ValueError(f"reps must be >= 2 for a confidence interval, got {reps}")
    runs = [run_once(plan, random.Random(seed * 1_000_003 + i)) for i in range(reps)]
    totals = [r.total_s for r in runs]
    W = plan.inputs.work_s
    wasted = [1.0 - W / t for t in totals]
    half = 1.96 * statistics.stdev(totals) / math.sqrt(reps)
    breakdown = {k: statistics.fmean(r.buckets[k] for r in runs) for k in BUCKETS}
    mean_total = statistics.fmean(totals)
    return StrategyResult(
        strategy=plan.strategy.name,
        total_s=mean_total,
        ci95_s=half,
        wasted_fraction=statistics.fmean(wasted),
        wasted_ci95=1.96 * statistics.stdev(wasted) / math.sqrt(reps),
        breakdown={k: v / mean_total for k, v in breakdown.items()},
        incidents=statistics.fmean(r.incidents for r in runs),
        rollbacks=statistics.fmean(r.rollbacks for r in runs),
        persistent_s=plan.persistent_s,
        memory_s=plan.memory_s,
        groups=list(plan.groups) if plan.groups else None,
        notes=list(plan.notes),
    )
