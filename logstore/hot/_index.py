"""The hot tier's LMDB index: its entries, its transactions, and every query a reader makes.

:class:`IndexAccess` is the half of :class:`~logstore.hot.HotTier` that any process may use:
short read transactions that adopt a map another process grew, write transactions that grow the
map on ``MapFullError``, damage detection (``CorruptIndexError``), and the queries (segments,
records, documents, local reads checked against their frame headers and checksums).

Never: holds an LMDB transaction across user code; returns bytes it did not checksum.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import lmdb

from logstore import segmap
from logstore.errors import (
    CorruptIndexError,
    CorruptRecordError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    translate_os_error,
)
from logstore.hot._env import DAMAGED_HINT, EnvHandle, RWLock
from logstore.keys import KEY_SIZE, Channel, RecordKey, channel_range
from logstore.segment import FILE_HEADER_SIZE, FRAME_HEADER_SIZE, BlobStream, blob_checksum, check_frame_header

__all__ = [
    "OPEN",
    "SEALED",
    "UPLOADED",
    "EVICTED",
    "SegmentMeta",
    "Location",
    "IndexAccess",
    "REC",
    "U64",
    "F64",
    "COLLECTED",
    "DAMAGE",
    "gap_entry",
    "load_collected",
    "fsync_dir",
]

logger = logging.getLogger(__name__)

OPEN, SEALED, UPLOADED, EVICTED = "open", "sealed", "uploaded", "evicted"

REC = struct.Struct(">QQQQQ")
DAMAGE = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError)  # what LMDB says of damaged pages
_OWN_DAMAGED_HINT = "reopen the store: its writer then re-indexes its segment files"
U64 = struct.Struct(">Q")
F64 = struct.Struct(">d")
COLLECTED = b"gc_collected"  # meta key: JSON {owner stage: {"records", "stored_bytes", "below"}} of what GC deleted
_MAX_MAP = 1 << 40


@dataclass(slots=True)
class SegmentMeta:
    """State of one segment. ``end`` is the acknowledged end of data (frames) in the file."""

    id: int
    channel: str
    lo: int
    hi: int
    state: str = OPEN
    end: int = FILE_HEADER_SIZE
    file_size: int = FILE_HEADER_SIZE
    records: int = 0
    live: int = 0
    live_bytes: int = 0
    raw_bytes: int = 0
    cold_name: str | None = None
    created: float = field(default_factory=time.time)

    def dumps(self) -> bytes:
        return json.dumps([getattr(self, f) for f in _SEG_FIELDS], separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes) -> SegmentMeta:
        try:
            return cls(*json.loads(data))
        except TypeError as e:
            # the wrong number of fields: a damaged entry (JSON errors are ValueErrors, caught by the reader)
            raise json.JSONDecodeError(f"segment entry with {e}", data.decode(errors="replace")[:80], 0) from e

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def chan(self) -> Channel:
        return Channel.parse(self.channel)


_SEG_FIELDS = [f.name for f in fields(SegmentMeta)]


@dataclass(frozen=True, slots=True)
class Location:
    """Where a record's blob is: a segment of one writer, at an offset. ``key``: the record the
    index says is there (a read checks it against the frame header)."""

    writer: str
    segment: SegmentMeta
    offset: int
    length: int
    checksum: int
    raw_len: int
    key: RecordKey | None = None


def gap_entry(key: RecordKey, reason: str) -> tuple[bytes, bytes]:
    """(meta key, value) of the gap document of ``key``'s record: one per (channel, iteration,
    micro-batch), the form ``LogStore.gaps`` reads."""
    name = f"gap/{key.channel.name}/{key.iteration:012d}-{key.micro_batch:06d}"
    doc = {
        "channel": key.channel.name,
        "iteration": key.iteration,
        "micro_batch": key.micro_batch,
        "reason": reason,
        "at": time.time(),
    }
    return b"doc/" + name.encode(), json.dumps(doc, sort_keys=True).encode()


def _nearly_full(path: Path, below: int = 1 << 20) -> bool:
    """Whether the filesystem holding ``path`` has less than ``below`` bytes left for us."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < below


