"""Record listings from the indexes alone: one page of records in key order, merged over tiers.

A :class:`RecordListing` pages through the hot indexes of this node and the footers of the cold
segments that may hold the page, and merges them: a record still in a local segment file is
reported as hot, one evicted or known only to the cold tier as cold. It reads about one page
of each source, never record bytes.

Never: lists a record below its owner's watermark; reads a cold footer when a hot index of this
node already holds every live record of that segment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from logstore._cold_index import ColdIndex, ColdSeg, cold_name_parts
from logstore._hot_tiers import HotTiers
from logstore.errors import ConfigError
from logstore.hot import EVICTED, HotTier
from logstore.keys import Channel, Kind, RecordKey
from logstore.reports import RecordInfo

__all__ = ["RecordListing"]


class RecordListing:
    """``LogStore.list_records`` over ``tiers`` and, when there is a cold tier, ``cold_index``."""

    def __init__(
        self, tiers: HotTiers, cold_index: ColdIndex | None, watermarks: Callable[..., dict[int, int]]
    ) -> None:
        self._tiers = tiers
        self._cold_index = cold_index
        self._watermarks = watermarks

    def list_records(
        self,
        channel: Channel | None,
        it_lo: int,
        it_hi: int | None,
        *,
        kinds: Iterable[Kind] | None,
        micro_batch: int | None,
        after: RecordKey | None,
        limit: int,
        hot_only: bool,
    ) -> list[RecordInfo]:
        """``LogStore.list_records``."""
        if not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"limit must be an int >= 1, got {limit!r}")
        kind_set = None if kinds is None else {Kind(k) for k in kinds}
        wm = self._watermarks(max_age=2.0)
        after_b = after.encode() if after is not None else None
        out: list[RecordInfo] = []
        for ch in [channel] if channel is not None else self.record_channels(hot_only):
            if (kind_set is not None and ch.kind not in kind_set) or (after is not None and ch < after.channel):
                continue
            lo = max(it_lo, wm.get(ch.owner, 0))
            if it_hi is not None and lo >= it_hi:
                continue
            out.extend(self._channel_page(ch, lo, it_hi, micro_batch, after_b, limit - len(out), hot_only))
            if len(out) >= limit:
                break
        return out

    def record_channels(self, hot_only: bool = False) -> list[Channel]:
        """Channels with records in some tier (cheaper than channels(): no scan of segment metadata)."""
        found: set[Channel] = set()
        for hot in self._tiers.all():
            found.update(hot.record_channels())
        if self._cold_index is not None and not hot_only:
            found.update(Channel.parse(n) for n in self._cold_index.listing())
        return sorted(found)

    @staticmethod
    def _uploaded_from(seg: ColdSeg, hots: dict[str, HotTier]) -> bool:
        """True when ``seg`` is the upload of a segment still known to a hot tier of this node,
        whose index then holds every live record of it (no need to read its footer)."""
        hot = hots.get(seg.writer)
        m = cold_name_parts(seg.name)
        if hot is None or m is None:
            return False
        meta = hot.segment(int(m["seg"]))
        return meta is not None and meta.cold_name == seg.name

    def _channel_page(
        self,
        ch: Channel,
        lo: int,
        hi: int | None,
        mb: int | None,
        after: bytes | None,
        need: int,
        hot_only: bool = False,
    ) -> list[RecordInfo]:
        """The first ``need`` records of one channel after ``after``: each source's first page, merged."""
        found: dict[bytes, RecordInfo] = {}
        self._hot_page(found, ch, lo, hi, mb, after, need)
        if self._cold_index is not None and not hot_only:
            self._cold_page(found, ch, lo, hi, mb, after, need)
        return [found[kb] for kb in sorted(found)[:need]]

    def _hot_page(
        self,
        found: dict[bytes, RecordInfo],
        ch: Channel,
        lo: int,
        hi: int | None,
        mb: int | None,
        after: bytes | None,
        need: int,
    ) -> None:
        """Each hot index's first ``need`` records of ``ch`` after ``after``, into ``found``."""
        batch_size = need if mb is None else max(need, 256)
        for hot in self._tiers.all():
            cursor, got = after, 0
            while got < need:
                batch = hot.keys(ch, lo, hi, after=cursor, limit=batch_size)
                for k, loc in batch:
                    if mb is not None and k.micro_batch != mb:
                        continue
                    got += 1
                    kb = k.encode()
                    prev = found.get(kb)
                    if prev is None or (prev.tier == "cold" and loc.segment.state != EVICTED):
                        if loc.segment.state == EVICTED:
                            found[kb] = RecordInfo(
                                k,
                                "cold",
                                hot.writer,
                                loc.length,
                                loc.raw_len,
                                loc.checksum,
                                loc.segment.cold_name or "",
                            )
                        else:
                            found[kb] = RecordInfo(
                                k,
                                "hot",
                                hot.writer,
                                loc.length,
                                loc.raw_len,
                                loc.checksum,
                                f"{hot.writer}/segments/{loc.segment.id:010d}.seg",
                            )
                if len(batch) < batch_size:
                    break
                cursor = batch[-1][0].encode()

    def _cold_page(
        self,
        found: dict[bytes, RecordInfo],
        ch: Channel,
        lo: int,
        hi: int | None,
        mb: int | None,
        after: bytes | None,
        need: int,
    ) -> None:
        """The cold footers' records of ``ch`` after ``after`` that may belong to the page, into
        ``found``; segments past the page's last key are not read."""
        assert self._cold_index is not None
        hots = {h.writer: h for h in self._tiers.all()}
        # segments wholly before the cursor cannot hold a key of this page
        after_it = (
            RecordKey.decode(after).iteration
            if after is not None and after[:5] == RecordKey(ch, 0).encode()[:5]
            else None
        )
        cutoff = RecordKey.decode(sorted(found)[need - 1]).iteration if len(found) >= need else None
        for seg in sorted(self._cold_index.segments(ch, lo, hi), key=lambda s: (s.lo, s.name)):
            if after_it is not None and seg.hi < after_it:
                continue
            if cutoff is not None and seg.lo > cutoff:
                break  # every key of this and later segments sorts after the page
            if self._uploaded_from(seg, hots):
                continue
            added = False
            for kb, e in self._cold_index.footer(seg.name, seg.size).items():
                if (after is not None and kb <= after) or kb in found:
                    continue
                k = RecordKey.decode(kb)
                if (
                    k.iteration < lo
                    or (hi is not None and k.iteration >= hi)
                    or (mb is not None and k.micro_batch != mb)
                ):
                    continue
                found[kb] = RecordInfo(k, "cold", seg.writer, e.length, None, e.checksum, seg.name)
                added = True
            if added and len(found) >= need:
                cutoff = RecordKey.decode(sorted(found)[need - 1]).iteration
