"""Run summaries: computed from a store's statistics and registrations, cached stale-while-revalidate.

:func:`summarize` builds a :class:`~server.models.RunSummary` from one run's store: stages,
channels and iteration ranges per tier, bytes, checkpoints, watermarks and gaps. With the object
store unreachable it says what this node knows and names the parts that may miss more
(``incomplete``). :class:`SummaryCache` serves summaries younger than ``ttl`` as they are; up to
``max_stale`` old as they are while one background thread recomputes them; older or missing,
computed in the caller's thread (one computation per run at a time).

Never: serves a summary computed before an invalidation that happened while it was computed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from logstore.errors import ColdTierError, ColdTierUnavailableError
from logstore.keys import Channel
from logstore.store import LogStore, writers_under
from server._views import checkpoint_view, kind_name
from server.models import (
    ChannelSummary,
    ColdTierSummary,
    Collected,
    Gap,
    HotTierSummary,
    RunSummary,
    SegmentStates,
    TierRange,
    Watermark,
)

__all__ = ["SummaryCache", "summarize"]

logger = logging.getLogger(__name__)


class SummaryCache:
    """Per-run summaries, stale-while-revalidate (see the module docstring)."""

    def __init__(self, compute: Callable[[str], RunSummary], ttl: float, max_stale: float) -> None:
        self._compute = compute
        self._ttl = ttl
        self._max_stale = max(max_stale, ttl)
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, RunSummary]] = {}
        self._gen: dict[str, int] = {}
        self._run_locks: dict[str, threading.Lock] = {}
        self._refreshing: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swiftlog-summary")

    def _run_lock(self, run: str) -> threading.Lock:
        with self._lock:
            return self._run_locks.setdefault(run, threading.Lock())

    def get(self, run: str) -> RunSummary:
        now = time.monotonic()
        with self._lock:
            e = self._entries.get(run)
        if e is not None:
            age = now - e[0]
            if age <= self._ttl:
                return e[1]
            if age <= self._max_stale:
                self._refresh_soon(run)
                return e[1]
        with self._run_lock(run):  # one computation per run; later callers reuse its result
            with self._lock:
                e = self._entries.get(run)
            if e is not None and time.monotonic() - e[0] <= self._ttl:
                return e[1]
            return self._fill(run)

    def _fill(self, run: str) -> RunSummary:
        with self._lock:
            gen = self._gen.get(run, 0)
        started = time.monotonic()
        s = self._compute(run)
        with self._lock:
            if self._gen.get(run, 0) == gen:  # not invalidated while computing
                self._entries[run] = (started, s)
        return s

    def _refresh_soon(self, run: str) -> None:
        with self._lock:
            if run in self._refreshing:
                return
            self._refreshing.add(run)

        def job() -> None:
            try:
                with self._run_lock(run):
                    self._fill(run)
            except Exception as e:  # the stale entry stays; the next synchronous miss reports
                logger.warning("summary refresh of run %s failed: %s", run, e)
            finally:
                with self._lock:
                    self._refreshing.discard(run)

        try:
            self._pool.submit(job)
        except RuntimeError:  # shutting down
            with self._lock:
                self._refreshing.discard(run)

    def cached(self) -> dict[str, RunSummary]:
        with self._lock:
            return {r: e[1] for r, e in self._entries.items()}

    def invalidate(self, run: str) -> None:
        with self._lock:
            self._entries.pop(run, None)
            self._gen[run] = self._gen.get(run, 0) + 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def summarize(st: LogStore, run: str, run_dir: Path) -> RunSummary:
    """The summary of ``run`` from its store ``st`` (writers listed under ``run_dir``)."""
    stats = st.stats()
    cold_error: str | None = None
    incomplete: list[str] = ["cold"] if stats["cold"] is not None and stats["cold"].get("error") else []
    wm: dict[int, int] = {}
    try:
        cps = st.checkpoints()
    except (ColdTierUnavailableError, ColdTierError) as e:
        # unreachable or refusing: what this node registered itself, and the watermarks it last saw
        cold_error = f"checkpoints: {e.message}"
        cps, wm = st.checkpoints(hot_only=True), st.watermarks(max_age=math.inf)
        incomplete += ["checkpoints", "watermarks", "gaps"]
    for c in cps:
        wm[c.stage] = max(wm.get(c.stage, 0), c.iteration)
    gaps = st.gaps(hot_only=cold_error is not None)
    channels, stages, bounds = _channel_summaries(stats["channels"])
    h = stats["hot"]
    hot = _hot_summary(h, bounds["hot"], writers_under(run_dir), st.unreadable_writers())
    cold = None if stats["cold"] is None else _cold_summary(stats["cold"], bounds["cold"], cold_error)
    ratio = stats["compression_ratio"]
    if ratio is None and cold is not None and cold.stored_bytes:
        ratio = cold.raw_bytes / cold.stored_bytes
    return RunSummary(
        run=run,
        as_of=time.time(),
        stages=sorted(stages | set(wm)),
        channels=channels,
        hot=hot,
        cold=cold,
        raw_bytes=h["raw_bytes"],
        stored_bytes=h["stored_bytes"],
        compression_ratio=ratio,
        checkpoints=[checkpoint_view(c) for c in cps],
        watermarks=[Watermark(stage=s, iteration=i) for s, i in sorted(wm.items())],
        gaps=[Gap(**{k: g[k] for k in ("channel", "iteration", "micro_batch", "reason", "at")}) for g in gaps],
        incomplete=sorted(set(incomplete)),
    )


_Bounds = tuple[int | None, int | None]  # a tier's first and last iteration over every channel


def _channel_summaries(
    channel_stats: dict[str, dict[str, Any]],
) -> tuple[list[ChannelSummary], set[int], dict[str, _Bounds]]:
    """Each channel's range per tier (from ``LogStore.stats()["channels"]``), the stages the channels
    name, and each tier's first and last iteration."""
    channels: list[ChannelSummary] = []
    stages: set[int] = set()
    los: dict[str, list[int]] = {"hot": [], "cold": []}
    his: dict[str, list[int]] = {"hot": [], "cold": []}
    for name, tiers in sorted(channel_stats.items(), key=lambda kv: Channel.parse(kv[0])):
        ch = Channel.parse(name)
        stages.update((ch.src, ch.dst))
        ranges: dict[str, TierRange | None] = {"hot": None, "cold": None}
        for tier in ("hot", "cold"):
            t = tiers.get(tier)
            if t and t["records"] > 0:
                ranges[tier] = TierRange(
                    records=t["records"],
                    stored_bytes=t["stored_bytes"],
                    raw_bytes=t["raw_bytes"],
                    first_iteration=t["lo"],
                    last_iteration=t["hi"],
                )
                los[tier].append(t["lo"])
                his[tier].append(t["hi"])
        channels.append(
            ChannelSummary(name=ch.name, kind=kind_name(ch.kind), src=ch.src, dst=ch.dst, owner=ch.owner, **ranges)
        )
    bounds = {tier: (min(los[tier], default=None), max(his[tier], default=None)) for tier in ("hot", "cold")}
    return channels, stages, bounds


