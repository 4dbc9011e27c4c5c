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

``LogStore`` is the facade: writes and reads are here; each other job is a helper object in a
private module. ``_hot_tiers``: the hot tiers of the node. ``_cold_index``: the cold listing
cache and footers. ``_shipper``: uploads, backlog, eviction. ``_retention``: registrations,
watermarks, GC. ``_listing``: pages of records. ``_stats`` and ``_verify``: inspection.

Never: blocks a writer's ``put`` on the object store (uploads run in the background; what reaches
the cold tier, ``flush``/``verify``/``gc``, reads of records only it holds, listings and ``stats``,
waits for it, bounded by its timeouts and retries); deletes a record at or above its owner's
watermark; returns bytes that fail their checksum.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from logstore import codec
from logstore._cold_index import ColdIndex, copy_age
from logstore._hot_tiers import HotTiers, list_runs, writers_under
from logstore._listing import RecordListing
from logstore._retention import Retention
from logstore._shipper import Shipper
from logstore._stats import store_stats
from logstore._verify import verify
from logstore.checkpoints import CheckpointInfo, check_portable_json
from logstore.cold import ColdTier
from logstore.config import StoreConfig
from logstore.errors import ConfigError, CorruptRecordError, RecordNotFoundError, StoreError, SwiftlogError
from logstore.hot import HotTier, Location
from logstore.keys import Channel, Kind, RecordKey, validate_name
from logstore.reports import GcReport, RecordInfo, UnregisterPreview, VerifyReport
from logstore.segment import FRAME_HEADER_SIZE, BlobStream, blob_checksum, check_frame_header

__all__ = ["LogStore", "Encoded", "list_runs", "writers_under"]

logger = logging.getLogger(__name__)


class Encoded(NamedTuple):
    """An encoded record ready for ``LogStore.put_encoded`` (made by ``LogStore.encode``)."""

    key: RecordKey
    blob: bytes
    raw_len: int
    checksum: int


