"""``LogStore.verify``: every checksum in both tiers, and what the indexes list that is not there.

The check, in order:

1. writer directories: segment files without an index, indexes that cannot be opened or read,
   segment files no index knows;
2. the cold tier's listing and the documents other commands read (registrations, gaps);
3. every record of every readable hot index: frame header, blob checksum, the tensor's raw
   checksum; an uploaded segment the cold tier no longer has; a segment file missing and never
   uploaded;
4. every committed cold segment: each record as in 3, then the object against its commit marker;
5. problems about records that became garbage while the check ran (a GC meanwhile) are dropped:
   the watermarks are read again at the end.

Never: raises for a corrupt or missing record (it is listed); changes anything.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from logstore import codec
from logstore._cold_index import ColdIndex, ColdSeg
from logstore._hot_tiers import HotTiers
from logstore._retention import Retention
from logstore.cold import ColdTier
from logstore.errors import CorruptIndexError, CorruptRecordError, SwiftlogError
from logstore.hot import EVICTED, UPLOADED, HotTier, Location
from logstore.keys import RecordKey
from logstore.reports import VerifyReport
from logstore.segment import FRAME_HEADER_SIZE, blob_checksum, check_frame_header

__all__ = ["verify"]

Progress = Callable[[str, int, int], None]

_GONE_UPLOAD = (
    "; a cold object whose size no longer matches its commit marker, or whose marker is damaged, is not listed either"
)


def verify(
    *,
    tiers: HotTiers,
    cold: ColdTier | None,
    cold_url: str | None,
    cold_index: ColdIndex | None,
    retention: Retention,
    gaps: Callable[[], Any],
    progress: Progress | None = None,
) -> VerifyReport:
    """The report of one check (see the module docstring). ``gaps`` lists the store's gaps (a
    read of their documents); ``progress(tier, done, total)`` is called as work advances."""
    return _Verify(tiers, cold, cold_url, cold_index, retention, gaps, progress).run()


class _Verify:
    """One run of the check: the report, and the problems a GC meanwhile may explain."""

    def __init__(
        self,
        tiers: HotTiers,
        cold: ColdTier | None,
        cold_url: str | None,
        cold_index: ColdIndex | None,
        retention: Retention,
        gaps: Callable[[], Any],
        progress: Progress | None,
    ) -> None:
        self.tiers = tiers
        self.cold = cold
        self.cold_url = cold_url
        self.cold_index = cold_index
        self.retention = retention
        self.gaps = gaps
        self.progress = progress
        self.rep = VerifyReport()
        self.may_be_gc: list[tuple[dict[str, str], int, int]] = []  # (problem, owner stage, last iteration it concerns)

    def run(self) -> VerifyReport:
        hots = self.tiers.all()
        self._writer_directories(hots)
        entries = self._indexes(hots)
        committed = self._listings()
        self._hot_records(entries, committed)
        if self.cold is not None and committed is not None:
            self._cold_segments()
        self._forget_collected()
        return self.rep

    def _problem(self, tier: str, key: str, where: str, error: str) -> dict[str, str]:
        p = {"tier": tier, "key": key, "where": where, "error": error}
        self.rep.problems.append(p)
        return p

    def _writer_directories(self, hots: list[HotTier]) -> None:
        """Segment files without an index, and writers whose index readers leave out."""
        run_dir: Path = self.tiers.run_dir
        try:  # a writer directory with segment files but no index (lost, or not a directory): nothing reads them
            orphaned = sorted(
                d for d in run_dir.iterdir() if not (d / "index").is_dir() and any((d / "segments").glob("*.seg"))
            )
        except OSError:
            orphaned = []
        for d in orphaned:
            n = sum(1 for _ in (d / "segments").glob("*.seg"))
            self._problem(
                "hot",
                "",
                str(d / "index"),
                f"{n} segment file(s) but no index (lost?): their records are not readable until the writer "
                "reopens the store (it re-indexes them)",
            )
        for w in sorted(set(self.tiers.writers()) - {h.writer for h in hots}):
            why = self.tiers.why_unreadable(w, "the index cannot be opened (see the log)")
            self._problem("hot", "", str(run_dir / w / "index"), why)

    def _indexes(self, hots: list[HotTier]) -> list[tuple[HotTier, RecordKey, Location]]:
        """Every entry of the readable hot indexes; damaged indexes and orphan files are problems."""
        readable = []
        for hot in hots:
            try:
                orphans, listed = hot.orphan_files(), [(hot, k, loc) for k, loc in hot.keys()]
            except CorruptIndexError as e:  # damaged pages: the other writers' records are still checked
                self._problem("hot", "", str(hot.dir / "index"), str(e))
                continue
            readable.extend(listed)
            for path in orphans:
                self._problem(
                    "hot",
                    "",
                    str(path),
                    "segment file not in the writer's index (index lost or replaced?): its records are not readable",
                )
        return readable

    def _listings(self) -> set[str] | None:
        """The committed cold segments' names (None without a cold tier or when it cannot be listed),
        after reading the documents other commands read (stat, gc, plan)."""
        committed: set[str] | None = None
        if self.cold is not None and self.cold_index is not None:
            try:
                committed = self.cold_index.committed_names()
            except SwiftlogError as e:
                self._problem("cold", "", self.cold_url or "", f"cannot be listed: {e}")
            else:  # the checkpoint registrations and gaps other commands read (stat, gc, plan)
                try:
                    self.retention.checkpoints()
                    self.gaps()
                except SwiftlogError as e:
                    where = str(getattr(e, "key", None) or self.cold_url or "")
                    self._problem("cold", "", where, f"a registration document cannot be read: {e}")
        # registration documents left out of the watermarks: not a registration, or content unlike the name
        try:
            self.retention.checkpoints(hot_only=self.cold is not None and committed is None)
        except SwiftlogError:
            pass  # listed above
        else:
            self.rep.problems.extend(dict(p) for p in self.retention.problems)
        return committed

    def _hot_records(self, entries: list[tuple[HotTier, RecordKey, Location]], committed: set[str] | None) -> None:
        """Each hot record's checksums, and whether what it was uploaded as is still there."""
        wm = self.retention.watermarks(max_age=2.0)
        for i, (hot, k, loc) in enumerate(entries):
            where = f"{hot.dir}/segments/{loc.segment.id:010d}.seg"
            try:
                blob = hot.read_local(loc)
                if blob is not None:
                    codec.verify_blob(blob, key=k)
                    self.rep.hot_checked += 1
                if k.iteration < wm.get(k.channel.owner, 0):
                    pass  # garbage: another node's GC may have removed its cold copy already
                elif (
                    loc.segment.state in (UPLOADED, EVICTED)
                    and committed is not None
                    and loc.segment.cold_name not in committed
                ):
                    again = (
                        " (its writer uploads it again when it reopens the store)"
                        if blob is not None
                        else " and the local file is gone: lost"
                    )
                    error = "uploaded, but the cold tier no longer has it" + again + _GONE_UPLOAD
                    p = self._problem("cold", str(k), loc.segment.cold_name or "", error)
                    self.may_be_gc.append((p, k.channel.owner, k.iteration))
                elif blob is None and loc.segment.state not in (UPLOADED, EVICTED):
                    p = self._problem("hot", str(k), where, "segment file missing and never uploaded: lost")
                    self.may_be_gc.append((p, k.channel.owner, k.iteration))
            except (CorruptRecordError, SwiftlogError) as e:
                p = self._problem("hot", str(k), f"{where}@{loc.offset}", str(e))
                if not isinstance(e, CorruptRecordError):  # e.g. its file deleted while read
                    self.may_be_gc.append((p, k.channel.owner, k.iteration))
            if self.progress is not None:
                self.progress("hot", i + 1, len(entries))

    def _cold_segments(self) -> None:
        """Each committed cold segment: its records, then the object against its marker."""
        assert self.cold_index is not None
        segs = self.cold_index.segments(None)
        for i, seg in enumerate(segs):
            self.rep.cold_segments += 1
            self._cold_segment(seg)
            if self.progress is not None:
                self.progress("cold", i + 1, len(segs))

    def _cold_segment(self, seg: ColdSeg) -> None:
        assert self.cold is not None and self.cold_index is not None
        try:
            data = self.cold.read(seg.name)
            entries_c = self.cold_index.footer(seg.name, seg.size).values()
        except SwiftlogError as e:
            p = self._problem("cold", "", seg.name, str(e))
            if not isinstance(e, CorruptRecordError):  # e.g. deleted since the listing
                self.may_be_gc.append((p, seg.channel.owner, seg.hi))
            return
        before = len(self.rep.problems)
        for e in entries_c:
            blob = data[e.offset : e.offset + e.length]
            try:
                head = data[max(0, e.offset - FRAME_HEADER_SIZE) : e.offset]
                where = f"cold object {seg.name} at offset {e.offset}"
                check_frame_header(head, e.key, e.length, e.checksum, where)
                if blob_checksum(blob) != e.checksum:
                    raise CorruptRecordError(
                        f"corrupt record {e.key} in cold object {seg.name}: checksum mismatch", key=e.key
                    )
                codec.verify_blob(blob, key=e.key)
                self.rep.cold_checked += 1
            except SwiftlogError as err:
                self._problem("cold", str(e.key), f"{seg.name}@{e.offset}", str(err))
        if len(self.rep.problems) == before:  # every record intact: the commit marker must still describe the object
            try:
                self.cold.check_marker(seg.name, data)
            except SwiftlogError as e:
                p = self._problem("cold", "", seg.name, f"{e} (size or checksum): the marker is damaged")
                if not isinstance(e, CorruptRecordError):  # gone since it was read: a GC, perhaps
                    self.may_be_gc.append((p, seg.channel.owner, seg.hi))

    def _forget_collected(self) -> None:
        """Drop the problems about what became garbage since the check began (a GC ran meanwhile)."""
        if not self.may_be_gc:
            return
        try:
            wm = self.retention.watermarks(max_age=0.0)
        except SwiftlogError:
            wm = {}
        gone = {id(p) for p, owner, it in self.may_be_gc if it < wm.get(owner, 0)}
        self.rep.problems = [p for p in self.rep.problems if id(p) not in gone]
