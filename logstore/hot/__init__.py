"""The hot tier: LMDB as the index of append-only segment files, one environment per writer.

Layout under a node's store root::

    <root>/<run>/<writer>/index/          LMDB environment (data.mdb, lock.mdb)
    <root>/<run>/<writer>/segments/<id>.seg   segment files (see logstore.segment)
    <root>/<run>/<writer>/writer.lock     flock held by the one process that appends

Why this layout: record bytes never enter LMDB, so a rolling window (append new iterations,
GC old ones) cannot fragment LMDB's free pages; deleting a dead segment returns its space to the
filesystem at once. LMDB holds only small fixed-size index entries and segment states, and gives
other processes (server, CLI) consistent reads while the trainer writes.

Sub-databases:
- ``records``:  encoded RecordKey -> (segment id, blob offset, blob length, blob xxh3, raw length)
- ``segments``: segment id (u64) -> JSON SegmentMeta (channel, iteration range, state, sizes)
- ``meta``:     counters and small documents (next segment id, checkpoints, what GC collected)

Durability modes (``durability``):
- ``"process"`` (default): a put returns after the frame was written (page cache) and the index
  transaction committed without fsync. Survives the death of the writing process (SIGKILL,
  OOM). A power loss or kernel crash can lose the last records (file pages and index pages
  reach the disk independently) and can damage the index; the next open names what is lost
  (gaps) and never serves wrong bytes (see crash consistency).
- ``"fsync"``: segment data is fdatasync'ed and the LMDB commit is synced before a put returns;
  ``segments/`` is synced after a segment file is created or deleted.

The environment is opened without ``writemap``: a commit writes its pages with write() calls, so
a full disk is an error the writer reports (StoreFullError; logging degrades, training goes on),
never a SIGBUS from a page of a sparse mapped file the disk cannot back (what ``writemap`` did).
It costs little: a commit of 8 index entries takes 13.5 us instead of 9.3 us (0.7 % of the store
bench's hot-ingest round). LMDB's copy-on-write tree
keeps a killed writer's uncommitted pages unreachable either way.

Crash consistency: frames are written before the index entry that points to them commits, so
an acknowledged record is always complete after a process death. On open, the writer walks its
index, truncates every open segment to the end recorded in the index (dropping frames whose
commit never happened) and seals it. After a power loss: an open segment file shorter than that
end keeps its whole frames, and each record acknowledged past them is recorded as a gap; an
index that cannot be read is moved aside (``index.damaged-<time>``, kept) and the segment files
are re-indexed (a frame cut short that names its record is a gap). Every read compares the
frame header (key, length, checksum) with the index entry and the bytes with the checksum.

Never: holds an LMDB transaction across user code; returns bytes it did not checksum.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path

import lmdb

from logstore import codec
from logstore.errors import (
    CodecError,
    ConfigError,
    CorruptIndexError,
    CorruptRecordError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    SwiftlogError,
    translate_os_error,
)
from logstore.keys import KEY_SIZE, Channel, RecordKey, channel_range
from logstore.segment import (
    FILE_HEADER,
    FILE_HEADER_SIZE,
    FRAME_HEADER_SIZE,
    MAGIC,
    TRAILER_SIZE,
    BlobStream,
    IndexEntry,
    blob_checksum,
    build_footer,
    check_frame_header,
    encode_frame_header,
    read_footer,
    scan_frames,
)

__all__ = ["HotTier", "SegmentMeta", "Location", "OPEN", "SEALED", "UPLOADED", "EVICTED"]

logger = logging.getLogger(__name__)

OPEN, SEALED, UPLOADED, EVICTED = "open", "sealed", "uploaded", "evicted"

_REC = struct.Struct(">QQQQQ")
_DAMAGE = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError)  # what LMDB says of damaged pages
_DAMAGED_HINT = (
    "swiftlog verify lists it; what its writer uploaded is still read from the cold tier"  # a CorruptIndexError's
)
_OWN_DAMAGED_HINT = "reopen the store: its writer then re-indexes its segment files"
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")
_COLLECTED = b"gc_collected"  # meta key: JSON {owner stage: {"records", "stored_bytes", "below"}} of what GC deleted
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
        except (
            TypeError
        ) as e:  # the wrong number of fields: a damaged entry (JSON errors are ValueErrors, caught by the reader)
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


class _RWLock:
    """Many readers or one exclusive holder; used so an LMDB map resize never races a transaction."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def _gap_entry(key: RecordKey, reason: str) -> tuple[bytes, bytes]:
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


