"""What the benches read from a run of the example scripts: iteration times, logging overhead.

Never used by the library itself; bench only.
"""

from __future__ import annotations

import statistics
from typing import Any

from replay.launcher import RecoveryRun

__all__ = ["iteration_times", "logging_overhead"]


def iteration_times(r: RecoveryRun) -> dict[int, float]:
    """Iteration i's time: the slowest rank's (end of i - end of i - 1)."""
    out: dict[int, float] = {}
    for res in r.results.values():
        ends = {it: t for it, t, _ in res["iteration_end"]}
        for it in ends:
            if it - 1 in ends:
                out[it] = max(out.get(it, 0.0), ends[it] - ends[it - 1])
    return out


def logging_overhead(r: RecoveryRun, block: int) -> dict[str, Any]:
    """A run with logging on and off in alternating blocks of ``block`` iterations
    (``--alternate-logging``): each unlogged iteration's time against its logged neighbours', the
    median over the pairs (``overhead_ratio``), their quartiles, and the client's own costs per
    rank (from its stats)."""
    times = iteration_times(r)
    logged = lambda i: (i // block) % 2 == 0  # noqa: E731
    ratios = []
    for i, t in times.items():
        if logged(i) or i - 1 not in times or i + 1 not in times:
            continue
        # the nearest logged iterations on both sides (block 2: i - 1 or i - 2, i + 1 or i + 2)
        left = next((times[j] for j in range(i - 1, i - block - 1, -1) if j in times and logged(j)), None)
        right = next((times[j] for j in range(i + 1, i + block + 1) if j in times and logged(j)), None)
        if left is not None and right is not None:
            ratios.append((left + right) / 2 / t)
    on = [t for i, t in times.items() if logged(i)]
    off = [t for i, t in times.items() if not logged(i)]
    q = statistics.quantiles(ratios, n=4)
    client = {}
    for k, res in sorted(r.results.items()):
        w, c = res["client_stats"]["writer"], res["client_stats"]["commit"]
        client[k] = {
            "training_thread_s": w["submit_s"] + w["digest_s"],
            "encode_cpu_s": w["encode_cpu_s"],
            "write_cpu_s": w["write_cpu_s"],
            "ship_wait_s": c["ship_wait_s"],
            "commit_wait_s": c["wait_s"],
        }
    return {
        "overhead_ratio": statistics.median(ratios),
        "ratio_iqr": [q[0], q[2]],
        "client": client,
        "overhead_ratio_medians": statistics.median(on) / statistics.median(off),
        "iteration_s_logged": statistics.median(on),
        "iteration_s_unlogged": statistics.median(off),
        "pairs": len(ratios),
    }
