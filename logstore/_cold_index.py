"""The cold listing cache: which segments the cold tier holds, and their footers.

A :class:`ColdIndex` lists the committed segments of one run once and reuses the listing for
5 s. One listing runs at a time, outside the lock; the others keep using the previous one. It
also keeps the footers (key -> index entry) of the last 512 cold segments read.

Cold segment names: ``<run>/segments/<channel>/<lo>-<hi>.<writer>.<segment id>.seg``.

Never: caches a listing that raced an invalidation; reads a footer whose trailer does not
describe an index ending where the trailer begins.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from logstore.cold import ColdTier
from logstore.keys import Channel
from logstore.segment import INDEX_ENTRY_SIZE, TRAILER_SIZE, parse_index, parse_trailer

__all__ = ["ColdSeg", "ColdIndex", "cold_name_parts", "copy_age"]

_COLD_SEG_RE = re.compile(r"^(?P<lo>\d{12})-(?P<hi>\d{12})\.(?P<writer>[A-Za-z0-9._-]+)\.(?P<seg>\d{10})\.seg$")


@dataclass(frozen=True, slots=True)
class ColdSeg:
    """One committed cold segment, as its name and its commit marker describe it."""

    name: str
    channel: Channel
    lo: int
    hi: int
    writer: str
    size: int
    records: int
    raw_bytes: int
    stored_bytes: int
    incarnation: float = 0.0  # when the writer that uploaded it opened (0: not recorded)


def cold_name_parts(name: str) -> re.Match[str] | None:
    """lo, hi, writer and segment id of a cold segment's name (None for a name not of the form)."""
    return _COLD_SEG_RE.match(name.rsplit("/", 1)[-1])


def _seg_number(seg: ColdSeg) -> int:
    """The segment id in a cold segment's name (0 for a name not of the form)."""
    m = cold_name_parts(seg.name)
    return int(m["seg"]) if m else 0


def _incarnation_of(meta: dict[str, Any]) -> float:
    v = meta.get("incarnation")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def copy_age(seg: ColdSeg) -> tuple[float, int]:
    """Sort key of the copies of a record, newest last: the later incarnation of the writer (when
    it opened; a replacement, a rollback's restart), then the higher segment id. Segments uploaded
    without an incarnation count as the oldest."""
    return seg.incarnation, _seg_number(seg)


class ColdIndex:
    """The committed cold segments of one run, listed and cached; the footers read, cached (LRU).

    Thread-safe. ``invalidate`` makes the next read list again (after an upload or a GC).
    """

    def __init__(self, cold: ColdTier, run: str) -> None:
        self.cold = cold
        self.run = run
        self._lock = threading.Lock()
        self._footers: OrderedDict[str, dict[bytes, Any]] = OrderedDict()
        self._cold_list: dict[str, list[ColdSeg]] | None = None
        self._cold_list_at = 0.0
        self._cold_epoch = 0  # bumped (under _lock) whenever _cold_list is invalidated
        self._cold_listing = threading.Lock()  # one cold listing at a time, never under _lock

    def listing_age(self) -> float:
        """Seconds since the listing in use was started."""
        return time.monotonic() - self._cold_list_at

    def invalidate(self, forget: Iterable[str] = ()) -> None:
        """Drop the listing (the next read lists again) and the footers of the segments ``forget``."""
        with self._lock:
            self._cold_list = None
            self._cold_epoch += 1
            for name in forget:
                self._footers.pop(name, None)

    def listing(self, refresh: bool = False) -> dict[str, list[ColdSeg]]:
        """The committed cold segments by channel name; a listing is reused for 5 s.

        The listing runs outside ``_lock`` (it can take long on an object store), one at a time;
        while one thread lists, the others keep using the previous listing unless they asked for
        ``refresh`` or there is none yet. A listing that raced an invalidation is not cached.
        """
        with self._lock:
            cur, epoch = self._cold_list, self._cold_epoch
            if cur is not None and not refresh and time.monotonic() - self._cold_list_at <= 5.0:
                return cur
        if cur is not None and not refresh:
            if not self._cold_listing.acquire(blocking=False):
                return cur
        else:
            self._cold_listing.acquire()
        try:
            if not refresh:
                with self._lock:  # another thread may have listed while we waited
                    if self._cold_list is not None and self._cold_list is not cur:
                        return self._cold_list
            started = time.monotonic()
            out: dict[str, list[ColdSeg]] = {}
            for info in self.cold.list_segments(f"{self.run}/segments/"):
                parts = info.name.split("/")
                m = _COLD_SEG_RE.match(parts[-1])
                if m is None or len(parts) < 2:
                    continue
                ch = Channel.parse(parts[-2])
                meta = info.meta or {}
                out.setdefault(ch.name, []).append(
                    ColdSeg(
                        info.name,
                        ch,
                        int(m["lo"]),
                        int(m["hi"]),
                        m["writer"],
                        info.size,
                        int(meta.get("records", 0)),
                        int(meta.get("raw_bytes", 0)),
                        int(meta.get("stored_bytes", 0)),
                        _incarnation_of(meta),
                    )
                )
            with self._lock:
                if self._cold_epoch == epoch:
                    self._cold_list = out
                    self._cold_list_at = started
            return out
        finally:
            self._cold_listing.release()

    def segments(
        self, channel: Channel | None, it_lo: int = 0, it_hi: int | None = None, refresh: bool = False
    ) -> list[ColdSeg]:
        """The cold segments of ``channel`` (every channel: None) that may hold ``[it_lo, it_hi)``."""
        idx = self.listing(refresh)
        segs = [s for n, v in idx.items() if channel is None or n == channel.name for s in v]
        return [s for s in segs if s.hi >= it_lo and (it_hi is None or s.lo < it_hi)]

    def committed_names(self) -> set[str]:
        """Names of every committed cold segment, from a fresh listing (raises like the listing)."""
        return {seg.name for segs in self.listing(refresh=True).values() for seg in segs}

    def footer(self, name: str, size: int) -> dict[bytes, Any]:
        """Index of a cold segment of ``size`` bytes (key bytes -> entry), cached (LRU). Raises
        CorruptRecordError when the trailer does not describe an index ending where it begins
        (a damaged trailer would otherwise ask for any number of bytes)."""
        with self._lock:
            if name in self._footers:
                self._footers.move_to_end(name)
                return self._footers[name]
        trailer = self.cold.read_range(name, -TRAILER_SIZE, TRAILER_SIZE)
        off, n, csum = parse_trailer(trailer, name, size)
        index = self.cold.read_range(name, off, n * INDEX_ENTRY_SIZE) if n else b""
        entries = {e.key.encode(): e for e in parse_index(index, n, csum, name)}
        with self._lock:
            self._footers[name] = entries
            while len(self._footers) > 512:
                self._footers.popitem(last=False)
        return entries