class _EnvHandle:
    """One LMDB environment per process and path (LMDB forbids opening it twice in a process)."""

    def __init__(self, path: Path, sync: bool, map_size: int, create: bool = True) -> None:
        """``create=False`` (a reader of another writer's index): never creates the environment or
        its databases (a damaged or emptied index would be overwritten by a fresh one, and the
        evidence lost), and refuses one whose file is shorter than its last page: reading it
        through the memory map would kill the process (SIGBUS)."""
        self.path = path
        self.pid = os.getpid()
        if not create and not (path / "data.mdb").is_file():  # LMDB would create a fresh one in the directory
            raise CorruptIndexError(
                f"the LMDB index of {path.parent} is missing (no {path / 'data.mdb'}): its segment files are not "
                "readable until its writer reopens the store (it re-indexes them)"
            )
        self.env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=4,
            subdir=True,
            sync=sync,
            metasync=sync,
            readahead=False,
            max_readers=512,
            lock=True,
            writemap=False,
            create=create,
        )
        try:
            if (path / "data.mdb").is_file():  # a read through the map past the file's end is a SIGBUS
                size, need = (
                    os.path.getsize(path / "data.mdb"),
                    (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"],
                )
                if size < need:
                    raise CorruptIndexError(
                        f"the LMDB index of {path.parent} is truncated: {size} bytes, its pages need {need}",
                        hint=_DAMAGED_HINT,
                    )
            # stale reader slots of dead processes would pin old pages forever
            self.env.reader_check()
            self.rw = _RWLock()
            self.refs = 0
            self.db_rec = self.env.open_db(b"records", create=create)
            self.db_seg = self.env.open_db(b"segments", create=create)
            self.db_meta = self.env.open_db(b"meta", create=create)
        except BaseException:
            self.env.close()
            raise


_ENVS: dict[str, _EnvHandle] = {}
_ENVS_LOCK = threading.Lock()


def _open_env(path: Path, sync: bool, map_size: int, create: bool = True) -> _EnvHandle:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        h = _ENVS.get(key)
        if h is None or h.pid != os.getpid():  # after fork, never reuse the parent's env
            h = _EnvHandle(Path(key), sync, map_size, create)
            _ENVS[key] = h
        h.refs += 1
        return h


def _release_env(h: _EnvHandle) -> None:
    with _ENVS_LOCK:
        h.refs -= 1
        if h.refs <= 0 and h.pid == os.getpid():
            if _ENVS.get(str(h.path)) is h:
                del _ENVS[str(h.path)]
            h.env.close()


def _forget_env(h: _EnvHandle) -> None:
    """Release ``h`` and never hand it out again: its directory is being replaced (another holder
    in this process keeps it until it releases it)."""
    with _ENVS_LOCK:
        if _ENVS.get(str(h.path)) is h:
            del _ENVS[str(h.path)]
    _release_env(h)


def _salvage_docs(path: Path) -> dict[bytes, bytes]:
    """The documents (``doc/...`` entries: gaps, checkpoint registrations) still readable in the
    damaged index at ``path``, best effort: what a damaged page hides is left behind. Opens it
    read-only, and only when its file holds all its pages (reading past the end is a SIGBUS)."""
    out: dict[bytes, bytes] = {}
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, create=False, max_dbs=4, subdir=True, readahead=False)
    except lmdb.Error:
        return out
    try:
        if os.path.getsize(path / "data.mdb") < (env.info()["last_pgno"] + 1) * env.stat()["psize"]:
            return out
        db = env.open_db(b"meta", create=False)
        with env.begin(db=db) as txn:
            for k, v in txn.cursor():
                if k.startswith(b"doc/"):
                    k[4:].decode()
                    json.loads(v)
                    out[bytes(k)] = bytes(v)
    except (lmdb.Error, OSError, UnicodeDecodeError, ValueError):
        pass
    finally:
        env.close()
    return out


