"""The hot tier of one writer: :class:`HotTier` opens its index, appends, seals and collects.

The layout, durability modes and crash consistency are described in the package docstring
(:mod:`logstore.hot`); the index layer is in ``_index``, recovery at open in ``_recovery``.

Never: holds an LMDB transaction across user code; deletes a segment file its index does not
describe.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from logstore.errors import (
    ConfigError,
    CorruptIndexError,
    StoreError,
    SwiftlogError,
    translate_os_error,
)
from logstore.hot._env import DAMAGED_HINT, EnvHandle, open_env, release_env
from logstore.hot._index import (
    COLLECTED,
    DAMAGE,
    EVICTED,
    F64,
    OPEN,
    REC,
    SEALED,
    U64,
    SegmentMeta,
    load_collected,
)
from logstore.hot._recovery import Recovery
from logstore.keys import Channel, RecordKey
from logstore.segment import (
    FILE_HEADER,
    FILE_HEADER_SIZE,
    FRAME_HEADER_SIZE,
    IndexEntry,
    blob_checksum,
    build_footer,
    encode_frame_header,
    read_footer,
    scan_frames,
)

__all__ = ["HotTier"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Open:
    """The owner's view of an open segment: only the owner appends, so ``end`` (acknowledged end
    of data) and ``lo`` can live in memory; other processes only ever change live counters."""

    id: int
    fd: int
    lo: int
    end: int
    index: list[IndexEntry] = field(default_factory=list)  # committed frames, for the footer


@dataclass(slots=True)
class _Batch:
    """Frames written by one append() call and not yet committed to the index."""

    entries: list[tuple[bytes, int, int, int, int, int, RecordKey]] = field(
        default_factory=list
    )  # (key bytes, segment, offset, length, checksum, raw length, key)
    pending_end: dict[int, int] = field(default_factory=dict)
    segs: dict[int, _Open] = field(default_factory=dict)


def _not_the_segment(path: Path, m: SegmentMeta) -> str | None:
    """Why the sealed segment file at ``path`` is not the one ``m`` describes (its size, or a record
    of its footer in another channel), or None when it is (or is gone). GC deletes only the file
    its index describes: an index copied over another writer's would otherwise name that writer's
    files, data only it has among them."""
    try:
        size = path.stat().st_size
        if size != m.file_size:
            return f"{size} bytes, the index says {m.file_size}"
        fd = os.open(path, os.O_RDONLY)
        try:
            _, entries = read_footer(fd, size, str(path))
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except (OSError, SwiftlogError) as e:
        return f"its footer cannot be read ({e})"
    other = next((e.key for e in entries if e.key.channel.name != m.channel), None)
    return None if other is None else f"it holds {other}, the index says channel {m.channel}"


class HotTier(Recovery):
    """One writer's hot tier. ``owner=True`` takes the writer lock and may append.

    Any process may open a writer's directory with ``owner=False`` to read, collect garbage
    (index deletes + removal of dead, non-open segments) and inspect, while the owner writes.
    Thread-safe within a process.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        owner: bool,
        durability: str = "process",
        segment_iters: int = 4,
        segment_max_bytes: int = 256 << 20,
        map_size: int = 64 << 20,
        on_seal: Callable[[SegmentMeta], None] | None = None,
    ) -> None:
        if durability not in ("process", "fsync"):
            raise ConfigError(f"durability {durability!r} not supported", hint="use 'process' or 'fsync'")
        if segment_iters < 1:
            raise ConfigError(f"segment_iters must be >= 1, got {segment_iters}")
        self.dir = Path(directory)
        self.writer = self.dir.name
        self.owner = owner
        self.damaged: str | None = None  # why a read of the index failed (damaged pages or entries), once one did
        self.durability = durability
        self.segment_iters = segment_iters
        self.segment_max_bytes = segment_max_bytes
        self.on_seal = on_seal
        self._seg_dir = self.dir / "segments"
        self._wlock = threading.RLock()
        self._active: dict[str, _Open] = {}  # channel name -> its open segment (owner only)
        self._closed = False
        self._lock_fd: int | None = None
        self._map_size = map_size
        self._handle: EnvHandle | None = None
        damaged = self._open_index(map_size)
        if owner:
            self._start_owner(damaged)

    def _open_index(self, map_size: int) -> str | None:
        """Take the writer lock (owner) and open the index. Returns why the owner's own index cannot
        be used (None when it opened); a reader's unusable index raises."""
        damaged: str | None = None
        try:
            if self.owner:
                self._seg_dir.mkdir(parents=True, exist_ok=True)
                self._lock_fd = os.open(self.dir / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(self._lock_fd)
                    self._lock_fd = None
                    raise StoreError(
                        f"another process is already writing {self.dir}",
                        hint="give each writing process its own writer name",
                    ) from None
            elif not (self.dir / "index").is_dir():
                raise StoreError(f"no hot tier at {self.dir}")
            try:
                self._attach(open_env(self.dir / "index", self.durability == "fsync", map_size, create=self.owner))
            except (*DAMAGE, CorruptIndexError) as e:
                if not self.owner:
                    raise
                damaged = f"it cannot be opened: {type(e).__name__}: {e}"
        except OSError as e:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise translate_os_error(e, f"opening hot tier {self.dir}") from e
        except lmdb.Error as e:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            if not self.owner:  # a reader creates nothing: an index it cannot open is damaged (or not one)
                raise CorruptIndexError(f"the LMDB index of {self.dir} cannot be opened: {e}", hint=DAMAGED_HINT) from e
            raise StoreError(f"opening LMDB index of {self.dir}: {e}") from e
        return damaged

    def _start_owner(self, damaged: str | None) -> None:
        """The owner's first steps: check its index, recover (or replace a damaged index), then
        record this incarnation."""
        try:
            if damaged is None:
                try:
                    self.check_readable()  # a damaged page anywhere is found now, not in some later put
                    self._recover()
                except CorruptIndexError as e:
                    damaged = e.message
            if damaged is not None:
                self._replace_damaged_index(damaged)
            opened = time.time()
            self._write(lambda txn: txn.put(b"incarnation", F64.pack(opened), db=self._db_meta))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ writer side
    def _new_segment(self, channel: Channel, iteration: int) -> _Open:
        def fn(txn: lmdb.Transaction) -> SegmentMeta:
            seg_id = self._next_seg(txn)
            txn.put(b"next_seg", U64.pack(seg_id + 1), db=self._db_meta)
            meta = SegmentMeta(id=seg_id, channel=channel.name, lo=iteration, hi=iteration)
            self._put_seg(txn, meta)
            return meta

        meta = self._write(fn)
        path = self.seg_path(meta.id)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # never over a file an index does not know
            os.pwrite(fd, FILE_HEADER, 0)
        except OSError as e:
            raise translate_os_error(e, f"creating segment {path}") from e
        try:
            self._sync_dir()
        except StoreError:
            os.close(fd)
            raise
        return _Open(meta.id, fd, iteration, FILE_HEADER_SIZE)

    def _active_for(self, key: RecordKey, batch: _Batch) -> _Open:
        """Open segment for ``key``, rolling to a new one when its iteration bucket or size is
        exceeded. Frames of ``batch`` pending in a segment about to be sealed are committed first."""
        name = key.channel.name
        cur = self._active.get(name)
        if cur is not None:
            end = batch.pending_end.get(cur.id, cur.end)
            if (
                key.iteration // self.segment_iters != cur.lo // self.segment_iters
                or key.iteration < cur.lo
                or end >= self.segment_max_bytes
            ):
                if cur.id in batch.pending_end:
                    self._commit_batch(batch)
                del self._active[name]
                os.close(cur.fd)
                self._seal(cur.id, cur.index)
                cur = None
        if cur is None:
            cur = self._active[name] = self._new_segment(key.channel, key.iteration)
        return cur

    def append(
        self,
        items: list[tuple[RecordKey, bytes | memoryview, int] | tuple[RecordKey, bytes | memoryview, int, int | None]],
    ) -> None:
        """Append encoded records ``(key, blob, raw_len[, checksum])`` and commit their index entries.

        ``checksum`` is the blob's xxh3 (``segment.blob_checksum``) when the caller computed it
        off this thread; omitted or None, it is computed here.

        Returns only after the whole batch is acknowledged (see module docstring for what that
        means per durability mode). On failure the records not yet acknowledged are truncated
        away and the error is raised (StoreFullError when the disk is full); a batch that spans
        a segment roll may be acknowledged in part (each record is either fully there or not).
        """
        if not self.owner:
            raise StoreError(f"hot tier {self.dir} was opened read-only", hint="open it with owner=True")
        if not items:
            return
        with self._wlock:
            self._check_open()
            batch = _Batch()
            try:
                for item in items:
                    key, blob, raw_len = item[0], item[1], item[2]
                    cs = item[3] if len(item) > 3 else None
                    seg = self._active_for(key, batch)
                    pos = batch.pending_end.setdefault(seg.id, seg.end)
                    batch.segs[seg.id] = seg
                    kb = key.encode()
                    if cs is None:
                        cs = blob_checksum(blob)
                    hdr = encode_frame_header(kb, len(blob), cs)
                    n = os.pwritev(seg.fd, [hdr, blob], pos)
                    if n != len(hdr) + len(blob):
                        raise OSError(28, "short write (disk full?)")
                    batch.pending_end[seg.id] = pos + n
                    batch.entries.append((kb, seg.id, pos + FRAME_HEADER_SIZE, len(blob), cs, raw_len, key))
                self._commit_batch(batch)
            except BaseException as e:
                # what is not committed is not acknowledged: cut the files back
                for seg_id, seg in batch.segs.items():
                    if seg_id in batch.pending_end:
                        try:
                            os.ftruncate(seg.fd, seg.end)
                        except OSError:
                            pass
                if isinstance(e, OSError):
                    raise translate_os_error(e, f"appending to hot tier {self.dir}", key=items[0][0]) from e
                raise

    def _commit_batch(self, batch: _Batch) -> None:
        if not batch.entries:
            return
        if self.durability == "fsync":
            for seg_id in batch.pending_end:
                os.fdatasync(batch.segs[seg_id].fd)
        self._write(lambda txn: self._commit_entries(txn, batch.entries, batch.pending_end))
        for seg_id, end in batch.pending_end.items():
            batch.segs[seg_id].end = end
        # (the key object itself: decoding its bytes again cost a third of the commit)
        for _, seg_id, off, ln, cs, _, key in batch.entries:
            batch.segs[seg_id].index.append(IndexEntry(key, off, ln, cs))
        batch.entries = []
        batch.pending_end = {}

    def _commit_entries(self, txn: lmdb.Transaction, entries, pending_end: dict[int, int]) -> None:
        metas: dict[int, SegmentMeta] = {}

        def meta_of(seg_id: int) -> SegmentMeta | None:
            if seg_id not in metas:
                m = self._get_seg(txn, seg_id)
                if m is None:
                    return None
                metas[seg_id] = m
            return metas[seg_id]

        for kb, seg_id, off, ln, cs, raw_len, key in entries:
            it = key.iteration
            old = txn.get(kb, db=self._db_rec)
            if old is not None:
                o_seg, _, o_len, _, o_raw = REC.unpack(old)
                om = meta_of(o_seg)
                if om is not None:
                    om.live -= 1
                    om.live_bytes -= o_len
                    om.raw_bytes -= o_raw
            txn.put(kb, REC.pack(seg_id, off, ln, cs, raw_len), db=self._db_rec)
            m = meta_of(seg_id)
            m.records += 1
            m.live += 1
            m.live_bytes += ln
            m.raw_bytes += raw_len
            m.lo = min(m.lo, it)
            m.hi = max(m.hi, it)
        for seg_id, end in pending_end.items():
            m = meta_of(seg_id)
            if m is not None:
                m.end = m.file_size = end
        for m in metas.values():
            self._put_seg(txn, m)

    def _seal(self, seg_id: int, index: list[IndexEntry] | None = None) -> SegmentMeta | None:
        """Append the footer to an open segment and mark it sealed (owner only). ``index`` is the
        owner's in-memory list of committed frames; without it the frames are scanned."""
        with self._read() as txn:
            meta = self._get_seg(txn, seg_id)
        if meta is None or meta.state != OPEN:
            return meta
        path = self.seg_path(seg_id)
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                entries = index if index is not None else list(scan_frames(fd, meta.end))
                footer = build_footer(entries, meta.end)
                os.pwrite(fd, footer, meta.end)
                os.ftruncate(fd, meta.end + len(footer))
                if self.durability == "fsync":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise translate_os_error(e, f"sealing segment {path}") from e

        def fn(txn: lmdb.Transaction) -> SegmentMeta | None:
            m = self._get_seg(txn, seg_id)
            if m is None:
                return None
            m.state = SEALED
            m.file_size = meta.end + len(footer)
            self._put_seg(txn, m)
            return m

        sealed = self._write(fn)
        if sealed is not None and self.on_seal is not None:
            self.on_seal(sealed)
        return sealed

    def seal_all(self, channels: set[str] | None = None) -> list[SegmentMeta]:
        """Seal every open segment of this writer (owner only), or only those of ``channels``
        (channel names). Returns what was sealed."""
        out = []
        with self._wlock:
            for name, cur in list(self._active.items()):
                if channels is not None and name not in channels:
                    continue
                os.close(cur.fd)
                del self._active[name]
                m = self._seal(cur.id, cur.index)
                if m is not None:
                    out.append(m)
        return out

    def set_state(self, seg_id: int, state: str, *, cold_name: str | None = None) -> SegmentMeta | None:
        """Move a segment to ``state`` (uploaded / evicted); removes the local file on eviction."""

        def fn(txn: lmdb.Transaction) -> SegmentMeta | None:
            m = self._get_seg(txn, seg_id)
            if m is None:
                return None
            m.state = state
            if cold_name is not None:
                m.cold_name = cold_name
            self._put_seg(txn, m)
            return m

        m = self._write(fn)
        if m is not None and state == EVICTED:
            self.seg_path(seg_id).unlink(missing_ok=True)
            self._sync_dir()
        return m

    def open_segments(self) -> dict[str, int]:
        """The owner's open segments: channel name -> first iteration. In memory, without the write
        lock (a dict copy is atomic under the GIL), so it never waits on a write in progress."""
        return {name: cur.lo for name, cur in self._active.copy().items()}

    # ------------------------------------------------------------------ GC
    def gc(self, watermarks: dict[int, int], *, dry_run: bool) -> tuple[list[RecordKey], list[SegmentMeta]]:
        """Delete index entries of records below their owner's watermark; then remove segments
        that are not open and hold no live record. Returns (keys, segments) deleted (or that
        would be, with ``dry_run``). Never touches a record at or above its watermark.
        """
        doomed: list[bytes] = []
        owners: list[int] = []  # the owner stage of each doomed key
        for name in sorted(self.channels()):
            ch = Channel.parse(name)
            wm = watermarks.get(ch.owner)
            if not wm:
                continue
            doomed.extend(k.encode() for k, _ in self.keys(ch, 0, wm))
            owners += [ch.owner] * (len(doomed) - len(owners))
        dead_segments: list[SegmentMeta] = []
        if dry_run:
            # segments that would become empty
            left: dict[int, int] = {m.id: m.live for m in self.segments()}
            with self._read() as txn:
                for kb in doomed:
                    raw = txn.get(kb, db=self._db_rec)
                    if raw is not None:
                        left[REC.unpack(raw)[0]] -= 1
            dead_segments = [m for m in self.segments() if m.state != OPEN and left.get(m.id, 0) <= 0]
            return [RecordKey.decode(k) for k in doomed], dead_segments

        def fn(txn: lmdb.Transaction) -> None:
            metas: dict[int, SegmentMeta] = {}
            collected = load_collected(txn.get(COLLECTED, db=self._db_meta))
            for kb, owner in zip(doomed, owners, strict=True):
                raw = txn.get(kb, db=self._db_rec)
                if raw is None:
                    continue
                seg_id, _, ln, _, raw_len = REC.unpack(raw)
                m = metas.get(seg_id) or self._get_seg(txn, seg_id)
                if m is not None:
                    m.live -= 1
                    m.live_bytes -= ln
                    m.raw_bytes -= raw_len
                    metas[seg_id] = m
                txn.delete(kb, db=self._db_rec)
                c = collected.setdefault(owner, {"records": 0, "stored_bytes": 0, "below": 0})
                c["records"] += 1
                c["stored_bytes"] += ln
                c["below"] = max(c["below"], watermarks[owner])
            for m in metas.values():
                self._put_seg(txn, m)
            if collected:  # in the deletions' transaction: the tally never misses or repeats one
                txn.put(COLLECTED, json.dumps({str(k): v for k, v in collected.items()}).encode(), db=self._db_meta)

        self._write(fn)
        for m in self.segments():
            if m.state != OPEN and m.live <= 0:
                self._write(lambda txn, i=m.id: txn.delete(U64.pack(i), db=self._db_seg))
                path = self.seg_path(m.id)
                why = _not_the_segment(path, m)
                if why is None:
                    path.unlink(missing_ok=True)
                    self._sync_dir()
                else:  # an index that is not this directory's (copied over it?): its garbage is not these files
                    logger.warning("GC of %s: kept segment file %s: %s", self.dir, path, why)
                dead_segments.append(m)
        return [RecordKey.decode(k) for k in doomed], dead_segments

    def close(self) -> None:
        """Seal nothing, release everything. Open segments stay open and are sealed at next open."""
        if self._closed:
            return
        with self._wlock:
            for cur in self._active.values():
                os.close(cur.fd)
            self._active.clear()
            self._closed = True
            if self._handle is not None:
                release_env(self._handle)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