class LogStore:
    """Tiered store of one run on one node. Thread-safe; see the module docstring."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.run = config.run
        self.root = Path(config.root)
        self._run_dir = self.root / self.run
        self._closed = False
        self.cold: ColdTier | None = None
        if config.cold_url:
            self.cold = ColdTier(config.cold_url, storage_options=config.cold_options or None)
        self.hot: HotTier | None = None
        self._tiers = HotTiers(self._run_dir)
        self._cold_index = ColdIndex(self.cold, self.run) if self.cold is not None else None
        self._shipper = Shipper(config, self.cold, self._cold_index, self._tiers)
        self._retention = Retention(
            self.run,
            self.cold,
            self._cold_index,
            self._tiers,
            stale_upload_age=config.stale_upload_age,
            note_error=self._shipper.note_error,
            after_gc=self._after_gc,
        )
        self._listing = RecordListing(self._tiers, self._cold_index, self._retention.watermarks)
        if config.writer is not None:
            try:
                self._run_dir.mkdir(parents=True, exist_ok=True)
                self.hot = HotTier(
                    self._run_dir / config.writer,
                    owner=True,
                    durability=config.durability,
                    segment_iters=config.segment_iters,
                    segment_max_bytes=config.segment_max_bytes,
                    on_seal=self._shipper.on_seal,
                )
            except OSError as e:  # a read-only or missing mount, no permission
                where = f"store root {str(config.root)!r}: cannot write under {str(self._run_dir)!r}"
                raise ConfigError(
                    f"{where}: {e.strerror or e}",
                    hint="the store root must be a writable directory on a local disk",
                ) from e
            self._tiers.attach_own(config.writer, self.hot)
            self._shipper.start(self.hot, self._retention.watermarks)

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
        self._shipper.check_backlog(items)
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
        self._shipper.wake()

    def gaps(self, *, hot_only: bool = False) -> list[dict[str, Any]]:
        """Every recorded gap, from all hot tiers of this node and (unless ``hot_only``) the cold
        tier; a cold tier that cannot be listed is noted (``stats()``), and its gaps are missing."""
        seen: dict[tuple, dict] = {}
        for hot in self._tiers.all():
            for d in hot.docs("gap/").values():
                seen[(d["channel"], d["iteration"], d["micro_batch"])] = d
        if self.cold is not None and not hot_only:
            try:
                for name in self.cold.list_docs(f"{self.run}/gaps/"):
                    d = self.cold.get_doc(name)
                    if d:
                        seen[(d["channel"], d["iteration"], d["micro_batch"])] = d
            except SwiftlogError as e:
                self._shipper.note_error(e)
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
            except SwiftlogError as e:
                # corrupt there too, or unreachable: the hot copy's corruption is the fact to report
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
        """The encoded record under ``key`` as a :class:`~logstore.segment.BlobStream`, verified as it is read
        (the last chunk only once the whole record matched); one in no local segment file comes from
        :meth:`get_blob`. Raises like :meth:`get_blob`; the caller closes the stream or iterates it to the end."""
        self._refuse_collected(key)
        stream = self._stream_here(key, chunk_size)
        return stream if stream is not None else BlobStream.of_bytes(key, self.get_blob(key), chunk_size)

    def open_local_blob(self, key: RecordKey, chunk_size: int = 1 << 20) -> BlobStream | None:
        """:meth:`open_blob` from this node's memory and disk alone, or None where that is not enough:
        the watermarks were not read in the last 2 s, the record may be garbage, it is in no local
        segment file, or its local copy fails its first check. Never touches the network."""
        wm = self._retention.cached_watermarks(max_age=2.0)
        if wm is None or key.iteration < wm.get(key.channel.owner, 0):
            return None
        return self._stream_here(key, chunk_size)

    def _stream_here(self, key: RecordKey, chunk_size: int) -> BlobStream | None:
        """The record from the first local segment file that indexes it; None when none does, its file
        is gone, or its first check fails (the cold tier or another copy may serve it)."""
        found = next(self._hot_locations(key), None)
        try:
            return None if found is None else found[0].stream_local(found[1], key, chunk_size)
        except CorruptRecordError:
            return None

    def _hot_locations(self, key: RecordKey) -> Iterator[tuple[HotTier, Location]]:
        """Each hot tier here that indexes ``key``, with the record's location in it."""
        for hot in self._tiers.all():
            if (loc := hot.lookup(key)) is not None:
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

    def _cold_get(self, key: RecordKey) -> bytes | None:
        """The blob of ``key`` from the newest cold copy that holds it (None when none does)."""
        assert self._cold_index is not None
        kb = key.encode()
        for refresh in (False, self._cold_index.listing_age() > 0.5):
            # Newest first: a writer restarted by a rollback numbers past its earlier uploads, and its copy is the
            # one the job went on from.
            for seg in sorted(
                self._cold_index.segments(key.channel, key.iteration, key.iteration + 1, refresh=refresh),
                key=copy_age,
                reverse=True,
            ):
                e = self._cold_index.footer(seg.name, seg.size).get(kb)
                if e is None:
                    continue
                return self._cold_read(seg.name, key, e.offset, e.length, e.checksum)
        return None

    # ---------------------------------------------------------------- listings
    def keys(
        self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None, *, hot_only: bool = False
    ) -> list[RecordKey]:
        """Every key (both tiers, deduplicated, key order) of ``channel`` in ``[it_lo, it_hi)``,
        or of all channels; keys below their watermark are left out. Raises
        ColdTierUnavailableError when the cold tier cannot be listed; ``hot_only``: the hot
        tiers' indexes alone (they also know their records evicted to the cold tier)."""
        found: set[RecordKey] = set()
        for hot in self._tiers.all():
            found.update(k for k, _ in hot.keys(channel, it_lo, it_hi))
        if self.cold is not None and not hot_only:
            for seg in self._cold_index.segments(channel, it_lo, it_hi):
                # keys decoded once, when the footer was read
                for e in self._cold_index.footer(seg.name, seg.size).values():
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
        for hot in self._tiers.all():
            names |= hot.channels()
        if self.cold is not None:
            names |= set(self._cold_index.listing().keys())
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
        return self._listing.list_records(
            channel,
            it_lo,
            it_hi,
            kinds=kinds,
            micro_batch=micro_batch,
            after=after,
            limit=limit,
            hot_only=hot_only,
        )

    # ---------------------------------------------------------------- hot tiers of the node
    def writers(self) -> list[str]:
        """Names of the writers with a hot tier of this run under this root (sorted; [] for none)."""
        return self._tiers.writers()

    def unreadable_writers(self) -> dict[str, str]:
        """Writers whose index readers leave out (damaged, truncated, missing), and why; {} when none."""
        return self._tiers.unreadable()

    def is_cold_only(self) -> bool:
        """True for a store that reads a cold tier and no writer's hot tier (``plan.cold_only_store``)."""
        return self.cold is not None and not self.writers()

    def refresh_cold_listing(self) -> None:
        """List the cold tier now, so that reads keep using a fresh listing without paying for it.

        For long-lived readers (the admin server) to call from a background thread every few
        seconds. Raises ColdTierUnavailableError like any listing; a no-op without a cold tier.
        """
        if self._cold_index is not None:
            self._cold_index.listing(refresh=True)

    # ================================================================== upload
    def seal(self, channels: Iterable[Channel] | None = None) -> None:
        """Seal the open segments of ``channels`` (all when None) and wake the uploader.

        Never waits for the upload: use it to ship small, precious streams (inputs, targets,
        digests) off the node promptly without blocking the caller on the object store.
        """
        self._shipper.seal(self._writer_hot(), channels)

    def wait_shipped(self, channels: Iterable[Channel], iteration: int, timeout: float) -> bool:
        """Wait until every record of ``channels`` at or below ``iteration`` that this store's
        writer has written is in the cold tier; True when it is, False after ``timeout`` seconds
        (the cold tier is slow or down: the records stay in the hot tier and go up later) or
        without a cold tier. Only sealed segments are uploaded: :meth:`seal` the channels first,
        after the records are written. Never uploads on the caller's thread or raises for the
        cold tier's errors."""
        return self._shipper.wait_shipped(channels, iteration, timeout, self._writer_hot)

    def flush(self, timeout: float | None = None) -> int:
        """Seal every open segment and upload everything to the cold tier now.

        Returns the number of segments uploaded. Raises ColdTierUnavailableError (records stay
        safe in the hot tier) when the object store cannot take them, or when ``timeout``
        seconds pass first (checked between segments: one upload in flight may overrun it by up
        to the cold tier's ``timeout_s``).
        """
        return self._shipper.flush(self._writer_hot(), timeout)

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
        return self._shipper.upload_sealed()

    # ================================================================== checkpoints and GC
    def put_document(self, name: str, doc: dict[str, Any]) -> None:
        """Keep a small JSON document of the run (e.g. its cost profile) under ``name``: in the cold
        tier (shared by every node) when there is one, and in a hot tier of this node. Raises
        ConfigError for a document that is not portable JSON, InvalidNameError for a bad name."""
        validate_name(name, "document name")
        try:
            if not isinstance(doc, dict):
                raise ValueError(f"a document is a JSON object, not {type(doc).__name__}")
            check_portable_json(doc)
        except ValueError as e:
            raise ConfigError(f"document {name!r} of run {self.run!r} is not portable JSON: {e}") from e
        if self.cold is not None:
            self.cold.put_doc(f"{self.run}/documents/{name}.json", doc)
        hot = self._tiers.own or next(iter(self._tiers.all()), None)
        if hot is None and self.cold is None:
            raise StoreError(
                f"run {self.run!r} has no tier here to keep document {name!r}", hint="open it with writer="
            )
        if hot is not None:
            hot.put_doc(f"document/{name}", doc)

    def get_document(self, name: str) -> dict[str, Any] | None:
        """The run's document ``name`` (``put_document``), from the cold tier first; None if none."""
        validate_name(name, "document name")
        if self.cold is not None:
            doc = self.cold.get_doc(f"{self.run}/documents/{name}.json")
            if doc is not None:
                return doc
        for hot in self._tiers.all():
            doc = hot.docs(f"document/{name}").get(f"document/{name}")
            if doc is not None:
                return doc
        return None

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
        return self._retention.register(stage, iteration, uri=uri, meta=meta)

    def unregister_checkpoint(self, stage: int, iteration: int) -> CheckpointInfo | None:
        """Withdraw the registration of ``stage``'s checkpoint at ``iteration``: in the cold tier
        first, then in every hot index of this node. Returns it, or None when it was not
        registered. No plan starts from it any more; when it was the stage's newest, the
        watermark falls back to the newest one left (records a GC already deleted stay deleted).
        Raises ColdTierUnavailableError if the cold tier cannot forget it (nothing is changed
        here then)."""
        return self._retention.unregister(stage, iteration)

    def adopt_registration(self, doc: dict[str, Any]) -> CheckpointInfo:
        """Record another node's registration ``doc`` (as :meth:`register_checkpoint` stored it) in
        this node's hot index, as it is: what a node without a cold tier learns through the commit
        store, so that its GC frees what that stage received from here. Never written to the cold
        tier. Raises CorruptRecordError for a document that is not a registration, StoreError
        without a hot tier to write to."""
        return self._retention.adopt(doc)

    def preview_unregister(self, stage: int, iteration: int) -> UnregisterPreview | None:
        """What :meth:`unregister_checkpoint` would do, changing nothing: the registration, every
        watermark with and without it, and a GC dry run of each. None when it is not registered.
        Raises like :meth:`checkpoints` and :meth:`gc`."""
        return self._retention.preview_unregister(stage, iteration)

    def checkpoints(self, *, hot_only: bool = False) -> list[CheckpointInfo]:
        """Every registered checkpoint (cold tier and local), sorted by (stage, iteration). Raises
        ColdTierUnavailableError when the cold tier cannot be listed; ``hot_only``: those
        registered through this node's hot tiers only (what it knows without the object store).

        A document whose content disagrees with its name, or that is not a registration, is left
        out with a warning (``verify`` lists it); unknown fields are ignored with a warning."""
        return self._retention.checkpoints(hot_only=hot_only)

    def watermarks(self, max_age: float = 0.0) -> dict[int, int]:
        """stage -> the iteration below which what the stage received is garbage: its newest durable
        checkpoint; for a stage of a logging group (registrations whose meta names
        ``logging_groups``, e.g. [2, 2]), the oldest of its members' newest checkpoints, since the
        group is replayed together from the checkpoint every member has. The registrations as they
        stand decide: an unregistered one lowers the watermark in every process that reads them
        again. ``max_age`` allows a cached answer."""
        return self._retention.watermarks(max_age)

    def gc(self, *, dry_run: bool = False, watermarks: dict[int, int] | None = None) -> GcReport:
        """Delete every record received by a stage below that stage's watermark, in both tiers.

        Idempotent; safe while writers append (open segments are never removed). ``dry_run``
        lists what would be deleted without deleting. Nothing at or above a watermark is touched.
        Also aborts multipart uploads older than ``stale_upload_age``, and removes cold objects
        left without a commit marker for longer than that (counted and listed with the cold
        segments deleted). ``watermarks`` (dry runs only): plan with these instead of the
        registered ones (what a change of registrations would do).
        """
        return self._retention.gc(dry_run=dry_run, watermarks=watermarks)

    def _after_gc(self) -> None:
        if self.hot is not None:
            self._shipper.refresh_backlog()

    # ================================================================== inspection
    def stats(self) -> dict[str, Any]:
        """Records and bytes per tier and channel, raw vs stored, upload backlog and errors, and what GC
        deleted from the hot tiers (``hot["collected"]``: owner stage -> records, stored bytes, ``below``)."""
        return store_stats(self.run, self._tiers.all(), self.cold, self._cold_index, self._shipper.stats)

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
        return verify(
            tiers=self._tiers,
            cold=self.cold,
            cold_url=self.config.cold_url,
            cold_index=self._cold_index,
            retention=self._retention,
            gaps=self.gaps,
            progress=progress,
        )

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
            self._shipper.stop(timeout)
            self._tiers.close()
            if self.cold is not None:
                self.cold.close()
            self._closed = True