def _hot_summary(h: dict[str, Any], bounds: _Bounds, writers: list[str], unreadable: dict[str, str]) -> HotTierSummary:
    """The hot tiers' part of the summary, from ``LogStore.stats()["hot"]``."""
    segs = h["segments"]
    return HotTierSummary(
        records=h["records"],
        stored_bytes=h["stored_bytes"],
        raw_bytes=h["raw_bytes"],
        first_iteration=bounds[0],
        last_iteration=bounds[1],
        disk_bytes=h["disk_bytes"],
        writers=writers,
        unreadable=unreadable,
        collected=[Collected(stage=k, **c) for k, c in sorted(h["collected"].items())],
        segments=SegmentStates(
            open=segs.get("open", 0),
            sealed=segs.get("sealed", 0),
            uploaded=segs.get("uploaded", 0),
            evicted=segs.get("evicted", 0),
        ),
    )


def _cold_summary(c: dict[str, Any], bounds: _Bounds, cold_error: str | None) -> ColdTierSummary:
    """The cold tier's part of the summary, from ``LogStore.stats()["cold"]``; ``error`` joins the
    listing's error and the registrations' (``cold_error``)."""
    return ColdTierSummary(
        records=c["records"],
        stored_bytes=c["stored_bytes"],
        raw_bytes=c["raw_bytes"],
        first_iteration=bounds[0],
        last_iteration=bounds[1],
        segments=c["segments"],
        object_bytes=c["object_bytes"],
        error="; ".join(e for e in (c.get("error"), cold_error) if e) or None,
    )
