"""Closed forms the simulation is checked against.

:func:`rollback_expected_time` is the exact expected wall time of a job with periodic
checkpoints under exponential failures (Daly 2006, with failures allowed during restarts): a
segment of ``s`` seconds (work and the checkpoint that ends it) that restarts after ``D``
seconds of recovery whenever a failure strikes takes ``exp(rate D) (exp(rate s) - 1) / rate``
on average. :func:`young_daly_interval` is the first-order best interval, sqrt(2 stall MTBF).

Never: approximates where the name says exact.
"""

from __future__ import annotations

import math

__all__ = ["rollback_expected_time", "young_daly_interval"]


def rollback_expected_time(work_s: float, interval_s: float, stall_s: float, recovery_s: float, rate: float) -> float:
    """Expected wall time to finish ``work_s`` of training in segments of ``interval_s``, each but
    the last followed by a checkpoint of ``stall_s``, every failure (rate ``rate`` per second, at
    any time) costing ``recovery_s`` and the segment's progress."""
    if rate <= 0:
        n = math.ceil(work_s / interval_s - 1e-12)
        return work_s + (n - 1) * stall_s
    full = math.floor(work_s / interval_s + 1e-12)
    last = work_s - full * interval_s
    k = math.exp(rate * recovery_s) / rate
    segments = [interval_s + stall_s] * full
    if last > 1e-9:
        segments.append(last)
    else:
        segments[-1] = interval_s  # the final segment ends the job, not with a checkpoint
    return sum(k * math.expm1(rate * s) for s in segments)


def young_daly_interval(stall_s: float, mtbf_s: float) -> float:
    """The first-order best checkpoint interval."""
    return math.sqrt(2.0 * stall_s * mtbf_s)
