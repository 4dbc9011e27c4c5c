"""``LogStore.stats``: records and bytes per tier and channel, from the indexes and the listing.

Never: reads record bytes; raises when the cold tier cannot be listed (its ``error`` says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from logstore._cold_index import ColdIndex
from logstore.cold import ColdTier
from logstore.errors import SwiftlogError
from logstore.hot import EVICTED, OPEN, SEALED, UPLOADED, HotTier
from logstore.keys import Channel

__all__ = ["store_stats"]


class _ChannelTotals:
    """Per channel and tier: records, stored and raw bytes, the iteration range."""

    def __init__(self) -> None:
        self.chans: dict[str, dict[str, Any]] = {}

    def add(self, name: str, tier: str, lo: int, hi: int, records: int, stored: int, raw: int) -> None:
        c = self.chans.setdefault(name, {}).setdefault(
            tier, {"records": 0, "stored_bytes": 0, "raw_bytes": 0, "lo": lo, "hi": hi}
        )
        c["records"] += records
        c["stored_bytes"] += stored
        c["raw_bytes"] += raw
        c["lo"], c["hi"] = min(c["lo"], lo), max(c["hi"], hi)


def store_stats(
    run: str,
    hots: list[HotTier],
    cold: ColdTier | None,
    cold_index: ColdIndex | None,
    upload: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The dict ``LogStore.stats`` returns; ``upload()`` gives its ``"upload"`` part."""
    chans = _ChannelTotals()
    hot_tot = _hot_totals(hots, chans)
    # a segment's lo predates GC's deletions in it: the first live record is the range's start
    for name, tiers in chans.chans.items():
        firsts = [k.iteration for hot in hots for k, _ in hot.keys(Channel.parse(name), limit=1)]
        if firsts:
            tiers["hot"]["lo"] = min(firsts)
    cold_tot = _cold_totals(cold, cold_index, chans) if cold is not None and cold_index is not None else None
    stored = hot_tot["stored_bytes"] or 0
    return {
        "run": run,
        "hot": hot_tot,
        "cold": cold_tot,
        "compression_ratio": (hot_tot["raw_bytes"] / stored) if stored else None,
        "channels": chans.chans,
        "upload": upload(),
    }


def _hot_totals(hots: list[HotTier], chans: _ChannelTotals) -> dict[str, Any]:
    """What the hot tiers hold, and what GC deleted from them (``collected``)."""
    hot_tot: dict[str, Any] = {
        "records": 0,
        "stored_bytes": 0,
        "raw_bytes": 0,
        "disk_bytes": 0,
        "segments": {OPEN: 0, SEALED: 0, UPLOADED: 0, EVICTED: 0},
    }
    collected: dict[int, dict[str, int]] = {}  # owner stage -> what GC deleted from these hot tiers
    hot_tot["collected"] = collected
    for hot in hots:
        hot_tot["disk_bytes"] += hot.disk_bytes()
        for stage, c in hot.collected().items():
            t = collected.setdefault(stage, {"records": 0, "stored_bytes": 0, "below": 0})
            t["records"], t["stored_bytes"] = t["records"] + c["records"], t["stored_bytes"] + c["stored_bytes"]
            t["below"] = max(t["below"], c["below"])
        for m in hot.segments():
            hot_tot["segments"][m.state] = hot_tot["segments"].get(m.state, 0) + 1
            if m.state == EVICTED or m.live <= 0:
                continue
            hot_tot["records"] += m.live
            hot_tot["stored_bytes"] += m.live_bytes
            hot_tot["raw_bytes"] += m.raw_bytes
            chans.add(m.channel, "hot", m.lo, m.hi, m.live, m.live_bytes, m.raw_bytes)
    return hot_tot


def _cold_totals(cold: ColdTier, cold_index: ColdIndex, chans: _ChannelTotals) -> dict[str, Any]:
    """What the cold tier's listing holds; ``error`` when it cannot be listed."""
    cold_tot: dict[str, Any] = {
        "segments": 0,
        "records": 0,
        "stored_bytes": 0,
        "raw_bytes": 0,
        "object_bytes": 0,
        "error": None,
    }
    cold_tot["fenced_writes"] = cold.fenced_writes(probe=False)  # None until an upload probed it
    try:
        for seg in cold_index.segments(None, refresh=True):
            cold_tot["segments"] += 1
            cold_tot["records"] += seg.records
            cold_tot["stored_bytes"] += seg.stored_bytes
            cold_tot["raw_bytes"] += seg.raw_bytes
            cold_tot["object_bytes"] += seg.size
            chans.add(seg.channel.name, "cold", seg.lo, seg.hi, seg.records, seg.stored_bytes, seg.raw_bytes)
    except SwiftlogError as e:
        cold_tot["error"] = str(e)
    return cold_tot
