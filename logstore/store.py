"""The tiered log store: hot LMDB-indexed segments on the node, sealed segments in the cold tier.

One ``LogStore`` serves one run on one node's store root. A training process opens it with a
``writer`` name and appends; the server, the CLI and the replay engine open the same root
without a writer and read every writer's hot tier plus the cold tier (reads fall through
hot -> cold, and a key is never returned unless its checksums match).

Background upload: sealing a segment queues it for the uploader thread, which copies the sealed
file byte-for-byte to the cold tier (commit marker last). Upload state lives in the hot tier's
LMDB index and is reconciled against the cold listing at open, so a crash at any point
converges (uploads are idempotent). While the object store is down, segments simply stay
``sealed`` in the hot tier and uploads resume with backoff; ``stats()`` reports the backlog and
the last error.

Retention: ``register_checkpoint(stage, c)`` records a durable checkpoint (in the cold tier when
there is one: it is the place every node and a replacement can read; and in the local index).
The watermark of stage k is its newest registered iteration. ``gc()`` deletes, in both tiers,
exactly the records received by stage k below k's watermark (see ``Channel.owner``): hot index
entries at once, hot segment files and cold objects once every record in them is garbage.
Reads and scans never return a record below its watermark.

Never: blocks a writer's ``put`` on the object store (uploads run in the background; what reaches
the cold tier, ``flush``/``verify``/``gc``, reads of records only it holds, listings and ``stats``,
waits for it, bounded by its timeouts and retries); deletes a record at or above its owner's
watermark; returns bytes that fail their checksum.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch

from logstore import codec
from logstore.checkpoints import (
    CheckpointInfo,
    check_meta,
    cold_name,
    hot_name,
    parse_cold_name,
    parse_doc,
    parse_hot_name,
)
from logstore.cold import ColdTier
from logstore.config import StoreConfig
from logstore.errors import (
    ColdTierUnavailableError,
    ConfigError,
    CorruptIndexError,
    CorruptRecordError,
    RecordNotFoundError,
    SegmentClashError,
    StoreError,
    StoreFullError,
    SwiftlogError,
    WriterFencedError,
)
from logstore.hot import EVICTED, OPEN, SEALED, UPLOADED, HotTier, Location, SegmentMeta
from logstore.keys import Channel, Kind, RecordKey
from logstore.reports import GcReport, RecordInfo, UnregisterPreview, VerifyReport
from logstore.segment import (
    FRAME_HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    TRAILER_SIZE,
    BlobStream,
    blob_checksum,
    check_frame_header,
    parse_index,
    parse_trailer,
)

__all__ = ["LogStore", "Encoded", "list_runs", "writers_under"]

logger = logging.getLogger(__name__)

_COLD_SEG_RE = re.compile(r"^(?P<lo>\d{12})-(?P<hi>\d{12})\.(?P<writer>[A-Za-z0-9._-]+)\.(?P<seg>\d{10})\.seg$")


_PRECIOUS_KINDS = frozenset({Kind.INPUT, Kind.TARGET, Kind.META, Kind.REDUCED})


def _precious(channel: str, first: set[str]) -> bool:
    """Uploaded before the bulk: channels sealed through ``seal()`` and, even without that (a writer
    reopened, another process's flush), inputs, targets and META: what only their stage had."""
    if channel in first:
        return True
    try:
        return Channel.parse(channel).kind in _PRECIOUS_KINDS
    except SwiftlogError:
        return False


def _cold_name_parts(name: str) -> re.Match[str] | None:
    """lo, hi, writer and segment id of a cold segment's name (None for a name not of the form)."""
    return _COLD_SEG_RE.match(name.rsplit("/", 1)[-1])


def _seg_number(seg: _ColdSeg) -> int:
    """The segment id in a cold segment's name (0 for a name not of the form)."""
    m = _cold_name_parts(seg.name)
    return int(m["seg"]) if m else 0


def _group_watermarks(wm: dict[int, int], groups: Any) -> dict[int, int]:
    """``wm`` with each logging group's members at the group's oldest newest checkpoint (a member
    without one: 0, nothing of the group is garbage). ``groups``: sizes of consecutive groups."""
    if not isinstance(groups, list) or not all(isinstance(n, int) and n > 0 for n in groups):
        return wm
    out, first = dict(wm), 0
    for n in groups:
        members = range(first, first + n)
        low = min(wm.get(k, 0) for k in members)
        for k in members:
            if k in out or low:
                out[k] = low
        first += n
    return out


def _open_reader(directory: Path) -> HotTier:
    """Another writer's hot tier opened to read, its index walked once (``check_readable``): a
    damaged index is left out when it is opened, not met in every later listing. Raises StoreError
    (CorruptIndexError for a damaged, truncated or missing index)."""
    reader = HotTier(directory, owner=False)
    try:
        reader.check_readable()
    except CorruptIndexError:
        reader.close()
        raise
    return reader


_FENCED_HINT = "its records stay in its hot tier; stop its process (its stage was replaced)"


def _incarnation_of(meta: dict[str, Any]) -> float:
    v = meta.get("incarnation")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _copy_age(seg: _ColdSeg) -> tuple[float, int]:
    """Sort key of the copies of a record, newest last: the later incarnation of the writer (when
    it opened; a replacement, a rollback's restart), then the higher segment id. Segments uploaded
    without an incarnation count as the oldest."""
    return seg.incarnation, _seg_number(seg)


class Encoded(NamedTuple):
    """An encoded record ready for ``LogStore.put_encoded`` (made by ``LogStore.encode``)."""

    key: RecordKey
    blob: bytes
    raw_len: int
    checksum: int


@dataclass(frozen=True, slots=True)
class _ColdSeg:
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


def list_runs(root: str | os.PathLike[str]) -> list[str]:
    """Runs with a hot tier under ``root`` (directories with at least one writer index)."""
    p = Path(root)
    if not p.is_dir():
        return []
    return sorted(d.name for d in p.iterdir() if d.is_dir() and writers_under(d))


def writers_under(run_dir: str | os.PathLike[str]) -> list[str]:
    """Writers with a hot tier (an index) under a run's directory; [] when it cannot be read."""
    try:
        return sorted(w.name for w in Path(run_dir).iterdir() if (w / "index").is_dir())
    except OSError:
        return []


class LogStore:
    """Tiered store of one run on one node. Thread-safe; see the module docstring."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.run = config.run
        self.root = Path(config.root)
        self._run_dir = self.root / self.run
        self._closed = False
        self._lock = threading.RLock()
        self._upload_lock = threading.Lock()
        self._readers: dict[str, HotTier] = {}
        self._unreadable: dict[str, tuple[str, float]] = {}  # writer -> why its index was left out (damaged), and when
        self._readers_scanned = 0.0
        self._footers: OrderedDict[str, dict[bytes, Any]] = OrderedDict()
        self._cold_list: dict[str, list[_ColdSeg]] | None = None
        self._cold_list_at = 0.0
        self._cold_epoch = 0  # bumped (under _lock) whenever _cold_list is invalidated
        self._cold_listing = threading.Lock()  # one cold listing at a time, never under _lock
        self._gaps_shipped: set[str] = set()
        self._wm_cache: dict[
            int, int
        ] = {}  # stage -> its newest registered checkpoint (raw: groups applied on the way out)
        self._wm_groups: Any = None  # the logging groups the newest registration named
        self._wm_at = 0.0
        self._ckpt_warned: set[str] = set()  # registration documents warned about (once each)
        self._ckpt_problems: list[dict[str, str]] = []  # registration documents left out by the last checkpoints()
        self._upload_stats = {"uploaded_segments": 0, "uploaded_bytes": 0, "errors": 0}
        self._last_error: tuple[float, str] | None = None
        self._backlog_bytes = 0
        self._ship_first: set[str] = set()  # channels sealed by seal(): their segments are uploaded before others
        self._shipped = threading.Condition()  # guards _unsealed_up; notified after every upload (wait_shipped)
        self._unsealed_up: dict[int, tuple[str, int]] = {}  # sealed, not yet uploaded: segment id -> (channel, lo)
        self.cold: ColdTier | None = None
        if config.cold_url:
            self.cold = ColdTier(config.cold_url, storage_options=config.cold_options or None)
        self.hot: HotTier | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._uploader: threading.Thread | None = None
        self._fenced: str | None = None  # why this writer no longer uploads (a newer incarnation ships)
        self._unconfirmed: set[str] = set()  # cold names of segments kept hot: their committed copy is not theirs
        if config.writer is not None:
            try:
                self._run_dir.mkdir(parents=True, exist_ok=True)
                self.hot = HotTier(
                    self._run_dir / config.writer,
                    owner=True,
                    durability=config.durability,
                    segment_iters=config.segment_iters,
                    segment_max_bytes=config.segment_max_bytes,
                    on_seal=self._on_seal,
                )
            except OSError as e:  # a read-only or missing mount, no permission
                raise ConfigError(
                    f"store root {str(config.root)!r}: cannot write under {str(self._run_dir)!r}: {e.strerror or e}",
                    hint="the store root must be a writable directory on a local disk",
                ) from e
            self._readers[config.writer] = self.hot
            self._backlog_bytes = self._compute_backlog()
            if self.cold is not None and config.upload:
                self._reconcile_uploads()
                self._unsealed_up = {m.id: (m.channel, m.lo) for m in self.hot.segments() if m.state == SEALED}
                self._uploader = threading.Thread(
                    target=self._upload_loop, name=f"swiftlog-upload-{self.run}", daemon=True
                )
                self._uploader.start()

    @classmethod
    def open(cls, root: str | os.PathLike[str], run: str, **kwargs: Any) -> LogStore:
        """Shorthand for ``LogStore(StoreConfig(root=root, run=run, **kwargs))``."""
        return cls(StoreConfig(root=root, run=run, **kwargs))

    def __enter__(self) -> LogStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== writing
    def put(self, key: RecordKey, tensor: torch.Tensor) -> None:
        """Encode and append one tensor record; returns once acknowledged by the hot tier."""
        self.put_many([(key, tensor)])

    def put_many(self, items: Iterable[tuple[RecordKey, torch.Tensor]]) -> None:
        """Encode and append several records in one index transaction."""
        self.put_encoded([self.encode(key, t) for key, t in items])

    def encode(self, key: RecordKey, tensor: torch.Tensor) -> Encoded:
        """Encode a record for ``put_encoded``: the CPU work (compression, checksums) of a put,
        which callers run on their own worker threads so the single writer thread only does I/O.
        Pure function of its inputs; touches no tier."""
        blob = codec.encode_tensor(tensor, codec=self.config.codec)
        return Encoded(key, blob, tensor.numel() * tensor.element_size(), blob_checksum(blob))

    def put_encoded(self, records: Iterable[Encoded]) -> None:
        """Append records made by :meth:`encode`, in one index transaction."""
        self._append([tuple(r) for r in records])

    def put_blob(self, key: RecordKey, blob: bytes | memoryview) -> None:
        """Append an already-encoded record (``logstore.codec.encode_tensor`` output)."""
        self.put_blobs([(key, blob)])

    def put_blobs(
        self, items: Iterable[tuple[RecordKey, bytes | memoryview] | tuple[RecordKey, bytes | memoryview, int]]
    ) -> None:
        """Append already-encoded records in one index transaction.

        Items are ``(key, blob)`` or ``(key, blob, raw_len)``; passing the raw length (known to
        whoever encoded the blob) saves parsing the header here.
        """
        self._append(
            [(it[0], it[1], it[2] if len(it) == 3 else codec.read_header(it[1]).raw_len, None) for it in items]
        )

    def _append(self, items: list[tuple[RecordKey, bytes | memoryview, int, int | None]]) -> None:
        hot = self._writer_hot()
        mb = self.config.max_backlog_bytes
        if mb is not None and self._backlog_bytes > mb:
            raise StoreFullError(
                f"upload backlog {self._backlog_bytes} bytes exceeds max_backlog_bytes={mb}",
                key=items[0][0] if items else None,
                hint="the cold tier is unreachable or too slow; see stats()['upload']",
            )
        hot.append(items)

    def _writer_hot(self) -> HotTier:
        if self._closed:
            from logstore.errors import StoreClosedError

            raise StoreClosedError(f"store of run {self.run!r} is closed")
        if self.hot is None:
            raise StoreError("this store was opened without a writer name", hint="pass writer=... to write")
        return self.hot

    def record_gap(self, channel: Channel, iteration: int, micro_batch: int, reason: str) -> None:
        """Note that a record was not logged (queue overflow, store full...). The plan sees gaps.

        Written to the local index at once; the uploader ships it to the cold tier (never waits
        on the object store here, so a down cold tier cannot slow the caller).
        """
        self._writer_hot().record_gap(channel, iteration, micro_batch, reason)
        self._wake.set()

    def _ship_gaps(self) -> None:
        """Copy gap documents of this writer's index to the cold tier (uploader thread)."""
        assert self.hot is not None and self.cold is not None
        for name, doc in self.hot.docs("gap/").items():
            if name in self._gaps_shipped:
                continue
            self.cold.put_doc(f"{self.run}/gaps/{name[len('gap/') :]}.json", doc)
            self._gaps_shipped.add(name)

    def gaps(self, *, hot_only: bool = False) -> list[dict[str, Any]]:
        """Every recorded gap, from all hot tiers of this node and (unless ``hot_only``) the cold
        tier; a cold tier that cannot be listed is noted (``stats()``), and its gaps are missing."""
        seen: dict[tuple, dict] = {}
        for hot in self._hot_tiers():
            for d in hot.docs("gap/").values():
                seen[(d["channel"], d["iteration"], d["micro_batch"])] = d
        if self.cold is not None and not hot_only:
            try:
                for name in self.cold.list_docs(f"{self.run}/gaps/"):
                    d = self.cold.get_doc(name)
                    if d:
                        seen[(d["channel"], d["iteration"], d["micro_batch"])] = d
            except SwiftlogError as e:
                self._note_error(e)
        return [seen[k] for k in sorted(seen)]

    # ================================================================== reading
    def get(self, key: RecordKey) -> torch.Tensor:
        """The tensor stored under ``key``, checksum-verified. Raises RecordNotFoundError or
        CorruptRecordError (naming the key); never returns wrong bytes."""
        return codec.decode_tensor(self.get_blob(key), key=key)

    def get_blob(self, key: RecordKey) -> bytes:
        """The encoded record under ``key`` (verified against its stored checksum). A corrupt copy
        is never returned: the next copy is tried (another hot tier, then the cold tier, which
        holds the same bytes once the segment was uploaded), with a warning naming the corrupt
        one; CorruptRecordError when no intact copy is left."""
        self._refuse_collected(key)
        corrupt: CorruptRecordError | None = None
        for hot, loc in self._hot_locations(key):
            try:
                blob = self._read_loc(hot, loc, key)
            except CorruptRecordError as e:
                corrupt = corrupt or e
                continue
            if blob is not None:
                return self._intact(blob, corrupt)
        if self.cold is not None:
            try:
                blob = self._cold_get(key)
            except (
                SwiftlogError
            ) as e:  # corrupt there too, or unreachable: the hot copy's corruption is the fact to report
                if corrupt is not None and isinstance(e, CorruptRecordError):
                    raise CorruptRecordError(
                        f"{corrupt.message}; the cold copy is corrupt too: {e.message}", key=key
                    ) from e
                raise (corrupt or e) from e
            if blob is not None:
                return self._intact(blob, corrupt)
        if corrupt is not None:
            raise corrupt
        raise self._not_found(key)

    def _intact(self, blob: bytes, corrupt: CorruptRecordError | None) -> bytes:
        if corrupt is not None:
            logger.warning("%s; read an intact copy instead (swiftlog verify lists the corrupt one)", corrupt)
        return blob

    def _not_found(self, key: RecordKey) -> RecordNotFoundError:
        if self.cold is None:
            return RecordNotFoundError(
                f"record {key} of run {self.run!r} not found in the hot tiers (no cold tier given)",
                key=key,
                hint="it may be in the run's cold tier: pass its URL (--cold-url)",
            )
        return RecordNotFoundError(f"record {key} of run {self.run!r} not found in any tier", key=key)

    def open_blob(self, key: RecordKey, chunk_size: int = 1 << 20) -> BlobStream:
        """The encoded record under ``key`` as a :class:`~logstore.segment.BlobStream`: chunks
        read from the local segment file and verified on the way (the last chunk only after the
        whole record matched its checksum), so a big record can be sent while it is read. Records
        not in a local segment file come from :meth:`get_blob` (read whole, verified). Raises
        like :meth:`get_blob`; the caller closes the stream (or iterates it to the end)."""
        self._refuse_collected(key)
        for hot, loc in self._hot_locations(key):
            try:
                stream = hot.stream_local(loc, key, chunk_size)
            except (
                CorruptRecordError
            ):  # a one-chunk record checked at once, or an unreadable file: another copy may be intact
                break
            if stream is not None:
                return stream
            break  # its segment file is gone: the read-through below finds it (cold tier)
        return BlobStream.of_bytes(key, self.get_blob(key), chunk_size)

    def _hot_locations(self, key: RecordKey) -> Iterator[tuple[HotTier, Location]]:
        """Each hot tier here that indexes ``key``, with the record's location in it."""
        for hot in self._hot_tiers():
            loc = hot.lookup(key)
            if loc is not None:
                yield hot, loc

    def _refuse_collected(self, key: RecordKey) -> None:
        """RecordNotFoundError for a key below its owner's checkpoint watermark (garbage, even if
        its bytes are still on disk)."""
        wm = self.watermarks(max_age=2.0).get(key.channel.owner, 0)
        if key.iteration < wm:
            raise RecordNotFoundError(
                f"record {key} was garbage-collected (below checkpoint watermark {wm} of stage {key.channel.owner})",
                key=key,
            )

    def _read_loc(self, hot: HotTier, loc: Location, key: RecordKey) -> bytes | None:
        try:
            blob = hot.read_local(loc)
        except CorruptRecordError as e:
            if isinstance(e.key, RecordKey):  # its frame header is not the index's (a damaged index entry): say so
                raise CorruptRecordError(f"corrupt {e.message}", key=key) from e
            raise CorruptRecordError(f"corrupt record {key} in hot tier ({hot.dir}): checksum mismatch", key=key) from e
        if blob is None and loc.segment.cold_name and self.cold is not None:
            blob = self._cold_read(loc.segment.cold_name, key, loc.offset, loc.length, loc.checksum)
        return blob

    def _cold_read(self, name: str, key: RecordKey, offset: int, length: int, checksum: int) -> bytes:
        """The blob of ``key`` at ``offset`` of cold object ``name``, read with its frame header
        (one range read): both checked, the header against the key, length and checksum expected,
        the bytes against the checksum. Raises CorruptRecordError naming the key and the object."""
        assert self.cold is not None
        data = self.cold.read_range(name, offset - FRAME_HEADER_SIZE, length + FRAME_HEADER_SIZE)
        check_frame_header(data[:FRAME_HEADER_SIZE], key, length, checksum, f"cold object {name} at offset {offset}")
        blob = data[FRAME_HEADER_SIZE:]
        if len(blob) != length or blob_checksum(blob) != checksum:
            raise CorruptRecordError(f"corrupt record {key} in cold object {name}: checksum mismatch", key=key)
        return blob

    def keys(
        self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None, *, hot_only: bool = False
    ) -> list[RecordKey]:
        """Every key (both tiers, deduplicated, key order) of ``channel`` in ``[it_lo, it_hi)``,
        or of all channels; keys below their watermark are left out. Raises
        ColdTierUnavailableError when the cold tier cannot be listed; ``hot_only``: the hot
        tiers' indexes alone (they also know their records evicted to the cold tier)."""
        found: set[RecordKey] = set()
        for hot in self._hot_tiers():
            found.update(k for k, _ in hot.keys(channel, it_lo, it_hi))
        if self.cold is not None and not hot_only:
            for seg in self._cold_segments(channel, it_lo, it_hi):
                for e in self._footer(seg.name, seg.size).values():  # keys decoded once, when the footer was read
                    k = e.key
                    if channel is None or (k.iteration >= it_lo and (it_hi is None or k.iteration < it_hi)):
                        found.add(k)
        wm = self.watermarks(max_age=2.0)
        return sorted(k for k in found if k.iteration >= wm.get(k.channel.owner, 0))

    def scan(
        self, channel: Channel, it_lo: int = 0, it_hi: int | None = None
    ) -> Iterator[tuple[RecordKey, torch.Tensor]]:
        """Records of ``channel`` in ``[it_lo, it_hi)`` in key order, from whichever tier holds them."""
        for k in self.keys(channel, it_lo, it_hi):
            yield k, self.get(k)

    def channels(self) -> list[Channel]:
        names: set[str] = set()
        for hot in self._hot_tiers():
            names |= hot.channels()
        if self.cold is not None:
            names |= set(self._cold_index().keys())
        return sorted(Channel.parse(n) for n in names)

    def list_records(
        self,
        channel: Channel | None = None,
        it_lo: int = 0,
        it_hi: int | None = None,
        *,
        kinds: Iterable[Kind] | None = None,
        micro_batch: int | None = None,
        after: RecordKey | None = None,
        limit: int = 1000,
        hot_only: bool = False,
    ) -> list[RecordInfo]:
        """One page of records in key order: at most ``limit``, strictly after ``after``.

        Filters: ``channel`` (else every channel, or those whose kind is in ``kinds``), iterations
        ``[it_lo, it_hi)``, ``micro_batch``. Both tiers, deduplicated (a record still in a local
        segment file is reported as hot); records below their watermark are left out. Reads only
        indexes, and only about one page of each: pass the last key of a page as ``after`` for
        the next one (an empty page means the end). Raises ColdTierUnavailableError when the cold
        tier cannot be listed; ``hot_only`` lists the hot tiers' indexes alone (records evicted
        to the cold tier still appear, as cold, but records only the cold tier knows do not).
        """
        if not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"limit must be an int >= 1, got {limit!r}")
        kind_set = None if kinds is None else {Kind(k) for k in kinds}
        wm = self.watermarks(max_age=2.0)
        after_b = after.encode() if after is not None else None
        out: list[RecordInfo] = []
        for ch in [channel] if channel is not None else self._record_channels(hot_only):
            if (kind_set is not None and ch.kind not in kind_set) or (after is not None and ch < after.channel):
                continue
            lo = max(it_lo, wm.get(ch.owner, 0))
            if it_hi is not None and lo >= it_hi:
                continue
            out.extend(self._channel_page(ch, lo, it_hi, micro_batch, after_b, limit - len(out), hot_only))
            if len(out) >= limit:
                break
        return out

    def _record_channels(self, hot_only: bool = False) -> list[Channel]:
        """Channels with records in some tier (cheaper than channels(): no scan of segment metadata)."""
        found: set[Channel] = set()
        for hot in self._hot_tiers():
            found.update(hot.record_channels())
        if self.cold is not None and not hot_only:
            found.update(Channel.parse(n) for n in self._cold_index())
        return sorted(found)

    @staticmethod
    def _uploaded_from(seg: _ColdSeg, hots: dict[str, HotTier]) -> bool:
        """True when ``seg`` is the upload of a segment still known to a hot tier of this node,
        whose index then holds every live record of it (no need to read its footer)."""
        hot = hots.get(seg.writer)
        m = _cold_name_parts(seg.name)
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
        batch_size = need if mb is None else max(need, 256)
        for hot in self._hot_tiers():
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
        if self.cold is not None and not hot_only:
            hots = {h.writer: h for h in self._hot_tiers()}
            # segments wholly before the cursor cannot hold a key of this page
            after_it = (
                RecordKey.decode(after).iteration
                if after is not None and after[:5] == RecordKey(ch, 0).encode()[:5]
                else None
            )
            cutoff = RecordKey.decode(sorted(found)[need - 1]).iteration if len(found) >= need else None
            for seg in sorted(self._cold_segments(ch, lo, hi), key=lambda s: (s.lo, s.name)):
                if after_it is not None and seg.hi < after_it:
                    continue
                if cutoff is not None and seg.lo > cutoff:
                    break  # every key of this and later segments sorts after the page
                if self._uploaded_from(seg, hots):
                    continue
                added = False
                for kb, e in self._footer(seg.name, seg.size).items():
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
        return [found[kb] for kb in sorted(found)[:need]]

    # ---------------------------------------------------------------- hot tiers of the node
    def writers(self) -> list[str]:
        """Names of the writers with a hot tier of this run under this root (sorted; [] for none)."""
        return writers_under(self._run_dir)

    def unreadable_writers(self) -> dict[str, str]:
        """Writers whose index readers leave out (damaged, truncated, missing), and why; {} when none."""
        self._hot_tiers()
        with self._lock:
            return {w: why for w, (why, _) in sorted(self._unreadable.items())}

    def is_cold_only(self) -> bool:
        """True for a store that reads a cold tier and no writer's hot tier (``plan.cold_only_store``)."""
        return self.cold is not None and not self.writers()

    def _hot_tiers(self) -> list[HotTier]:
        """Own hot tier plus every other writer's under root/run (opened read-only, cached)."""
        with self._lock:
            now = time.monotonic()
            if now - self._readers_scanned > 1.0 and self._run_dir.is_dir():
                self._readers_scanned = now
                for d in sorted(self._run_dir.iterdir()):
                    # a writer's index that could not be opened or read is tried again after a while (one being created
                    # by its writer at this moment is not there yet; a damaged one is warned about once per retry)
                    bad = self._unreadable.get(d.name)
                    if d.name not in self._readers and (bad is None or now - bad[1] > 10.0) and (d / "index").is_dir():
                        try:
                            reader = _open_reader(d)
                        except StoreError as e:
                            logger.warning("leaving out hot tier %s: %s", d, e)
                            self._unreadable[d.name] = (str(e), now)
                            continue
                        self._unreadable.pop(d.name, None)
                        self._readers[d.name] = reader
                for name, reader in list(
                    self._readers.items()
                ):  # damaged since it was opened (a read raised CorruptIndexError)
                    if reader.damaged is not None and reader is not self.hot:
                        logger.warning("leaving out hot tier %s: %s", reader.dir, reader.damaged)
                        self._unreadable[name] = (reader.damaged, now)
                        del self._readers[name]
                        reader.close()
            return list(self._readers.values())

    # ---------------------------------------------------------------- cold tier reads
    def refresh_cold_listing(self) -> None:
        """List the cold tier now, so that reads keep using a fresh listing without paying for it.

        For long-lived readers (the admin server) to call from a background thread every few
        seconds. Raises ColdTierUnavailableError like any listing; a no-op without a cold tier.
        """
        if self.cold is not None:
            self._cold_index(refresh=True)

    def _cold_index(self, refresh: bool = False) -> dict[str, list[_ColdSeg]]:
        """The committed cold segments by channel name; a listing is reused for 5 s.

        The listing runs outside ``_lock`` (it can take long on an object store), one at a time;
        while one thread lists, the others keep using the previous listing unless they asked for
        ``refresh`` or there is none yet. A listing that raced an invalidation is not cached.
        """
        assert self.cold is not None
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
            out: dict[str, list[_ColdSeg]] = {}
            for info in self.cold.list_segments(f"{self.run}/segments/"):
                parts = info.name.split("/")
                m = _COLD_SEG_RE.match(parts[-1])
                if m is None or len(parts) < 2:
                    continue
                ch = Channel.parse(parts[-2])
                meta = info.meta or {}
                out.setdefault(ch.name, []).append(
                    _ColdSeg(
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

    def _cold_segments(
        self, channel: Channel | None, it_lo: int = 0, it_hi: int | None = None, refresh: bool = False
    ) -> list[_ColdSeg]:
        idx = self._cold_index(refresh)
        segs = [s for n, v in idx.items() if channel is None or n == channel.name for s in v]
        return [s for s in segs if s.hi >= it_lo and (it_hi is None or s.lo < it_hi)]

    def _footer(self, name: str, size: int) -> dict[bytes, Any]:
        """Index of a cold segment of ``size`` bytes (key bytes -> entry), cached (LRU). Raises
        CorruptRecordError when the trailer does not describe an index ending where it begins
        (a damaged trailer would otherwise ask for any number of bytes)."""
        assert self.cold is not None
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

    def _cold_get(self, key: RecordKey) -> bytes | None:
        kb = key.encode()
        for refresh in (False, time.monotonic() - self._cold_list_at > 0.5):
            # newest first: a writer restarted by a rollback numbers past its earlier uploads, and its copy is the one the job went on from
            for seg in sorted(
                self._cold_segments(key.channel, key.iteration, key.iteration + 1, refresh=refresh),
                key=_copy_age,
                reverse=True,
            ):
                e = self._footer(seg.name, seg.size).get(kb)
                if e is None:
                    continue
                return self._cold_read(seg.name, key, e.offset, e.length, e.checksum)
        return None

    # ================================================================== upload
    def _compute_backlog(self) -> int:
        return sum(m.file_size for m in self.hot.segments() if m.state == SEALED) if self.hot else 0

    def _cold_name(self, m: SegmentMeta, writer: str | None = None, seg_id: int | None = None) -> str:
        return f"{self.run}/segments/{m.channel}/{m.lo:012d}-{m.hi:012d}.{writer or self.config.writer}.{m.id if seg_id is None else seg_id:010d}.seg"

    def _committed_names(self) -> set[str]:
        """Names of every committed cold segment, from a fresh listing (raises like the listing)."""
        return {seg.name for segs in self._cold_index(refresh=True).values() for seg in segs}

    def _number_past_own_uploads(self, committed: set[str], hot: HotTier | None = None) -> bool:
        """Number the new segments of ``hot``'s writer (default: this store's) past the ids its name
        has among ``committed`` (an earlier incarnation on another root: a rollback); True when
        that moved the numbering."""
        hot = hot or self.hot
        assert hot is not None
        mine = [int(m["seg"]) for name in committed if (m := _cold_name_parts(name)) and m["writer"] == hot.writer]
        return hot.number_past(max(mine, default=0))

    def _reconcile_uploads(self) -> None:
        """After a restart: segments already committed in the cold tier are marked uploaded, and
        uploaded ones the cold tier no longer has (and whose file is still here) are queued again."""
        try:
            committed = self._committed_names()
            wm = self.watermarks()
        except SwiftlogError as e:
            self._note_error(e)
            return
        if self._number_past_own_uploads(committed):
            logger.info(
                "run %s: writer %s numbers its segments past its earlier uploads in the cold tier",
                self.run,
                self.config.writer,
            )
        for m in self.hot.segments():
            if m.state == SEALED and self._cold_name(m) in committed:
                self.hot.set_state(m.id, UPLOADED, cold_name=self._cold_name(m))
            elif (
                m.state == UPLOADED
                and m.cold_name not in committed
                and self.hot.seg_path(m.id).exists()
                and m.hi >= wm.get(Channel.parse(m.channel).owner, 0)
            ):  # not garbage another node's GC removed
                logger.warning(
                    "run %s: segment %d of %s was uploaded as %s, which the cold tier no longer has: uploading it again",
                    self.run,
                    m.id,
                    self.hot.writer,
                    m.cold_name,
                )
                self.hot.set_state(m.id, SEALED)
                with self._shipped:
                    self._unsealed_up[m.id] = (m.channel, m.lo)

    def _upload_pending(self, deadline: float | None = None) -> int:
        """Upload every sealed segment now (caller's thread). Raises the first cold-tier error, and
        ColdTierUnavailableError when ``deadline`` (``time.monotonic()``) passes first: between
        segments, or waiting for the uploader thread's upload in progress."""
        assert self.hot is not None and self.cold is not None
        n = 0
        if not self._upload_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise ColdTierUnavailableError(
                f"run {self.run}: the uploader is still busy with a slow upload (object store slow or down?)",
                hint="the records stay in the hot tier; the uploader goes on in the background",
            )
        try:
            if self.cold.fenced_writes(probe=False) is None:  # once: does the store fence two uploaders of one name?
                self.cold.fenced_writes()
            self._ship_gaps()
            first = self._ship_first
            with self._shipped:
                known = set(self._unsealed_up)  # before the listing: what it cannot show was collected or uploaded
            segs = self.hot.segments()
            sealed = {m.id for m in segs if m.state == SEALED}
            self._forget_unshipped(known - sealed)
            order = lambda m: (not _precious(m.channel, first), m.id)  # noqa: E731
            todo = sorted((m for m in segs if m.state == SEALED), key=order)
            queued = {m.id for m in todo}
            left = 0
            while todo:
                if deadline is not None and time.monotonic() > deadline:
                    left = len(todo)
                    break
                m = todo.pop(0)
                name = self._ship(self.hot, m)
                if name is not None:
                    self.hot.set_state(m.id, UPLOADED, cold_name=name)
                    self._upload_stats["uploaded_segments"] += 1
                    self._upload_stats["uploaded_bytes"] += m.file_size
                    n += 1
                self._forget_unshipped([m.id])
                urgent = self._sealed_first_since(queued, first)
                if urgent:  # inputs/targets/META sealed during this pass go before its bulk (a backlog can be long)
                    queued.update(u.id for u in urgent)
                    todo = sorted([*todo, *urgent], key=order)
            self._backlog_bytes = self._compute_backlog()
            with self._lock:
                self._cold_list = None
                self._cold_epoch += 1
            self._evict()
        finally:
            self._upload_lock.release()
        if left:
            raise ColdTierUnavailableError(
                f"run {self.run}: {left} sealed segment(s) not uploaded in the time given (object store slow?)",
                hint="they stay in the hot tier; the uploader goes on in the background",
            )
        return n

    def _sealed_first_since(self, queued: set[int], first: set[str]) -> list[SegmentMeta]:
        """Segments of the ship-first channels sealed since ``queued`` was listed (in-memory check;
        the index is read only when there is one)."""
        assert self.hot is not None
        with self._shipped:
            ids = [i for i, (ch, _lo) in self._unsealed_up.items() if i not in queued and _precious(ch, first)]
        metas = (self.hot.segment(i) for i in ids)
        return [m for m in metas if m is not None and m.state == SEALED]

    def _on_seal(self, m: SegmentMeta) -> None:
        """The hot tier sealed ``m`` (explicitly or by rotation): it waits for upload; wake the uploader."""
        with self._shipped:
            self._unsealed_up[m.id] = (m.channel, m.lo)
        self._wake.set()

    def _forget_unshipped(self, ids: Iterable[int]) -> None:
        """Segments uploaded, or gone (collected, uploaded by their writer): wake wait_shipped."""
        with self._shipped:
            for i in ids:
                self._unsealed_up.pop(i, None)
            self._shipped.notify_all()

    def _ship(self, hot: HotTier, m: SegmentMeta) -> str | None:
        """Upload sealed segment ``m`` of ``hot`` (any writer's) to the cold tier; its cold name, or
        None when a checkpoint's GC deleted it (or its writer uploaded it) before or while it was
        read: nothing is left to ship and that is no cold-tier fault. Raises the cold tier's error
        otherwise."""
        assert self.cold is not None
        own = hot is self.hot
        if own and self._fenced is not None:
            raise WriterFencedError(self._fenced, hint=_FENCED_HINT)
        name = self._cold_name(m, hot.writer)
        meta = {
            "channel": m.channel,
            "lo": m.lo,
            "hi": m.hi,
            "writer": hot.writer,
            "records": m.live,
            "raw_bytes": m.raw_bytes,
            "stored_bytes": m.live_bytes,
        }
        incarnation = hot.incarnation()  # whichever process ships it: its writer's (a server's flush, a CLI's)
        if incarnation:
            meta["incarnation"] = incarnation
        path = hot.seg_path(m.id)
        if path.exists():
            try:
                self.cold.put_segment(name, str(path), meta=meta)
                return name
            except SegmentClashError:
                other = self.cold.segment_info(name)
                theirs = None if other is None else other.meta.get("incarnation")
                if isinstance(theirs, (int, float)) and theirs > incarnation:
                    # a later incarnation of this writer (its replacement) uploads: this one is the stale one
                    why = (
                        f"writer {hot.writer} of run {self.run!r}: {name} in the cold tier was uploaded by a later incarnation of this "
                        f"writer (opened {datetime.fromtimestamp(theirs, UTC).isoformat()}, this one "
                        f"{datetime.fromtimestamp(incarnation, UTC).isoformat()}): this one uploads nothing more"
                    )
                    if (
                        own
                    ):  # the writer's own uploader: said once in its log (the exception reaches only its flush callers)
                        self._fenced = why
                        logger.error("run %s: %s", self.run, why)
                    raise WriterFencedError(why, key=name, hint=_FENCED_HINT) from None
                # an earlier incarnation of this writer (a rollback's fresh root, opened while the cold tier
                # was down) used the name: number past its uploads and ship this one under a new id (also when
                # another process ships it: the index's counter is shared through LMDB)
                self._number_past_own_uploads(self._committed_names(), hot)
                renamed = self._cold_name(m, hot.writer, hot.reserve_id())
                logger.warning(
                    "run %s: %s is taken in the cold tier by other bytes (an earlier incarnation of writer %s): uploading it as %s",
                    self.run,
                    name,
                    hot.writer,
                    renamed,
                )
                self.cold.put_segment(renamed, str(path), meta=meta)
                return renamed
            except StoreError:
                cur = hot.segment(m.id)
                if cur is not None and cur.state == SEALED and path.exists():
                    raise
        logger.debug("run %s: segment %s of %s was collected or uploaded meanwhile", self.run, m.id, hot.writer)
        return None

    def _evict(self) -> None:
        """While the hot tier holds more than ``hot_max_bytes``, drop the hot copies of the oldest
        uploaded segments whose committed copy is confirmed to be exactly their file
        (``ColdTier.confirm_segment``): another uploader of the name may have replaced it. One
        that is not confirmed stays hot and is named once."""
        limit = self.config.hot_max_bytes
        if limit is None or self.hot is None or self.cold is None:
            return
        segs = self.hot.segments()
        total = sum(m.file_size for m in segs if m.state != EVICTED)
        for m in sorted((m for m in segs if m.state == UPLOADED), key=lambda m: (m.lo, m.id)):
            if total <= limit:
                break
            path = self.hot.seg_path(m.id)
            if m.cold_name is None or not path.exists():
                continue
            try:
                confirmed = self.cold.confirm_segment(m.cold_name, str(path))
            except SwiftlogError as e:  # cannot ask the object store now: nothing more is dropped
                self._note_error(e)
                return
            if not confirmed:
                if m.cold_name not in self._unconfirmed:
                    self._unconfirmed.add(m.cold_name)
                    logger.warning(
                        "run %s: segment %d of %s not evicted: its committed copy %s is not exactly its bytes "
                        "(another uploader of the name?); it stays in the hot tier",
                        self.run,
                        m.id,
                        self.hot.writer,
                        m.cold_name,
                    )
                continue
            self.hot.set_state(m.id, EVICTED)
            total -= m.file_size

    def _upload_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._upload_pending()
                backoff = 0.1
            except SwiftlogError as e:
                if self._stop.is_set():  # closing: the tiers may be closed under an upload that outlived close's wait
                    break
                self._note_error(e)
                try:
                    self._backlog_bytes = self._compute_backlog()
                except SwiftlogError:
                    pass
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                self._wake.set()
            except Exception as e:  # a bad item must not kill the uploader
                if self._stop.is_set():
                    break
                logger.exception("uploader: unexpected error")
                self._note_error(e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                self._wake.set()

    def _note_error(self, e: BaseException) -> None:
        self._upload_stats["errors"] += 1
        self._last_error = (time.time(), f"{type(e).__name__}: {e}")
        logger.warning("run %s: cold tier error: %s", self.run, e)

    def seal(self, channels: Iterable[Channel] | None = None) -> None:
        """Seal the open segments of ``channels`` (all when None) and wake the uploader.

        Never waits for the upload: use it to ship small, precious streams (inputs, targets,
        digests) off the node promptly without blocking the caller on the object store.
        """
        hot = self._writer_hot()
        names = None if channels is None else {c.name for c in channels}
        if names:
            self._ship_first |= names
        hot.seal_all(names)
        self._wake.set()

    def wait_shipped(self, channels: Iterable[Channel], iteration: int, timeout: float) -> bool:
        """Wait until every record of ``channels`` at or below ``iteration`` that this store's
        writer has written is in the cold tier; True when it is, False after ``timeout`` seconds
        (the cold tier is slow or down: the records stay in the hot tier and go up later) or
        without a cold tier. Only sealed segments are uploaded: :meth:`seal` the channels first,
        after the records are written. Never uploads on the caller's thread or raises for the
        cold tier's errors."""
        if self.cold is None or self._uploader is None:
            return False
        hot = self._writer_hot()
        names = {c.name for c in channels}
        deadline = time.monotonic() + timeout
        with self._shipped:  # in memory only: the open segments and the sealed ones not uploaded yet
            while True:
                waiting = [*hot.open_segments().items(), *self._unsealed_up.values()]
                if not any(ch in names and lo <= iteration for ch, lo in waiting):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._shipped.wait(min(left, 0.05))  # notified per upload; the poll bounds a missed wake

    def flush(self, timeout: float | None = None) -> int:
        """Seal every open segment and upload everything to the cold tier now.

        Returns the number of segments uploaded. Raises ColdTierUnavailableError (records stay
        safe in the hot tier) when the object store cannot take them, or when ``timeout``
        seconds pass first (checked between segments: one upload in flight may overrun it by up
        to the cold tier's ``timeout_s``).
        """
        hot = self._writer_hot()
        hot.seal_all()
        if self.cold is None:
            return 0
        try:
            return self._upload_pending(None if timeout is None else time.monotonic() + timeout)
        except SwiftlogError as e:
            self._note_error(e)
            try:  # what stats() reports as waiting: the segments just sealed too (the uploader may not have failed yet)
                self._backlog_bytes = self._compute_backlog()
            except SwiftlogError:
                pass
            raise

    def upload_sealed(self) -> dict[str, Any]:
        """Upload every sealed, not yet uploaded segment of every writer of this run on this node.

        What a process that is not the writer (the admin server, the CLI) can flush: sealing
        stays the writer's job, so open segments are never touched; they are listed under
        ``open`` (their writer seals them when they roll over, on ``seal``/``flush``/``close``,
        or when it reopens after a crash). Safe while writers run: an upload is idempotent (same
        bytes, same name, commit marker last), so racing a writer's own uploader only repeats
        work. Returns ``{"uploaded": [cold names], "uploaded_bytes", "already_uploaded",
        "open": [{"writer", "channel", "lo", "hi", "records", "bytes"}]}``. Raises ConfigError
        without a cold tier and ColdTierUnavailableError when the object store cannot take the
        segments (they stay sealed in the hot tier).
        """
        if self.cold is None:
            raise ConfigError(f"run {self.run!r}: no cold tier configured", hint="open the store with cold_url=...")
        rep: dict[str, Any] = {"uploaded": [], "uploaded_bytes": 0, "already_uploaded": 0, "open": []}
        with self._upload_lock:
            try:
                # every writer's inputs, targets and META first (what only their stage had), then the rest
                segs = [(hot, m) for hot in self._hot_tiers() for m in hot.segments()]
                for hot, m in sorted(
                    segs, key=lambda hm: (not _precious(hm[1].channel, self._ship_first), hm[0].writer, hm[1].id)
                ):
                    if m.state == OPEN:
                        rep["open"].append(
                            {
                                "writer": hot.writer,
                                "channel": m.channel,
                                "lo": m.lo,
                                "hi": m.hi,
                                "records": m.live,
                                "bytes": m.end,
                            }
                        )
                        continue
                    if m.state != SEALED:
                        rep["already_uploaded"] += 1
                        continue
                    name = self._ship(hot, m)
                    if name is None:
                        continue
                    cur = hot.segment(m.id)
                    if cur is not None and cur.state == SEALED:
                        hot.set_state(m.id, UPLOADED, cold_name=name)
                    rep["uploaded"].append(name)
                    rep["uploaded_bytes"] += m.file_size
            except SwiftlogError as e:
                if not isinstance(e, WriterFencedError):  # a refusal of this run's data, not the cold tier's health
                    self._note_error(e)
                raise
            finally:
                with self._lock:
                    self._cold_list = None
                    self._cold_epoch += 1
        return rep

    # ================================================================== checkpoints and GC
    def register_checkpoint(
        self, stage: int, iteration: int, *, uri: str | None = None, meta: dict[str, Any] | None = None
    ) -> CheckpointInfo:
        """Record that stage ``stage``'s checkpoint at ``iteration`` is durable.

        From now on records received by ``stage`` below ``iteration`` are garbage (deleted by
        the next ``gc``). Written to the cold tier (shared by every node) when configured, and to
        the local index. Raises ConfigError for a meta that is not a small JSON object of portable
        JSON (``logstore.checkpoints.check_meta``), ColdTierUnavailableError if the cold tier
        cannot record it.
        """
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or stage < 0
            or isinstance(iteration, bool)
            or not isinstance(iteration, int)
            or iteration < 0
        ):
            raise ConfigError(
                f"checkpoint needs stage >= 0 and iteration >= 0, got stage={stage!r} iteration={iteration!r}"
            )
        try:  # stored as JSON, served as UTF-8: a lone surrogate, a NaN or a deep nest would break every later read
            check_meta({} if meta is None else meta)
        except ValueError as e:
            raise ConfigError(
                f"checkpoint meta of stage {stage} iteration {iteration} is not portable JSON within the limits: {e}",
                hint="meta must be a small JSON object: valid Unicode, finite numbers, a few levels deep",
            ) from e
        info = CheckpointInfo(stage, iteration, uri, time.time(), dict(meta or {}))
        doc = asdict(info)
        if self.cold is not None:
            self.cold.put_doc(cold_name(self.run, stage, iteration), doc)
        hots = [self.hot] if self.hot is not None else self._hot_tiers()[:1]
        for hot in hots:
            hot.put_doc(hot_name(stage, iteration), doc)
        with self._lock:
            if iteration > self._wm_cache.get(stage, -1):
                self._wm_cache[stage] = iteration
            if info.meta.get("logging_groups"):
                self._wm_groups = info.meta["logging_groups"]
        return info

    def unregister_checkpoint(self, stage: int, iteration: int) -> CheckpointInfo | None:
        """Withdraw the registration of ``stage``'s checkpoint at ``iteration``: in the cold tier
        first, then in every hot index of this node. Returns it, or None when it was not
        registered. No plan starts from it any more; when it was the stage's newest, the
        watermark falls back to the newest one left (records a GC already deleted stay deleted).
        Raises ColdTierUnavailableError if the cold tier cannot forget it (nothing is changed
        here then)."""
        found = next((c for c in self.checkpoints() if (c.stage, c.iteration) == (stage, iteration)), None)
        if self.cold is not None:
            self.cold.delete_doc(cold_name(self.run, stage, iteration))
        for hot in self._hot_tiers():
            hot.delete_doc(hot_name(stage, iteration))
        with self._lock:
            self._wm_cache.pop(stage, None)
            self._wm_at = 0.0  # the next watermarks() reads the registrations again
        return found

    def adopt_registration(self, doc: dict[str, Any]) -> CheckpointInfo:
        """Record another node's registration ``doc`` (as :meth:`register_checkpoint` stored it) in
        this node's hot index, as it is: what a node without a cold tier learns through the commit
        store, so that its GC frees what that stage received from here. Never written to the cold
        tier. Raises CorruptRecordError for a document that is not a registration, StoreError
        without a hot tier to write to."""
        named = (doc.get("stage"), doc.get("iteration")) if isinstance(doc, dict) else None
        info, _ = parse_doc("a registration from another node", named, doc)  # type: ignore[arg-type]
        hots = [self.hot] if self.hot is not None else self._hot_tiers()[:1]
        if not hots:
            raise StoreError(f"run {self.run!r}: no hot index on this node to record a registration in")
        hots[0].put_doc(hot_name(info.stage, info.iteration), asdict(info))
        with self._lock:
            self._wm_at = 0.0
        return info

    def preview_unregister(self, stage: int, iteration: int) -> UnregisterPreview | None:
        """What :meth:`unregister_checkpoint` would do, changing nothing: the registration, every
        watermark with and without it, and a GC dry run of each. None when it is not registered.
        Raises like :meth:`checkpoints` and :meth:`gc`."""
        cps = self.checkpoints()
        found = next((c for c in cps if (c.stage, c.iteration) == (stage, iteration)), None)
        if found is None:
            return None
        before = self._watermarks_of(cps)
        after = self._watermarks_of([c for c in cps if c is not found])
        gc_before, gc_after = self.gc(dry_run=True, watermarks=before), self.gc(dry_run=True, watermarks=after)
        return UnregisterPreview(found, before, after, gc_before, gc_after)

    def checkpoints(self, *, hot_only: bool = False) -> list[CheckpointInfo]:
        """Every registered checkpoint (cold tier and local), sorted by (stage, iteration). Raises
        ColdTierUnavailableError when the cold tier cannot be listed; ``hot_only``: those
        registered through this node's hot tiers only (what it knows without the object store).

        A document whose content disagrees with its name, or that is not a registration, is left
        out with a warning (``verify`` lists it); unknown fields are ignored with a warning."""
        found: dict[tuple[int, int], CheckpointInfo] = {}
        problems: list[dict[str, str]] = []
        for hot in self._hot_tiers():
            for name, d in hot.docs("ckpt/").items():
                info = self._registration(f"{name} in {hot.dir}", "hot", parse_hot_name(name), d, problems)
                if info is not None:
                    found[(info.stage, info.iteration)] = info
        if self.cold is not None and not hot_only:
            for name in self.cold.list_docs(f"{self.run}/checkpoints/"):
                d = self.cold.get_doc(name)
                if d:
                    info = self._registration(name, "cold", parse_cold_name(name), d, problems)
                    if info is not None:
                        found[(info.stage, info.iteration)] = info
        with self._lock:
            self._ckpt_problems = problems
        return [found[k] for k in sorted(found)]

    def _registration(
        self, where: str, tier: str, named: tuple[int, int] | None, doc: Any, problems: list[dict[str, str]]
    ) -> CheckpointInfo | None:
        """One registration document read by :meth:`checkpoints`: parsed, or None (noted in
        ``problems`` and warned about once) when it cannot be trusted."""
        try:
            info, unknown = parse_doc(where, named, doc)
        except CorruptRecordError as e:
            problems.append({"tier": tier, "key": "", "where": where, "error": e.message})
            self._warn_once(where, e.message)
            return None
        if unknown:
            fields = ", ".join(unknown)
            self._warn_once(where + "#fields", f"checkpoint registration {where}: unknown field(s) {fields} ignored")
        return info

    def _warn_once(self, what: str, message: str) -> None:
        with self._lock:
            if what in self._ckpt_warned:
                return
            self._ckpt_warned.add(what)
        logger.warning("run %s: %s", self.run, message)

    @staticmethod
    def _newest(cps: list[CheckpointInfo]) -> tuple[dict[int, int], Any]:
        """Each stage's newest registered iteration, and the logging groups of the newest registration naming any."""
        wm: dict[int, int] = {}
        groups = None
        for c in sorted(cps, key=lambda c: c.registered_at):
            wm[c.stage] = max(wm.get(c.stage, 0), c.iteration)
            groups = c.meta.get("logging_groups") or groups
        return wm, groups

    @classmethod
    def _watermarks_of(cls, cps: list[CheckpointInfo]) -> dict[int, int]:
        """The watermarks the registrations ``cps`` make (groups applied)."""
        return _group_watermarks(*cls._newest(cps))

    def watermarks(self, max_age: float = 0.0) -> dict[int, int]:
        """stage -> the iteration below which what the stage received is garbage: its newest durable
        checkpoint; for a stage of a logging group (registrations whose meta names
        ``logging_groups``, e.g. [2, 2]), the oldest of its members' newest checkpoints, since the
        group is replayed together from the checkpoint every member has. The registrations as they
        stand decide: an unregistered one lowers the watermark in every process that reads them
        again. ``max_age`` allows a cached answer."""
        with self._lock:
            if max_age and time.monotonic() - self._wm_at < max_age:
                return _group_watermarks(self._wm_cache, self._wm_groups)
        try:
            wm, groups = self._newest(self.checkpoints())
        except SwiftlogError as e:
            if max_age:  # a read path: fall back to what we knew, and ask again only after max_age
                self._note_error(e)
                with self._lock:
                    self._wm_at = time.monotonic()
                    return _group_watermarks(self._wm_cache, self._wm_groups)
            raise
        with self._lock:
            self._wm_cache = dict(wm)
            self._wm_groups = groups
            self._wm_at = time.monotonic()
            return _group_watermarks(wm, self._wm_groups)

    def gc(self, *, dry_run: bool = False, watermarks: dict[int, int] | None = None) -> GcReport:
        """Delete every record received by a stage below that stage's watermark, in both tiers.

        Idempotent; safe while writers append (open segments are never removed). ``dry_run``
        lists what would be deleted without deleting. Nothing at or above a watermark is touched.
        Also aborts multipart uploads older than ``stale_upload_age``, and removes cold objects
        left without a commit marker for longer than that (counted and listed with the cold
        segments deleted). ``watermarks`` (dry runs only): plan with these instead of the
        registered ones (what a change of registrations would do).
        """
        if watermarks is not None and not dry_run:
            raise ConfigError("gc(watermarks=...) is a dry run only", hint="a GC deletes by the registered checkpoints")
        wm = self.watermarks() if watermarks is None else dict(watermarks)
        rep = GcReport(dry_run=dry_run, watermarks=wm)
        for hot in self._hot_tiers():
            keys, segs = hot.gc(wm, dry_run=dry_run)
            rep.hot_records += len(keys)
            rep.hot_segments += len(segs)
            rep.hot_bytes += sum(m.file_size for m in segs if m.state != EVICTED)
            rep.keys.extend(str(k) for k in keys[: max(0, 1000 - len(rep.keys))])
        if self.cold is not None:
            for seg in self._cold_segments(None, refresh=True):
                w = wm.get(seg.channel.owner)
                if w and seg.hi < w:
                    rep.cold_segments += 1
                    rep.cold_bytes += seg.size
                    rep.segments.append(seg.name)
                    if not dry_run:
                        self.cold.delete_segment(seg.name)
            # objects left without a marker (a crashed upload, a crash between a delete's marker and object)
            age = self.config.stale_upload_age
            stale = self.cold.remove_uncommitted(age, prefix=f"{self.run}/segments/", dry_run=dry_run)
            for name, size in stale.items():
                rep.cold_segments += 1
                rep.cold_bytes += size
                rep.segments.append(name)
            if not dry_run:
                rep.aborted_uploads = self.cold.abort_stale_uploads(self.config.stale_upload_age, prefix=f"{self.run}/")
                with self._lock:
                    self._cold_list = None
                    self._cold_epoch += 1
                    for name in rep.segments:
                        self._footers.pop(name, None)
        if self.hot is not None:
            self._backlog_bytes = self._compute_backlog()
        return rep

    # ================================================================== inspection
    def stats(self) -> dict[str, Any]:
        """Records and bytes per tier and channel, raw vs stored, upload backlog and errors, and what GC
        deleted from the hot tiers (``hot["collected"]``: owner stage -> records, stored bytes, ``below``)."""
        hot_tot = {
            "records": 0,
            "stored_bytes": 0,
            "raw_bytes": 0,
            "disk_bytes": 0,
            "segments": {OPEN: 0, SEALED: 0, UPLOADED: 0, EVICTED: 0},
        }
        chans: dict[str, dict[str, Any]] = {}

        def add(name: str, tier: str, lo: int, hi: int, records: int, stored: int, raw: int) -> None:
            c = chans.setdefault(name, {}).setdefault(
                tier, {"records": 0, "stored_bytes": 0, "raw_bytes": 0, "lo": lo, "hi": hi}
            )
            c["records"] += records
            c["stored_bytes"] += stored
            c["raw_bytes"] += raw
            c["lo"], c["hi"] = min(c["lo"], lo), max(c["hi"], hi)

        hots = self._hot_tiers()
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
                add(m.channel, "hot", m.lo, m.hi, m.live, m.live_bytes, m.raw_bytes)
        for (
            name,
            tiers,
        ) in chans.items():  # a segment's lo predates GC's deletions in it: the first live record is the range's start
            firsts = [k.iteration for hot in hots for k, _ in hot.keys(Channel.parse(name), limit=1)]
            if firsts:
                tiers["hot"]["lo"] = min(firsts)
        cold_tot: dict[str, Any] | None = None
        if self.cold is not None:
            cold_tot = {
                "segments": 0,
                "records": 0,
                "stored_bytes": 0,
                "raw_bytes": 0,
                "object_bytes": 0,
                "error": None,
            }
            cold_tot["fenced_writes"] = self.cold.fenced_writes(probe=False)  # None until an upload probed it
            try:
                for seg in self._cold_segments(None, refresh=True):
                    cold_tot["segments"] += 1
                    cold_tot["records"] += seg.records
                    cold_tot["stored_bytes"] += seg.stored_bytes
                    cold_tot["raw_bytes"] += seg.raw_bytes
                    cold_tot["object_bytes"] += seg.size
                    add(seg.channel.name, "cold", seg.lo, seg.hi, seg.records, seg.stored_bytes, seg.raw_bytes)
            except SwiftlogError as e:
                cold_tot["error"] = str(e)
        stored = hot_tot["stored_bytes"] or 0
        return {
            "run": self.run,
            "hot": hot_tot,
            "cold": cold_tot,
            "compression_ratio": (hot_tot["raw_bytes"] / stored) if stored else None,
            "channels": chans,
            "upload": {
                **self._upload_stats,
                "backlog_bytes": self._backlog_bytes if self.hot else None,
                "last_error": self._last_error[1] if self._last_error else None,
                "last_error_at": self._last_error[0] if self._last_error else None,
            },
        }

    def verify(self, progress: Callable[[str, int, int], None] | None = None) -> VerifyReport:
        """Check every checksum in both tiers (blob checksums and each tensor's raw checksum), and
        that what the indexes list is there: a segment file missing and never uploaded, an
        uploaded segment the cold tier no longer has, a segment file no index knows, an index
        that cannot be opened are problems too.

        Never raises for a corrupt or missing record: it is listed in the report. ``progress(tier, done,
        total)`` is called as work advances. A GC may run meanwhile (the client runs one after each
        checkpoint): what is missing because it became garbage during the check is no problem
        (the watermarks are read again at the end).
        """
        rep = VerifyReport()
        may_be_gc: list[tuple[dict[str, str], int, int]] = []  # (problem, owner stage, last iteration it concerns)
        hots = self._hot_tiers()
        try:  # a writer directory with segment files but no index (lost, or not a directory): nothing reads them
            orphaned = sorted(
                d for d in self._run_dir.iterdir() if not (d / "index").is_dir() and any((d / "segments").glob("*.seg"))
            )
        except OSError:
            orphaned = []
        for d in orphaned:
            rep.problems.append(
                {
                    "tier": "hot",
                    "key": "",
                    "where": str(d / "index"),
                    "error": f"{sum(1 for _ in (d / 'segments').glob('*.seg'))} segment file(s) but no index (lost?): their "
                    "records are not readable until the writer reopens the store (it re-indexes them)",
                }
            )
        for w in sorted(set(self.writers()) - {h.writer for h in hots}):
            rep.problems.append(
                {
                    "tier": "hot",
                    "key": "",
                    "where": str(self._run_dir / w / "index"),
                    "error": self._unreadable.get(w, ("the index cannot be opened (see the log)", 0.0))[0],
                }
            )
        readable = []
        for hot in hots:
            try:
                orphans, listed = hot.orphan_files(), [(hot, k, loc) for k, loc in hot.keys()]
            except CorruptIndexError as e:  # damaged pages: the other writers' records are still checked
                rep.problems.append({"tier": "hot", "key": "", "where": str(hot.dir / "index"), "error": str(e)})
                continue
            readable.extend(listed)
            for path in orphans:
                rep.problems.append(
                    {
                        "tier": "hot",
                        "key": "",
                        "where": str(path),
                        "error": "segment file not in the writer's index (index lost or replaced?): its records are not readable",
                    }
                )
        committed: set[str] | None = None
        if self.cold is not None:
            try:
                committed = self._committed_names()
            except SwiftlogError as e:
                rep.problems.append(
                    {"tier": "cold", "key": "", "where": self.config.cold_url or "", "error": f"cannot be listed: {e}"}
                )
            else:  # the checkpoint registrations and gaps other commands read (stat, gc, plan)
                try:
                    self.checkpoints()
                    self.gaps()
                except SwiftlogError as e:
                    rep.problems.append(
                        {
                            "tier": "cold",
                            "key": "",
                            "where": str(getattr(e, "key", None) or self.config.cold_url or ""),
                            "error": f"a registration document cannot be read: {e}",
                        }
                    )
        try:  # registration documents left out of the watermarks: not a registration, or content unlike the name
            self.checkpoints(hot_only=self.cold is not None and committed is None)
        except SwiftlogError:
            pass  # listed above
        else:
            rep.problems.extend(dict(p) for p in self._ckpt_problems)
        wm = self.watermarks(max_age=2.0)
        entries = readable
        for i, (hot, k, loc) in enumerate(entries):
            where = f"{hot.dir}/segments/{loc.segment.id:010d}.seg"
            try:
                blob = hot.read_local(loc)
                if blob is not None:
                    codec.verify_blob(blob, key=k)
                    rep.hot_checked += 1
                if k.iteration < wm.get(k.channel.owner, 0):
                    pass  # garbage: another node's GC may have removed its cold copy already
                elif (
                    loc.segment.state in (UPLOADED, EVICTED)
                    and committed is not None
                    and loc.segment.cold_name not in committed
                ):
                    rep.problems.append(
                        {
                            "tier": "cold",
                            "key": str(k),
                            "where": loc.segment.cold_name or "",
                            "error": "uploaded, but the cold tier no longer has it"
                            + (
                                " (its writer uploads it again when it reopens the store)"
                                if blob is not None
                                else " and the local file is gone: lost"
                            )
                            + "; a cold object whose size no longer matches its commit marker, or whose marker is damaged, is not listed either",
                        }
                    )
                    may_be_gc.append((rep.problems[-1], k.channel.owner, k.iteration))
                elif blob is None and loc.segment.state not in (UPLOADED, EVICTED):
                    rep.problems.append(
                        {
                            "tier": "hot",
                            "key": str(k),
                            "where": where,
                            "error": "segment file missing and never uploaded: lost",
                        }
                    )
                    may_be_gc.append((rep.problems[-1], k.channel.owner, k.iteration))
            except (CorruptRecordError, SwiftlogError) as e:
                rep.problems.append({"tier": "hot", "key": str(k), "where": f"{where}@{loc.offset}", "error": str(e)})
                if not isinstance(e, CorruptRecordError):  # e.g. its file deleted while read
                    may_be_gc.append((rep.problems[-1], k.channel.owner, k.iteration))
            if progress is not None:
                progress("hot", i + 1, len(entries))
        if self.cold is not None and committed is not None:
            segs = self._cold_segments(None)
            for i, seg in enumerate(segs):
                rep.cold_segments += 1
                try:
                    data = self.cold.read(seg.name)
                    entries_c = self._footer(seg.name, seg.size).values()
                except SwiftlogError as e:
                    rep.problems.append({"tier": "cold", "key": "", "where": seg.name, "error": str(e)})
                    if not isinstance(e, CorruptRecordError):  # e.g. deleted since the listing
                        may_be_gc.append((rep.problems[-1], seg.channel.owner, seg.hi))
                    continue
                before = len(rep.problems)
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
                        rep.cold_checked += 1
                    except SwiftlogError as err:
                        rep.problems.append(
                            {"tier": "cold", "key": str(e.key), "where": f"{seg.name}@{e.offset}", "error": str(err)}
                        )
                if len(rep.problems) == before:  # every record intact: the commit marker must still describe the object
                    try:
                        self.cold.check_marker(seg.name, data)
                    except SwiftlogError as e:
                        rep.problems.append(
                            {
                                "tier": "cold",
                                "key": "",
                                "where": seg.name,
                                "error": f"{e} (size or checksum): the marker is damaged",
                            }
                        )
                        if not isinstance(e, CorruptRecordError):  # gone since it was read: a GC, perhaps
                            may_be_gc.append((rep.problems[-1], seg.channel.owner, seg.hi))
                if progress is not None:
                    progress("cold", i + 1, len(segs))
        if may_be_gc:  # garbage since the check began (a GC ran meanwhile): not a problem
            try:
                wm = self.watermarks(max_age=0.0)
            except SwiftlogError:
                wm = {}
            gone = {id(p) for p, owner, it in may_be_gc if it < wm.get(owner, 0)}
            rep.problems = [p for p in rep.problems if id(p) not in gone]
        return rep

    # ================================================================== lifecycle
    def close(self, *, flush: bool = False, timeout: float = 30.0) -> None:
        """Seal open segments, stop the uploader and release the tiers.

        ``flush=True`` also uploads everything first (errors are logged, not raised: the data
        stays in the hot tier). Waits at most ``timeout`` seconds for the uploader's upload in
        progress (a slow object store): then the tiers close under it, and it ends quietly.
        Never deletes anything.
        """
        if self._closed:
            return
        try:
            if self.hot is not None:
                try:
                    if flush:
                        self.flush(timeout)
                    else:
                        self.hot.seal_all()
                except SwiftlogError as e:
                    logger.warning("close of run %s: %s", self.run, e)
        finally:
            self._stop.set()
            self._wake.set()
            if self._uploader is not None:
                self._uploader.join(timeout=timeout)
            with self._lock:
                for hot in self._readers.values():
                    hot.close()
                self._readers.clear()
            if self.cold is not None:
                self.cold.close()
            self._closed = True
