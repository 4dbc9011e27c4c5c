"""A discrete-event simulation of a large job's training time under failures, per recovery strategy.

Public API::

    from replay.sim import LLAMA3_405B, measured_inputs, simulate

    result = simulate(LLAMA3_405B, measured_inputs(), reps=20)
    for row in result.rows:            # one per strategy: total time, wasted fraction, breakdown
        print(row.strategy, row.wasted_fraction)
    result.assumptions                 # every rule and input, measured or assumed

Modules: ``inputs`` (the layout and every input, with its source), ``strategies`` (what each
strategy pays while training and per incident), ``engine`` (the event loop, replications),
``optimize`` (each strategy's best checkpoint intervals and logging groups), ``analytic`` (the
exact expectation it is checked against), ``study`` (sweeps over job size and the inputs that
flip the ranking). The ``swiftlog simulate`` command lives in ``server/cli/simulate.py``.

Never: touches a process group, a store or a model; pure Python and seeded.
"""

from replay.sim.analytic import rollback_expected_time, young_daly_interval
from replay.sim.engine import BUCKETS, StrategyResult, simulate_plan
from replay.sim.inputs import LLAMA3_405B, REPLICATED_405B, Layout, ScaleInputs, measured_inputs
from replay.sim.optimize import best_plan, expected_waste
from replay.sim.strategies import STRATEGIES, Plan, Strategy, make_plan
from replay.sim.study import SimulationResult, flips, simulate, sweep, wasted_series

__all__ = [
    "simulate",
    "sweep",
    "flips",
    "wasted_series",
    "SimulationResult",
    "StrategyResult",
    "simulate_plan",
    "best_plan",
    "expected_waste",
    "make_plan",
    "Plan",
    "Strategy",
    "STRATEGIES",
    "Layout",
    "ScaleInputs",
    "measured_inputs",
    "LLAMA3_405B",
    "REPLICATED_405B",
    "BUCKETS",
    "rollback_expected_time",
    "young_daly_interval",
]
