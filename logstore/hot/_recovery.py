"""What a hot tier's writer does at open: crash recovery and re-indexing of its segment files.

:class:`Recovery` is the part of :class:`~logstore.hot.HotTier` that runs when its owner opens
it: open segments are truncated to their acknowledged end and sealed, a file shorter than that
end keeps its whole frames (the rest become gaps), files the index does not know are re-indexed
from their footers or frames, and a damaged index is moved aside and rebuilt.

Never: overwrites or deletes a segment file it cannot re-index (it is kept and named); serves a
record from an earlier frame of the same key when its last frame is lost.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path

import lmdb

from logstore import codec
from logstore.errors import CodecError, CorruptRecordError, StoreError, SwiftlogError, translate_os_error
from logstore.hot._env import forget_env, open_env, salvage_docs
from logstore.hot._index import OPEN, REC, SEALED, U64, IndexAccess, SegmentMeta, fsync_dir, gap_entry
from logstore.keys import RecordKey, channel_range
from logstore.segment import FILE_HEADER_SIZE, MAGIC, TRAILER_SIZE, IndexEntry, read_footer, scan_frames

__all__ = ["Recovery", "Orphan", "read_orphan"]

logger = logging.getLogger(__name__)

Orphan = tuple[list[tuple[IndexEntry, int]], int, int, bool, "RecordKey | None"]


def read_orphan(path: Path) -> Orphan:
    """(entries with their raw lengths, end of the frames, file size, sealed, torn) of a segment
    file read without an index: the footer of a sealed file, else its frames up to the last whole
    one; ``torn`` is the key of a last frame cut short whose header still names it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        sealed = False
        torn: RecordKey | None = None
        entries: list[IndexEntry] = []
        if size >= FILE_HEADER_SIZE + TRAILER_SIZE:
            try:
                index_offset, entries = read_footer(fd, size, path.name)
                sealed, end = True, index_offset
            except CorruptRecordError:
                sealed = False
        if not sealed:
            try:
                for e in scan_frames(fd):
                    entries.append(e)
            except CorruptRecordError as e:  # a torn last frame: what precedes it is whole
                torn = e.context.get("torn")
            end = entries[-1].offset + entries[-1].length if entries else FILE_HEADER_SIZE
        out = []
        for e in entries:
            head = os.pread(fd, min(e.length, 4096), e.offset)
            try:
                raw = codec.read_header(head, key=e.key, total_length=e.length).raw_len
            except CodecError:
                try:
                    raw = codec.read_header(os.pread(fd, e.length, e.offset), key=e.key).raw_len
                except SwiftlogError:  # not a tensor record (the hot tier stores any blob): its stored size
                    raw = e.length
            out.append((e, raw))
        return out, end, size, sealed, torn
    finally:
        os.close(fd)


