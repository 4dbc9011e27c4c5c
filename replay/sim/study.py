"""What a user deciding on a strategy asks: each strategy's time and waste for one job, across
job sizes, and which inputs, if they were different, would change the best strategy.

:func:`simulate` plans every strategy that applies (its best intervals and groups, ``optimize``)
and simulates it (``engine``). :func:`sweep` does so at several job sizes (the data-parallel
shard degree grows). :func:`flips` changes one input at a time by a factor and reports where the
first-order ranking's winner changes.

Never: hides a strategy that does not apply: it is listed in ``skipped`` with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from replay.sim.engine import StrategyResult, simulate_plan
from replay.sim.inputs import Layout, ScaleInputs
from replay.sim.optimize import best_plan, expected_waste
from replay.sim.strategies import STRATEGIES, Strategy, assumptions

__all__ = ["SimulationResult", "simulate", "sweep", "flips", "wasted_series", "FLIP_INPUTS"]

# the inputs :func:`flips` varies (numbers that a deployment may well have different)
FLIP_INPUTS = (
    "failures_per_node_hour",
    "correlated_fraction",
    "detect_s",
    "restart_job_s",
    "replace_node_s",
    "ckpt_sync_s",
    "ckpt_write_bps",
    "snapshot_bps",
    "net_bps",
    "logging_overhead",
    "store_requests_per_s",
    "replay_efficiency",
    "activation_bytes",
    "disk_fraction",
)


@dataclass
class SimulationResult:
    """One job simulated under every strategy that applies."""

    layout: Layout
    inputs: ScaleInputs
    rows: list[StrategyResult]
    skipped: dict[str, str]
    reps: int
    seed: int
    assumptions: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> StrategyResult:
        return min(self.rows, key=lambda r: r.total_s)

    def to_dict(self) -> dict[str, Any]:
        x = self.inputs.to_dict()
        sources = x.pop("sources")
        return {
            "layout": {**self.layout.__dict__, "gpus": self.layout.gpus, "nodes": self.layout.nodes},
            "layout_text": self.layout.describe(),
            "strategies": [r.to_dict() for r in self.rows],
            "skipped": self.skipped,
            "best": self.best.strategy,
            "reps": self.reps,
            "seed": self.seed,
            "inputs": x,
            "input_sources": sources,
            "assumptions": self.assumptions,
        }


def _chosen(names: Sequence[str] | None) -> list[Strategy]:
    if names is None:
        return list(STRATEGIES)
    known = {s.name: s for s in STRATEGIES}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown strateg{'ies' if len(bad) > 1 else 'y'} {bad}: choose from {sorted(known)}")
    return [known[n] for n in names]


def simulate(
    layout: Layout,
    inputs: ScaleInputs,
    strategies: Sequence[str] | None = None,
    *,
    reps: int = 20,
    seed: int = 0,
) -> SimulationResult:
    """Every strategy (or the named ones) planned at its best and simulated ``reps`` times."""
    rows: list[StrategyResult] = []
    skipped: dict[str, str] = {}
    for s in _chosen(strategies):
        plan, why = best_plan(s, layout, inputs)
        if plan is None:
            skipped[s.name] = why
            continue
        rows.append(simulate_plan(plan, reps=reps, seed=seed))
    if not rows:
        raise ValueError(f"no strategy applies to {layout.describe()}: {skipped}")
    return SimulationResult(layout, inputs, rows, skipped, reps, seed, assumptions(layout, inputs))


def sweep(
    layout: Layout,
    inputs: ScaleInputs,
    gpus: Sequence[int],
    strategies: Sequence[str] | None = None,
    *,
    reps: int = 10,
    seed: int = 0,
) -> dict[int, SimulationResult]:
    """:func:`simulate` at each job size in ``gpus`` (``layout`` grown in its shard degree)."""
    return {n: simulate(layout.with_gpus(n), inputs, strategies, reps=reps, seed=seed) for n in gpus}


def wasted_series(runs: dict[int, SimulationResult]) -> dict[str, tuple[list[int], list[float]]]:
    """Per strategy, the job sizes it was simulated at and its wasted fraction at each (a sweep's
    lines, e.g. for a plot)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for size, res in sorted(runs.items()):
        for row in res.rows:
            xs, ys = out.setdefault(row.strategy, ([], []))
            xs.append(size)
            ys.append(row.wasted_fraction)
    return dict(sorted(out.items()))


def _ranking(layout: Layout, inputs: ScaleInputs, strategies: Sequence[Strategy]) -> list[tuple[str, float]]:
    out = []
    for s in strategies:
        plan, _ = best_plan(s, layout, inputs)
        if plan is not None:
            out.append((s.name, expected_waste(plan)))
    return sorted(out, key=lambda t: t[1])


def flips(
    layout: Layout,
    inputs: ScaleInputs,
    strategies: Sequence[str] | None = None,
    factors: Sequence[float] = (0.25, 4.0),
    names: Sequence[str] = FLIP_INPUTS,
) -> dict[str, Any]:
    """The first-order ranking, and for each input in ``names`` times each factor the ranking's
    winner; ``flips`` lists the changes that make another strategy the best."""
    chosen = _chosen(strategies)
    base = _ranking(layout, inputs, chosen)
    changes = []
    for name in names:
        value = getattr(inputs, name)
        for k in factors:
            v = value * k
            if name in ("correlated_fraction", "disk_fraction"):
                v = min(max(v, 0.0), 1.0)
            if name == "logging_overhead":
                v = 1.0 + (value - 1.0) * k
            try:
                ranking = _ranking(layout, inputs.with_(**{name: v}), chosen)
            except ValueError:
                continue
            if ranking and ranking[0][0] != base[0][0]:
                changes.append({"input": name, "factor": k, "value": v, "best": ranking[0][0], "ranking": ranking})
    return {"ranking": base, "flips": changes, "factors": list(factors), "inputs": list(names)}