def _fsync_dir(d: Path) -> None:
    """Make the creation, rename or deletion of an entry of directory ``d`` durable."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_collected(raw: bytes | None) -> dict[int, dict[str, int]]:
    """The GC tally kept under ``_COLLECTED``, owner stages as ints."""
    return {} if raw is None else {int(k): v for k, v in json.loads(raw).items()}


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


class HotTier:
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
        self._handle: _EnvHandle | None = None
        damaged: str | None = None  # why the owner's own index cannot be used
        try:
            if owner:
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
                self._attach(_open_env(self.dir / "index", durability == "fsync", map_size, create=owner))
            except (*_DAMAGE, CorruptIndexError) as e:
                if not owner:
                    raise
                damaged = f"it cannot be opened: {type(e).__name__}: {e}"
        except OSError as e:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise translate_os_error(e, f"opening hot tier {self.dir}") from e
        except lmdb.Error as e:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            if not owner:  # a reader creates nothing: an index it cannot open is damaged (or not one)
                raise CorruptIndexError(
                    f"the LMDB index of {self.dir} cannot be opened: {e}", hint=_DAMAGED_HINT
                ) from e
            raise StoreError(f"opening LMDB index of {self.dir}: {e}") from e
        if owner:
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
                self._write(lambda txn: txn.put(b"incarnation", _F64.pack(opened), db=self._db_meta))
            except BaseException:
                self.close()
                raise

    def _attach(self, handle: _EnvHandle) -> None:
        self._handle = handle
        self.env = handle.env
        self._rw = handle.rw
        self._db_rec = handle.db_rec
        self._db_seg = handle.db_seg
        self._db_meta = handle.db_meta

    def _replace_damaged_index(self, why: str) -> None:
        """The owner's own index is damaged (``why``): move it aside, kept for a post-mortem, start a
        fresh one with the documents (gaps, checkpoint registrations) still readable in the old one,
        and re-index every segment file from its footer or frames (``_recover``). Records in no
        file here (evicted: they are in the cold tier) are no longer in this index."""
        if self._handle is not None:
            _forget_env(self._handle)
            self._handle = None
        index = self.dir / "index"
        docs = _salvage_docs(index)
        aside = self.dir / f"index.damaged-{datetime.now(UTC):%Y%m%dT%H%M%S.%fZ}"
        try:
            os.replace(index, aside)
            _fsync_dir(self.dir)
        except OSError as e:
            raise translate_os_error(e, f"moving the damaged LMDB index of {self.dir} aside") from e
        self.damaged = None
        try:
            self._attach(_open_env(index, self.durability == "fsync", self._map_size, create=True))
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

    def incarnation(self) -> float:
        """When the writer of this hot tier last opened it as its owner (time.time(); 0.0 if never
        recorded): the incarnation its cold uploads carry, whichever process ships them (see
        LogStore's fencing). Read from the index each time: the writer may have reopened since."""
        with self._read() as txn:
            raw = txn.get(b"incarnation", db=self._db_meta)
        return 0.0 if raw is None else float(_F64.unpack(raw)[0])

    # ------------------------------------------------------------------ LMDB plumbing
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
                        raise CorruptIndexError(self.damaged, hint=_DAMAGED_HINT) from e
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
            except (*_DAMAGE, UnicodeDecodeError, json.JSONDecodeError, struct.error) as e:  # damaged pages or entries
                self.damaged = f"the LMDB index of {self.dir} cannot be read: {type(e).__name__}: {e}"
                raise CorruptIndexError(self.damaged, hint=_OWN_DAMAGED_HINT if self.owner else _DAMAGED_HINT) from e
            except (
                lmdb.Error
            ) as e:  # a commit's page writes on a full disk end as EIO ("Input/output error"): ask the disk
                if any(m in str(e) for m in ("No space left", "File too large", "Disk quota exceeded")) or _nearly_full(
                    self.dir
                ):
                    raise StoreFullError(
                        f"LMDB index of {self.dir}: disk full ({e})",
                        hint="free space under the store root or run GC after a checkpoint",
                    ) from e
                raise StoreError(f"LMDB index of {self.dir}: {e}") from e

    def _get_seg(self, txn: lmdb.Transaction, seg_id: int) -> SegmentMeta | None:
        raw = txn.get(_U64.pack(seg_id), db=self._db_seg)
        return None if raw is None else SegmentMeta.loads(raw)

    def _put_seg(self, txn: lmdb.Transaction, meta: SegmentMeta) -> None:
        txn.put(_U64.pack(meta.id), meta.dumps(), db=self._db_seg)

    def seg_path(self, seg_id: int) -> Path:
        return self._seg_dir / f"{seg_id:010d}.seg"

    def _sync_dir(self) -> None:
        """With durability "fsync", make the creation or deletion of a segment file durable (the
        file's own fdatasync does not cover its name in ``segments/``)."""
        if self.durability == "fsync":
            try:
                _fsync_dir(self._seg_dir)
            except OSError as e:
                raise translate_os_error(e, f"syncing {self._seg_dir}") from e

    # ------------------------------------------------------------------ writer side
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
            if meta.state != OPEN:
                continue
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
                continue
            except OSError as e:
                raise translate_os_error(e, f"reading segment {path}") from e
            if not headed:
                aside = path.with_name(path.name + ".unreadable")
                os.replace(path, aside)
                logger.warning(
                    "hot tier %s: open segment file %s (%d bytes) has no segment header (its creation failed, e.g. on a full "
                    "disk): moved to %s, its index entries dropped (recorded as gaps)",
                    self.dir,
                    path,
                    size,
                    aside.name,
                )
                self._sync_dir()
                why = f"lost: open segment file {path.name} had no header (moved to {aside.name})"
                self._drop_segment_entries(meta.id, why)
                continue
            if size < meta.end:
                self._cut_torn(meta, path, size)
                continue
            if size > meta.end:
                try:
                    found = _read_orphan(path)
                except (SwiftlogError, OSError):
                    found = None
                if (
                    found is not None and found[3] and found[1] >= meta.end
                ):  # sealed on disk, with more: the index is an older copy
                    logger.warning(
                        "hot tier %s: segment %d is sealed on disk (%d records) but open in the index at %d bytes (an older copy "
                        "of the index?): re-indexed from its footer, not truncated",
                        self.dir,
                        meta.id,
                        len(found[0]),
                        meta.end,
                    )
                    self._drop_segment_entries(meta.id)
                    self._adopt_file(path, found)
                    continue
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
                    seg_id, off, ln, _, raw_len = _REC.unpack(v)
                    if seg_id == m.id and off + ln > end:
                        lost.append((bytes(kb), ln, raw_len))
            for kb, ln, raw_len in lost:
                txn.delete(kb, db=self._db_rec)
                m.live, m.live_bytes, m.raw_bytes = m.live - 1, m.live_bytes - ln, m.raw_bytes - raw_len
                txn.put(*_gap_entry(RecordKey.decode(kb), reason), db=self._db_meta)
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

    def record_gap(self, channel: Channel, iteration: int, micro_batch: int, reason: str) -> None:
        """Note in the index that the record (``channel``, ``iteration``, ``micro_batch``) was not
        logged, or was lost (a ``gap/...`` document; ``LogStore.gaps`` lists them)."""
        entry = _gap_entry(RecordKey(channel, iteration, micro_batch), reason)
        self._write(lambda txn: txn.put(*entry, db=self._db_meta))

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

    def _adopt_file(self, path: Path, known: _Orphan | None = None) -> bool:
        """Index the segment file ``path`` (not in the index) from its footer or frames; False
        (with a warning) when it cannot be read that way. A last frame cut short whose header names
        its record is recorded as a gap: nothing says whether it had been acknowledged."""
        seg_id = int(path.name[:-4])
        try:
            entries, end, size, sealed, torn = known if known is not None else _read_orphan(path)
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
                txn.put(*_gap_entry(torn, why), db=self._db_meta)

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

    def number_past(self, top: int) -> bool:
        """Number new segments from ``top + 1`` at least (owner only); True when that moved the
        numbering. The store calls it with the highest id this writer's name already has in the
        cold tier: a writer restarted on a fresh root (a rollback) must not reuse the names of its
        previous incarnation's uploads, which the cold tier refuses (immutable, other bytes)."""

        def fn(txn: lmdb.Transaction) -> int:
            nxt = self._next_seg(txn)
            if nxt <= top:
                txn.put(b"next_seg", _U64.pack(top + 1), db=self._db_meta)
            return nxt

        return bool(top) and self._write(fn) <= top  # type: ignore[operator]

    def reserve_id(self) -> int:
        """A segment id no segment of this writer has or will get (owner only): for the cold name
        of a segment whose own name the cold tier holds with other bytes."""

        def fn(txn: lmdb.Transaction) -> int:
            nxt = self._next_seg(txn)
            txn.put(b"next_seg", _U64.pack(nxt + 1), db=self._db_meta)
            return nxt

        return int(self._write(fn))  # type: ignore[arg-type]

    def _next_seg(self, txn: lmdb.Transaction) -> int:
        """The id the next new segment gets (1 in a fresh index)."""
        raw = txn.get(b"next_seg", db=self._db_meta)
        return 1 if raw is None else _U64.unpack(raw)[0]

    def _number_past_files(self) -> None:
        top = max(self.file_ids(), default=0)
        if self.number_past(top) and (orphans := self.orphan_files()):  # (re-indexed files are no orphans)
            logger.warning(
                "hot tier %s: %d segment file(s) are not in its index (index lost or replaced?), e.g. %s: kept; new segments "
                "are numbered from %d",
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
            doomed = [bytes(k) for k, v in cur if _REC.unpack(v)[0] == seg_id]
            for k in doomed:
                txn.delete(k, db=self._db_rec)
                if gap_reason is not None:
                    txn.put(*_gap_entry(RecordKey.decode(k), gap_reason), db=self._db_meta)
            txn.delete(_U64.pack(seg_id), db=self._db_seg)

        self._write(fn)

    def _new_segment(self, channel: Channel, iteration: int) -> _Open:
        def fn(txn: lmdb.Transaction) -> SegmentMeta:
            seg_id = self._next_seg(txn)
            txn.put(b"next_seg", _U64.pack(seg_id + 1), db=self._db_meta)
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
        for (
            _,
            seg_id,
            off,
            ln,
            cs,
            _,
            key,
        ) in batch.entries:  # (the key object itself: decoding its bytes again cost a third of the commit)
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
                o_seg, _, o_len, _, o_raw = _REC.unpack(old)
                om = meta_of(o_seg)
                if om is not None:
                    om.live -= 1
                    om.live_bytes -= o_len
                    om.raw_bytes -= o_raw
            txn.put(kb, _REC.pack(seg_id, off, ln, cs, raw_len), db=self._db_rec)
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

    # ------------------------------------------------------------------ reading
    def open_segments(self) -> dict[str, int]:
        """The owner's open segments: channel name -> first iteration. In memory, without the write
        lock (a dict copy is atomic under the GIL), so it never waits on a write in progress."""
        return {name: cur.lo for name, cur in self._active.copy().items()}

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
                if len(k) != KEY_SIZE or len(v) != _REC.size:
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
            seg_id, off, ln, cs, raw_len = _REC.unpack(raw)
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
        return BlobStream.of_file(key, fd, loc.offset, loc.length, loc.checksum, chunk_size, where)

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
                seg_id, off, ln, cs, raw_len = _REC.unpack(v)
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
                        left[_REC.unpack(raw)[0]] -= 1
            dead_segments = [m for m in self.segments() if m.state != OPEN and left.get(m.id, 0) <= 0]
            return [RecordKey.decode(k) for k in doomed], dead_segments

        def fn(txn: lmdb.Transaction) -> None:
            metas: dict[int, SegmentMeta] = {}
            collected = _load_collected(txn.get(_COLLECTED, db=self._db_meta))
            for kb, owner in zip(doomed, owners, strict=True):
                raw = txn.get(kb, db=self._db_rec)
                if raw is None:
                    continue
                seg_id, _, ln, _, raw_len = _REC.unpack(raw)
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
                txn.put(_COLLECTED, json.dumps({str(k): v for k, v in collected.items()}).encode(), db=self._db_meta)

        self._write(fn)
        for m in self.segments():
            if m.state != OPEN and m.live <= 0:
                self._write(lambda txn, i=m.id: txn.delete(_U64.pack(i), db=self._db_seg))
                path = self.seg_path(m.id)
                why = _not_the_segment(path, m)
                if why is None:
                    path.unlink(missing_ok=True)
                    self._sync_dir()
                else:  # an index that is not this directory's (copied over it?): its garbage is not these files
                    logger.warning("GC of %s: kept segment file %s: %s", self.dir, path, why)
                dead_segments.append(m)
        return [RecordKey.decode(k) for k in doomed], dead_segments

    def collected(self) -> dict[int, dict[str, int]]:
        """What GC deleted from this hot tier so far: owner stage -> ``{"records", "stored_bytes",
        "below"}`` (``below``: the highest watermark that collected any). Empty before the first GC."""
        with self._read() as txn:
            return _load_collected(txn.get(_COLLECTED, db=self._db_meta))

    # ------------------------------------------------------------------ documents
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
                _release_env(self._handle)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None


_Orphan = tuple[list[tuple[IndexEntry, int]], int, int, bool, "RecordKey | None"]


def _read_orphan(path: Path) -> _Orphan:
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