class Recovery(IndexAccess):
    """Crash recovery and re-indexing (owner only): a base of :class:`~logstore.hot.HotTier`, whose
    append path (``_commit_entries``, ``_seal``) it uses to index and seal what it finds."""

    def _replace_damaged_index(self, why: str) -> None:
        """The owner's own index is damaged (``why``): move it aside, kept for a post-mortem, start a
        fresh one with the documents (gaps, checkpoint registrations) still readable in the old one,
        and re-index every segment file from its footer or frames (``_recover``). Records in no
        file here (evicted: they are in the cold tier) are no longer in this index."""
        if self._handle is not None:
            forget_env(self._handle)
            self._handle = None
        index = self.dir / "index"
        docs = salvage_docs(index)
        aside = self.dir / f"index.damaged-{datetime.now(UTC):%Y%m%dT%H%M%S.%fZ}"
        try:
            os.replace(index, aside)
            fsync_dir(self.dir)
        except OSError as e:
            raise translate_os_error(e, f"moving the damaged LMDB index of {self.dir} aside") from e
        self.damaged = None
        try:
            self._attach(open_env(index, self.durability == "fsync", self._map_size, create=True))
        except lmdb.Error as e:
            raise StoreError(f"creating a new LMDB index for {self.dir}: {e}") from e
        if docs:
            self._write(lambda txn: [txn.put(k, v, db=self._db_meta) for k, v in docs.items()])
        self._recover()
        logger.warning(
            "hot tier %s: its LMDB index is damaged (%s): moved aside to %s (kept for a post-mortem); "
            "re-indexed %d segment file(s) from their footers and frames, kept %d document(s) (gaps, "
            "checkpoint registrations)",
            self.dir,
            why,
            aside.name,
            len(self.segments()),
            len(docs),
        )

    def _recover(self) -> None:
        """Truncate open segments to their acknowledged end and seal them (owner only). An open
        segment file shorter than its acknowledged end (a power loss under durability "process"
        kept the index's pages but not the file's last ones) keeps its whole frames; each record
        the index acknowledged past them is dropped and recorded as a gap. A segment file without a
        segment header (a creation the full disk refused) is moved aside, named; new segments are
        numbered past every file present, so none is ever overwritten (an index lost or replaced
        starts numbering at 1)."""
        self._adopt_orphans()
        self._number_past_files()
        for meta in self.segments():
            if meta.state == OPEN:
                self._recover_open(meta)

    def _recover_open(self, meta: SegmentMeta) -> None:
        """One open segment at open: dropped (its file lost or headless), cut back to its whole
        frames (shorter than acknowledged), re-indexed from its footer (sealed on disk: an older
        index), or truncated to its acknowledged end; then sealed."""
        path = self.seg_path(meta.id)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                headed = f.read(len(MAGIC)) == MAGIC
        except FileNotFoundError:
            logger.warning(
                "hot tier %s: open segment %d lost its file; dropping its index entries (recorded as gaps)",
                self.dir,
                meta.id,
            )
            self._drop_segment_entries(meta.id, f"lost: the file of open segment {meta.id} is gone")
            return
        except OSError as e:
            raise translate_os_error(e, f"reading segment {path}") from e
        if not headed:
            aside = path.with_name(path.name + ".unreadable")
            os.replace(path, aside)
            logger.warning(
                "hot tier %s: open segment file %s (%d bytes) has no segment header (its creation failed, "
                "e.g. on a full disk): moved to %s, its index entries dropped (recorded as gaps)",
                self.dir,
                path,
                size,
                aside.name,
            )
            self._sync_dir()
            why = f"lost: open segment file {path.name} had no header (moved to {aside.name})"
            self._drop_segment_entries(meta.id, why)
            return
        if size < meta.end:
            self._cut_torn(meta, path, size)
            return
        if size > meta.end:
            try:
                found = read_orphan(path)
            except (SwiftlogError, OSError):
                found = None
            # sealed on disk, with more: the index is an older copy
            if found is not None and found[3] and found[1] >= meta.end:
                logger.warning(
                    "hot tier %s: segment %d is sealed on disk (%d records) but open in the index at %d bytes "
                    "(an older copy of the index?): re-indexed from its footer, not truncated",
                    self.dir,
                    meta.id,
                    len(found[0]),
                    meta.end,
                )
                self._drop_segment_entries(meta.id)
                self._adopt_file(path, found)
                return
            logger.info(
                "hot tier %s: truncating segment %d from %d to acknowledged end %d",
                self.dir,
                meta.id,
                size,
                meta.end,
            )
            os.truncate(path, meta.end)
        self._seal(meta.id)

    def _cut_torn(self, meta: SegmentMeta, path: Path, size: int) -> None:
        """Open segment ``meta`` whose file ``path`` has only ``size`` bytes of its acknowledged
        ``meta.end``: keep the whole frames, drop (as gaps) the index entries of the records past
        them, then seal it with the frames kept. A record whose last frame is lost is never served
        from an earlier frame of the same key."""
        fd = os.open(path, os.O_RDWR)
        try:
            frames: list[IndexEntry] = []
            try:
                frames.extend(scan_frames(fd, size))
            except CorruptRecordError:
                pass  # a torn frame: what precedes it is whole
            end = frames[-1].offset + frames[-1].length if frames else FILE_HEADER_SIZE
            os.ftruncate(fd, end)
            if self.durability == "fsync":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        reason = (
            f"torn: segment file {path.name} ends at {size} bytes, before the {meta.end} its index acknowledged "
            "(a power loss under durability 'process'?)"
        )

        def fn(txn: lmdb.Transaction) -> list[RecordKey]:
            m = self._get_seg(txn, meta.id)
            assert m is not None
            lo, hi = channel_range(m.chan, m.lo, m.hi + 1)
            cur = txn.cursor(db=self._db_rec)
            lost = []
            if cur.set_range(lo):
                for kb, v in cur.iternext():
                    if kb >= hi:
                        break
                    seg_id, off, ln, _, raw_len = REC.unpack(v)
                    if seg_id == m.id and off + ln > end:
                        lost.append((bytes(kb), ln, raw_len))
            for kb, ln, raw_len in lost:
                txn.delete(kb, db=self._db_rec)
                m.live, m.live_bytes, m.raw_bytes = m.live - 1, m.live_bytes - ln, m.raw_bytes - raw_len
                txn.put(*gap_entry(RecordKey.decode(kb), reason), db=self._db_meta)
            gone = {RecordKey.decode(kb) for kb, _, _ in lost}
            kept[:] = [e for e in frames if e.key not in gone]
            m.end = m.file_size = end
            m.records = len(kept)
            self._put_seg(txn, m)
            return sorted(gone)

        kept: list[IndexEntry] = []
        lost = self._write(fn)
        assert isinstance(lost, list)
        logger.warning(
            "hot tier %s: open segment %d's file ends at %d bytes, before its acknowledged end %d: kept %d "
            "whole frame(s), %d record(s) lost and recorded as gaps (%s)",
            self.dir,
            meta.id,
            size,
            meta.end,
            len(kept),
            len(lost),
            ", ".join(map(str, lost[:5])) + (", ..." * (len(lost) > 5)),
        )
        self._seal(meta.id, kept)

    def file_ids(self) -> list[int]:
        """Ids of the segment files present in ``segments/`` (sorted)."""
        try:
            names = os.listdir(self._seg_dir)
        except OSError:
            return []
        return sorted(int(n[:-4]) for n in names if n.endswith(".seg") and n[:-4].isdigit())

    def orphan_files(self) -> list[Path]:
        """Segment files the index does not know (an index lost or replaced): never overwritten,
        not readable through the index; ``LogStore.verify`` lists them."""
        known = {m.id for m in self.segments()}
        return [self.seg_path(i) for i in self.file_ids() if i not in known]

    def _adopt_orphans(self) -> None:
        """Re-index the segment files the index does not know (it was lost or replaced by an older
        copy), oldest first: a sealed file from its footer, a file without one (it was open) from
        its frames up to the last whole one (then sealed like any open segment). Adopted segments
        are "sealed", so the uploader ships them again (idempotent). A file that cannot be read
        this way is kept and named (``orphan_files``)."""
        for path in self.orphan_files():
            self._adopt_file(path)

    def _adopt_file(self, path: Path, known: Orphan | None = None) -> bool:
        """Index the segment file ``path`` (not in the index) from its footer or frames; False
        (with a warning) when it cannot be read that way. A last frame cut short whose header names
        its record is recorded as a gap: nothing says whether it had been acknowledged."""
        seg_id = int(path.name[:-4])
        try:
            entries, end, size, sealed, torn = known if known is not None else read_orphan(path)
        except (SwiftlogError, OSError) as e:
            logger.warning(
                "hot tier %s: segment file %s is not in the index and cannot be re-indexed (%s): kept as it is",
                self.dir,
                path.name,
                e,
            )
            return False
        names = {e.key.channel.name for e, _ in entries}
        if not names and torn is not None:  # its one frame is cut short: kept as it is, its record lost
            self.record_gap(
                torn.channel,
                torn.iteration,
                torn.micro_batch,
                f"torn: the only frame of segment file {path.name} is cut short",
            )
        if len(names) != 1:
            logger.warning(
                "hot tier %s: segment file %s is not in the index and holds %s: kept as it is",
                self.dir,
                path.name,
                "no record" if not names else f"several channels {sorted(names)}",
            )
            return False
        first = entries[0][0].key

        def fn(txn: lmdb.Transaction) -> None:
            self._put_seg(
                txn, SegmentMeta(id=seg_id, channel=first.channel.name, lo=first.iteration, hi=first.iteration)
            )
            self._commit_entries(
                txn,
                [(e.key.encode(), seg_id, e.offset, e.length, e.checksum, raw, e.key) for e, raw in entries],
                {seg_id: end},
            )
            m = self._get_seg(txn, seg_id)
            assert m is not None
            m.state, m.file_size = (SEALED, size) if sealed else (OPEN, end)
            self._put_seg(txn, m)
            if torn is not None:
                why = f"torn: the last frame of segment file {path.name}, re-indexed without its index, is cut short"
                txn.put(*gap_entry(torn, why), db=self._db_meta)

        self._write(fn)
        if torn is not None:
            logger.warning(
                "hot tier %s: segment file %s ends inside the frame of %s: recorded as a gap", self.dir, path.name, torn
            )
        logger.warning(
            "hot tier %s: segment file %s was not in the index: re-indexed %d record(s) of %s from its %s",
            self.dir,
            path.name,
            len(entries),
            first.channel.name,
            "footer" if sealed else "frames",
        )
        return True

    def _number_past_files(self) -> None:
        top = max(self.file_ids(), default=0)
        if self.number_past(top) and (orphans := self.orphan_files()):  # (re-indexed files are no orphans)
            logger.warning(
                "hot tier %s: %d segment file(s) are not in its index (index lost or replaced?), e.g. %s: kept; "
                "new segments are numbered from %d",
                self.dir,
                len(orphans),
                orphans[0].name,
                top + 1,
            )

    def _drop_segment_entries(self, seg_id: int, gap_reason: str | None = None) -> None:
        """Remove a segment and its records from the index; with ``gap_reason`` (its records are
        lost, not indexed again from elsewhere) each record is recorded as a gap."""

        def fn(txn: lmdb.Transaction) -> None:
            cur = txn.cursor(db=self._db_rec)
            doomed = [bytes(k) for k, v in cur if REC.unpack(v)[0] == seg_id]
            for k in doomed:
                txn.delete(k, db=self._db_rec)
                if gap_reason is not None:
                    txn.put(*gap_entry(RecordKey.decode(k), gap_reason), db=self._db_meta)
            txn.delete(U64.pack(seg_id), db=self._db_seg)

        self._write(fn)
