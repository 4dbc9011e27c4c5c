"""Where a replay unit's records come from, whether they read intact, and how long the replay takes.

:func:`fetch_items` chooses, for every record a unit needs, the source it is read from: a
survivor's hot tier first, then the cold tier, a failed stage's hot tier last. It groups the
records into :class:`~replay.plan_types.FetchItem` runs. :func:`check_records` reads them and
checks their checksums (``check_records=True``). :func:`estimate` turns bytes and the live step
time into seconds, with the rates the module docstring of ``replay.plan`` documents.

Never: writes to a store.
"""

from __future__ import annotations

import statistics
from typing import Any

from logstore import Channel, RecordInfo, RecordKey
from logstore.errors import SwiftlogError
from replay._plan_index import LogIndex
from replay.plan_types import FetchItem, ReplayUnit

__all__ = ["DEFAULT_COLD_MBPS", "DEFAULT_HOT_MBPS", "check_records", "estimate", "fetch_items", "tier_rates"]

#: assumed read rate of a surviving node's hot tier (MB/s), when ``bandwidth_mbps`` is not given
DEFAULT_HOT_MBPS = 400.0
#: assumed read rate of the cold tier (MB/s), when ``bandwidth_mbps`` is not given
DEFAULT_COLD_MBPS = 100.0


def tier_rates(bandwidth: float | None, rates: dict[str, float] | None) -> tuple[float, float]:
    """The (hot, cold) fetch rates in MB/s: ``bandwidth`` for both if given, else the measured
    ``rates`` of a tier (``{"hot": .., "cold": ..}``), else the documented assumption."""
    if bandwidth:
        return bandwidth, bandwidth
    rates = rates or {}
    return rates.get("hot") or DEFAULT_HOT_MBPS, rates.get("cold") or DEFAULT_COLD_MBPS


def fetch_items(
    logs: LogIndex, u: ReplayUnit, chans: list[tuple[Channel, str]], lo: int, hi: int, failed_writers: set[str]
) -> None:
    def rank(info: RecordInfo) -> int:  # hot on a survivor < cold < hot on a failed node
        return 1 if info.tier == "cold" else (2 if info.writer in failed_writers else 0)

    listers = [(i, s) for i, s in enumerate(logs.stores)] + logs.cold_views()
    for ch, purpose in chans:
        chosen: dict[RecordKey, tuple[int, RecordInfo]] = {}
        for i, s in listers:
            after: RecordKey | None = None
            try:
                while True:
                    page = s.list_records(ch, lo, hi, after=after, limit=1000)
                    if not page:
                        break
                    for info in page:
                        prev = chosen.get(info.key)
                        if prev is None or rank(info) < rank(prev[1]):
                            chosen[info.key] = (i, info)
                    after = page[-1].key
            except SwiftlogError as e:
                logs.warnings.append(f"listing {ch.name} in {logs.describe(s)} failed: {e}")
        runs: dict[tuple[int, str, str], FetchItem] = {}
        for key in sorted(chosen):
            i, info = chosen[key]
            item = runs.get((i, info.tier, info.writer))
            if item is None:
                item = runs[(i, info.tier, info.writer)] = FetchItem(
                    channel=ch.name,
                    purpose=purpose,
                    source=i,
                    tier=info.tier,
                    writer=info.writer,
                    first_iteration=key.iteration,
                    last_iteration=key.iteration,
                    records=0,
                    bytes=0,
                    on_failed_node=info.tier == "hot" and info.writer in failed_writers,
                )
            item.first_iteration = min(item.first_iteration, key.iteration)
            item.last_iteration = max(item.last_iteration, key.iteration)
            item.records += 1
            item.bytes += info.stored_bytes
        for item in runs.values():
            u.fetch.append(item)
            u.records += item.records
            u.bytes += item.bytes
            if item.on_failed_node and not any("failed stage's node" in w for w in u.warnings):
                u.warnings.append(
                    f"{item.channel} is read from the hot tier of writer {item.writer} (a failed stage's node): "
                    "reachable only if that disk survived; flush or ship it to the cold tier"
                )


def check_records(logs: LogIndex, u: ReplayUnit, chans: list[Channel], lo: int, hi: int) -> None:
    for ch in chans:
        for it in range(lo, hi):
            for mb, parts in sorted(logs.index(ch, lo).get(it, {}).items()):
                for part in sorted(parts):
                    key = RecordKey(ch, it, mb, part)
                    errs = []
                    for s in logs.stores:
                        try:
                            s.get_blob(key)
                            errs = []
                            break
                        except SwiftlogError as e:
                            errs.append(e)
                    if errs:
                        u.reasons.append(f"record {key} cannot be read intact: {errs[-1]}")
                        u.missing.append(str(key))
                        return


def estimate(
    u: ReplayUnit,
    S: int,
    *,
    bandwidth: float | None,
    replay_s: float | None,
    workers: int,
    metas: dict[tuple[int, int], dict[str, Any] | None],
    rates: dict[str, float] | None = None,
) -> None:
    hot, cold = tier_rates(bandwidth, rates)
    fetch_s = sum(f.bytes / ((hot if f.tier == "hot" else cold) * 1e6) for f in u.fetch)
    per_it: float | None = None
    basis = ""
    if replay_s is not None:
        per_it = replay_s * len(u.stages)
        basis = f"replay_seconds_per_iteration={replay_s} x {len(u.stages)} stage(s)"
    else:
        lo = u.checkpoint_iteration or 0
        hi = u.stop_iteration or lo
        steps = [
            float(m["step_s"])
            for (_, it), m in metas.items()
            if lo <= it < hi and m and isinstance(m.get("step_s"), (int, float))
        ]
        n = u.n_microbatches
        if steps and n:
            step = statistics.median(steps)
            per_it = step * n / (n + S - 1) * len(u.stages)
            basis = f"live step {step:.4f} s (median of META) x n/(n+S-1) = {n}/{n + S - 1} x {len(u.stages)} stage(s)"
    if per_it is None:
        u.estimate = {
            "fetch_seconds": fetch_s,
            "replay_seconds": None,
            "total_seconds": None,
            "workers": workers,
            "basis": "no live step time in META and replay_seconds_per_iteration not given",
        }
        return
    replay_s = per_it * u.iterations
    total = max(fetch_s, replay_s / workers) + (fetch_s / u.iterations if u.iterations else 0.0)
    u.estimate = {
        "fetch_seconds": fetch_s,
        "replay_seconds": replay_s,
        "seconds_per_iteration": per_it,
        "total_seconds": total,
        "workers": workers,
        "basis": basis,
    }