def fsync_dir(d: Path) -> None:
    """Make the creation, rename or deletion of an entry of directory ``d`` durable."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_collected(raw: bytes | None) -> dict[int, dict[str, int]]:
    """The GC tally kept under ``COLLECTED``, owner stages as ints."""
    return {} if raw is None else {int(k): v for k, v in json.loads(raw).items()}


class IndexAccess:
    """LMDB plumbing and queries of one writer's index (see the module docstring). The attributes
    below are set by :class:`~logstore.hot.HotTier` when it opens the index."""

    dir: Path
    writer: str
    owner: bool
    damaged: str | None
    durability: str
    env: Any
    _rw: RWLock
    _db_rec: Any
    _db_seg: Any
    _db_meta: Any
    _seg_dir: Path
    _closed: bool

    def incarnation(self) -> float:
        """When the writer of this hot tier last opened it as its owner (time.time(); 0.0 if never
        recorded): the incarnation its cold uploads carry, whichever process ships them (see
        LogStore's fencing). Read from the index each time: the writer may have reopened since."""
        with self._read() as txn:
            raw = txn.get(b"incarnation", db=self._db_meta)
        return 0.0 if raw is None else float(F64.unpack(raw)[0])

    # ------------------------------------------------------------------ LMDB plumbing
    def _attach(self, handle: EnvHandle) -> None:
        self._handle = handle
        self.env = handle.env
        self._rw = handle.rw
        self._db_rec = handle.db_rec
        self._db_seg = handle.db_seg
        self._db_meta = handle.db_meta

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"hot tier {self.dir} is closed")

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        """A short read transaction. Adopts a map grown by another process (MapResizedError)."""
        self._check_open()
        for _ in range(3):
            with self._rw.shared():
                try:
                    txn = self.env.begin()
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    try:
                        yield txn
                    except (
                        lmdb.Error,
                        UnicodeDecodeError,
                        json.JSONDecodeError,
                        struct.error,
                    ) as e:  # damaged pages or entries
                        self.damaged = f"the LMDB index of {self.dir} cannot be read: {type(e).__name__}: {e}"
                        raise CorruptIndexError(self.damaged, hint=DAMAGED_HINT) from e
                    finally:
                        txn.abort()
                    return
            with self._rw.exclusive():
                self.env.set_mapsize(0)
        raise StoreError(f"LMDB index of {self.dir} keeps being resized; retry")

    def _write(self, fn: Callable[[lmdb.Transaction], object]) -> object:
        """Run ``fn`` in a write transaction, growing the map on MapFullError."""
        self._check_open()
        while True:
            try:
                with self._rw.shared(), self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError as e:
                size = self.env.info()["map_size"]
                if size * 2 > _MAX_MAP:
                    raise StoreFullError(f"LMDB index of {self.dir} is at its size limit", hint="run GC") from e
                with self._rw.exclusive():
                    try:
                        self.env.set_mapsize(size * 2)
                    except lmdb.Error as e2:
                        raise StoreFullError(f"cannot grow LMDB index of {self.dir}: {e2}") from e2
                logger.info("hot tier %s: LMDB map grown to %d MiB", self.dir, size * 2 >> 20)
            except lmdb.MapResizedError:
                with self._rw.exclusive():
                    self.env.set_mapsize(0)
            except lmdb.DiskError as e:
                raise StoreFullError(f"LMDB index of {self.dir}: {e}") from e
            except (*DAMAGE, UnicodeDecodeError, json.JSONDecodeError, struct.error) as e:  # damaged pages or entries
                self.damaged = f"the LMDB index of {self.dir} cannot be read: {type(e).__name__}: {e}"
                raise CorruptIndexError(self.damaged, hint=_OWN_DAMAGED_HINT if self.owner else DAMAGED_HINT) from e
            except lmdb.Error as e:
                # a commit's page writes on a full disk end as EIO ("Input/output error"): ask the disk
                if any(m in str(e) for m in ("No space left", "File too large", "Disk quota exceeded")) or _nearly_full(
                    self.dir
                ):
                    raise StoreFullError(
                        f"LMDB index of {self.dir}: disk full ({e})",
                        hint="free space under the store root or run GC after a checkpoint",
                    ) from e
                raise StoreError(f"LMDB index of {self.dir}: {e}") from e

    def _get_seg(self, txn: lmdb.Transaction, seg_id: int) -> SegmentMeta | None:
        raw = txn.get(U64.pack(seg_id), db=self._db_seg)
        return None if raw is None else SegmentMeta.loads(raw)

    def _put_seg(self, txn: lmdb.Transaction, meta: SegmentMeta) -> None:
        txn.put(U64.pack(meta.id), meta.dumps(), db=self._db_seg)

    def seg_path(self, seg_id: int) -> Path:
        return self._seg_dir / f"{seg_id:010d}.seg"

    def _sync_dir(self) -> None:
        """With durability "fsync", make the creation or deletion of a segment file durable (the
        file's own fdatasync does not cover its name in ``segments/``)."""
        if self.durability == "fsync":
            try:
                fsync_dir(self._seg_dir)
            except OSError as e:
                raise translate_os_error(e, f"syncing {self._seg_dir}") from e

    # ------------------------------------------------------------------ reading
    def check_readable(self) -> None:
        """Walk every entry of the index once (segments and documents decoded, records read):
        raises CorruptIndexError for damaged pages or entries, so that a reader can leave a
        damaged index out instead of failing on it later in every listing."""
        with self._read() as txn:
            for _, v in txn.cursor(db=self._db_seg):
                SegmentMeta.loads(v)
            for k, v in txn.cursor(db=self._db_meta):
                if k.startswith(b"doc/"):
                    k[4:].decode()
                    json.loads(v)
            for k, v in txn.cursor(db=self._db_rec):
                if len(k) != KEY_SIZE or len(v) != REC.size:
                    raise struct.error(f"record entry of {len(k)} + {len(v)} bytes")

    def segments(self) -> list[SegmentMeta]:
        with self._read() as txn:
            return [SegmentMeta.loads(v) for _, v in txn.cursor(db=self._db_seg)]

    def segment(self, seg_id: int) -> SegmentMeta | None:
        with self._read() as txn:
            return self._get_seg(txn, seg_id)

    def lookup(self, key: RecordKey) -> Location | None:
        with self._read() as txn:
            raw = txn.get(key.encode(), db=self._db_rec)
            if raw is None:
                return None
            seg_id, off, ln, cs, raw_len = REC.unpack(raw)
            meta = self._get_seg(txn, seg_id)
        if meta is None:
            return None
        return Location(self.writer, meta, off, ln, cs, raw_len, key)

    def read_local(self, loc: Location) -> bytes | None:
        """The blob at ``loc`` from the local segment file, checksum-verified, and (``loc.key``
        given) under the key its frame header names; None if the file is gone. A file that cannot
        be read (EIO, EACCES, not a file) is a CorruptRecordError like a checksum mismatch: the
        caller reads another copy or reports it, never a bare OSError."""
        path = self.seg_path(loc.segment.id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CorruptRecordError(
                f"unreadable segment file {path} in hot tier {self.dir}: {e.strerror or e}", key=None
            ) from e
        try:
            head = os.pread(fd, FRAME_HEADER_SIZE, loc.offset - FRAME_HEADER_SIZE) if loc.key is not None else b""
            blob = os.pread(fd, loc.length, loc.offset)
        except OSError as e:
            raise CorruptRecordError(
                f"unreadable segment file {path} in hot tier {self.dir}: {e.strerror or e}", key=None
            ) from e
        finally:
            os.close(fd)
        if loc.key is not None:
            where = f"hot tier {self.dir} segment {loc.segment.id} at offset {loc.offset}"
            check_frame_header(head, loc.key, loc.length, loc.checksum, where)
        if len(blob) != loc.length or blob_checksum(blob) != loc.checksum:
            raise CorruptRecordError(
                f"corrupt record in hot tier {self.dir} segment {loc.segment.id} at offset {loc.offset}",
                key=None,
            )
        return blob

    def stream_local(self, loc: Location, key: RecordKey, chunk_size: int = 1 << 20) -> BlobStream | None:
        """The blob at ``loc`` as a :class:`BlobStream` (verified as it is read) from the local
        segment file; None if the file is gone. Raises CorruptRecordError at once for a one-chunk
        record that does not match, otherwise while streaming (instead of the last chunk)."""
        try:
            fd = os.open(self.seg_path(loc.segment.id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CorruptRecordError(
                f"unreadable segment file {self.seg_path(loc.segment.id)} in hot tier {self.dir}: {e.strerror or e}",
                key=key,
            ) from e
        where = f"hot tier {self.dir} segment {loc.segment.id} at offset {loc.offset}"
        try:
            head = os.pread(fd, FRAME_HEADER_SIZE, loc.offset - FRAME_HEADER_SIZE)
            check_frame_header(head, key, loc.length, loc.checksum, where)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError):
                raise CorruptRecordError(
                    f"unreadable segment file {self.seg_path(loc.segment.id)} in hot tier "
                    f"{self.dir}: {e.strerror or e}",
                    key=key,
                ) from e
            raise
        view = self._mapped(fd, loc) if loc.segment.state != OPEN else None
        if view is not None:
            os.close(fd)
            return BlobStream.of_view(key, view, loc.checksum, chunk_size, where)
        return BlobStream.of_file(key, fd, loc.offset, loc.length, loc.checksum, chunk_size, where)

    def _mapped(self, fd: int, loc: Location) -> memoryview | None:
        """The blob at ``loc`` as a view of the process's map of its sealed segment file, or None when
        the maps are off or refuse the file (``logstore.segmap``: another size than the index says).
        Never maps an open segment: its writer's crash recovery may cut it."""
        maps = segmap.installed()
        if maps is None:
            return None
        try:
            return maps.view(fd, loc.offset, loc.length, loc.segment.file_size)
        except OSError as e:  # pread reads it, or says why not
            logger.debug("hot tier %s: segment %d not mapped: %s", self.dir, loc.segment.id, e)
            return None

    def keys(
        self,
        channel: Channel | None = None,
        it_lo: int = 0,
        it_hi: int | None = None,
        *,
        after: bytes | None = None,
        limit: int | None = None,
    ) -> list[tuple[RecordKey, Location]]:
        """Index entries (key order) of one channel's iteration range, or of everything.

        ``after`` (an encoded key) starts strictly after that key and ``limit`` stops after that
        many entries, so a caller can page through a large index reading only one page.
        """
        out: list[tuple[RecordKey, Location]] = []
        if limit is not None and limit <= 0:
            return out
        with self._read() as txn:
            cur = txn.cursor(db=self._db_rec)
            if channel is None:
                start, end = b"", None
            else:
                start, end = channel_range(channel, it_lo, it_hi)
            if after is not None and after >= start:
                start = after
            if not (cur.set_range(start) if start else cur.first()):
                return out
            seg_cache: dict[int, SegmentMeta | None] = {}
            for kb, v in cur.iternext():
                if end is not None and kb >= end:
                    break
                if kb == after:
                    continue
                seg_id, off, ln, cs, raw_len = REC.unpack(v)
                if seg_id not in seg_cache:
                    seg_cache[seg_id] = self._get_seg(txn, seg_id)
                meta = seg_cache[seg_id]
                if meta is not None:
                    k = RecordKey.decode(kb)
                    out.append((k, Location(self.writer, meta, off, ln, cs, raw_len, k)))
                    if limit is not None and len(out) >= limit:
                        break
        return out

    def channels(self) -> set[str]:
        return {m.channel for m in self.segments()}

    def record_channels(self) -> list[Channel]:
        """Channels with at least one index entry, in key order: one cursor seek per channel."""
        out: list[Channel] = []
        with self._read() as txn:
            cur = txn.cursor(db=self._db_rec)
            ok = cur.first()
            while ok:
                ch = RecordKey.decode(cur.key()).channel
                out.append(ch)
                ok = cur.set_range(channel_range(ch)[1])
        return out

    def collected(self) -> dict[int, dict[str, int]]:
        """What GC deleted from this hot tier so far: owner stage -> ``{"records", "stored_bytes",
        "below"}`` (``below``: the highest watermark that collected any). Empty before the first GC."""
        with self._read() as txn:
            return load_collected(txn.get(COLLECTED, db=self._db_meta))

    # ------------------------------------------------------------------ documents
    def record_gap(self, channel: Channel, iteration: int, micro_batch: int, reason: str) -> None:
        """Note in the index that the record (``channel``, ``iteration``, ``micro_batch``) was not
        logged, or was lost (a ``gap/...`` document; ``LogStore.gaps`` lists them)."""
        entry = gap_entry(RecordKey(channel, iteration, micro_batch), reason)
        self._write(lambda txn: txn.put(*entry, db=self._db_meta))

    def put_doc(self, name: str, obj: dict) -> None:
        data = json.dumps(obj, sort_keys=True).encode()
        self._write(lambda txn: txn.put(b"doc/" + name.encode(), data, db=self._db_meta))

    def delete_doc(self, name: str) -> None:
        """Remove a document; a missing one is success."""
        self._write(lambda txn: txn.delete(b"doc/" + name.encode(), db=self._db_meta))

    def docs(self, prefix: str = "") -> dict[str, dict]:
        p = b"doc/" + prefix.encode()
        out = {}
        with self._read() as txn:
            cur = txn.cursor(db=self._db_meta)
            if cur.set_range(p):
                for k, v in cur:
                    if not k.startswith(p):
                        break
                    out[k[4:].decode()] = json.loads(v)
        return out

    # ------------------------------------------------------------------ segment ids
    def number_past(self, top: int) -> bool:
        """Number new segments from ``top + 1`` at least (owner only); True when that moved the
        numbering. The store calls it with the highest id this writer's name already has in the
        cold tier: a writer restarted on a fresh root (a rollback) must not reuse the names of its
        previous incarnation's uploads, which the cold tier refuses (immutable, other bytes)."""

        def fn(txn: lmdb.Transaction) -> int:
            nxt = self._next_seg(txn)
            if nxt <= top:
                txn.put(b"next_seg", U64.pack(top + 1), db=self._db_meta)
            return nxt

        return bool(top) and self._write(fn) <= top  # type: ignore[operator]

    def reserve_id(self) -> int:
        """A segment id no segment of this writer has or will get (owner only): for the cold name
        of a segment whose own name the cold tier holds with other bytes."""

        def fn(txn: lmdb.Transaction) -> int:
            nxt = self._next_seg(txn)
            txn.put(b"next_seg", U64.pack(nxt + 1), db=self._db_meta)
            return nxt

        return int(self._write(fn))  # type: ignore[arg-type]

    def _next_seg(self, txn: lmdb.Transaction) -> int:
        """The id the next new segment gets (1 in a fresh index)."""
        raw = txn.get(b"next_seg", db=self._db_meta)
        return 1 if raw is None else U64.unpack(raw)[0]

    # ------------------------------------------------------------------ sizes
    def disk_bytes(self) -> int:
        """Bytes on disk: LMDB files plus segment files (what a rolling window must bound)."""
        total = 0
        for sub in (self.dir / "index", self._seg_dir):
            if sub.is_dir():
                for p in sub.iterdir():
                    try:
                        total += p.stat().st_blocks * 512
                    except FileNotFoundError:
                        pass
        return total
