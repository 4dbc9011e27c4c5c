"""The cold tier's contract: :class:`ColdTier` over a backend (``_file`` or ``_s3``), with commit
markers, idempotent uploads, fencing of two uploaders of one name, documents and maintenance.

The promises are listed in the package docstring (:mod:`logstore.cold`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import xxhash

from logstore.cold._backend import Backend, MiB, Source, SourceReader
from logstore.cold._file import FileBackend
from logstore.cold._names import (
    DOCS_PREFIX,
    MARKER_SUFFIX,
    parse_cold_url,
    validate_path,
    validate_prefix,
    validate_segment_name,
)
from logstore.cold._s3 import S3Backend
from logstore.errors import (
    ConfigError,
    CorruptRecordError,
    InvalidNameError,
    ObjectExistsError,
    RecordNotFoundError,
    SegmentClashError,
    StoreClosedError,
)

__all__ = ["ColdTier", "SegmentInfo", "MIN_PART_SIZE"]

logger = logging.getLogger(__name__)

MIN_PART_SIZE = 5 * MiB  # S3's minimum for every multipart part but the last
_MARKER_VERSION = 1
_PROBE_PREFIX = "_swiftlog-probe/"  # "_" starts no valid name: never a segment, a document or a listing of either


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A committed segment as recorded by its marker.

    name: path relative to the tier root. size: bytes. checksum: xxh3-64 of the bytes
    (``logstore.segment.blob_checksum``). meta: the caller's dict given to ``put_segment``.
    created: when the marker was written (UTC). tag: the object as the store reported it when it
    was written (None in markers written before tags); not compared.
    """

    name: str
    size: int
    checksum: int
    meta: dict[str, Any] = field(default_factory=dict)
    created: datetime = field(default_factory=lambda: datetime.now(UTC))
    tag: str | None = field(default=None, compare=False)


class ColdTier:
    """Immutable committed segments and JSON documents under one ``file://`` or ``s3://`` root.

    Args:
        url: ``file:///abs/dir``, a plain directory path (made absolute), or ``s3://bucket/prefix``
            (``s3a://`` too).
        storage_options: for s3, keyword arguments of ``s3fs.S3FileSystem`` (endpoint, keys,
            ``config_kwargs``...). Defaults added unless given: connect timeout
            ``min(2, timeout_s)`` s, read timeout ``timeout_s``, botocore retries off (this
            class retries), region us-east-1, no instance or listings cache, and one aiobotocore
            session shared by the process's tiers (unless ``session`` or ``profile`` is given).
            Ignored for file://.
        multipart_threshold: bytes; larger sources go up as a multipart upload (default 32 MiB).
        part_size: bytes per multipart part, and the chunk size of file:// copies (default
            8 MiB, at least 5 MiB; raised automatically so that no upload needs > 10,000 parts).
        retries: how many times a request that failed transiently is retried (default 3),
            with backoff 50 ms doubling to at most 1 s, and never past ``timeout_s``.
        timeout_s: per-request read timeout and the retry deadline of one request (default 30).
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        multipart_threshold: int = 32 * MiB,
        part_size: int = 8 * MiB,
        retries: int = 3,
        timeout_s: float = 30.0,
    ) -> None:
        scheme, where, prefix = parse_cold_url(url)
        if not isinstance(part_size, int) or part_size < MIN_PART_SIZE:
            raise ConfigError(f"cold tier part_size {part_size!r} is below S3's minimum part size {MIN_PART_SIZE}")
        if not isinstance(multipart_threshold, int) or multipart_threshold < 0:
            raise ConfigError(f"cold tier multipart_threshold {multipart_threshold!r} must be an int >= 0")
        if not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"cold tier retries {retries!r} must be an int >= 0")
        if not timeout_s > 0:
            raise ConfigError(f"cold tier timeout_s {timeout_s!r} must be > 0")
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.retries = retries
        self.timeout_s = float(timeout_s)
        self._closed = False
        if scheme == "file":
            self._backend: Backend = FileBackend(where, part_size=part_size)
            self.url = "file://" + where
        else:
            self.url = f"s3://{where}/{prefix}" if prefix else f"s3://{where}"
            self._backend = S3Backend(
                self.url,
                where,
                prefix,
                storage_options or {},
                part_size=part_size,
                multipart_threshold=multipart_threshold,
                retries=retries,
                timeout_s=self.timeout_s,
            )
        # parsed commit markers, keyed by (marker key, marker size, object size): a marker never
        # changes while its segment exists, so a listing re-reads only markers it has not seen
        self._marker_cache: dict[tuple[str, int, int], SegmentInfo] = {}
        self._marker_lock = threading.Lock()
        self._fenced: bool | None = None  # fenced_writes(), once probed

    # -- segments -------------------------------------------------------------------------
    def put_segment(self, name: str, source: Source, *, meta: dict[str, Any]) -> SegmentInfo:
        """Store ``source`` (bytes or a local file path, streamed) as segment ``name``, then commit it.

        The object is fully stored before its marker is written. The marker names the object as
        the store reported it (its tag) and is written only if none exists; then both are read
        back. If ``name`` is already committed with the same size and checksum and its object is
        the one the marker names, nothing is uploaded and the stored info is returned; if that
        object was lost or replaced, it is stored again and the marker rewritten. Raises
        :class:`SegmentClashError` when ``name`` is committed with different bytes (segments are
        immutable: delete first), when another uploader commits it while this one writes, or when
        the read-back finds another object or marker. An uncommitted object left by a crash is
        overwritten.
        """
        self._check_open()
        name = validate_segment_name(name)
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, not {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(f"meta for segment {name!r} is not JSON-serialisable: {e}") from None
        src = SourceReader(source)
        existing = self._read_marker(name)
        if existing is None:
            return self._write_and_commit(name, src, meta)
        size, checksum = src.checksum()
        if (size, checksum) != (existing.size, existing.checksum):
            raise self._clash(name, existing, size, checksum)
        if self._holds(name, existing):
            logger.debug("cold put %s: already committed, skipped", name)
            return existing
        # The marker outlived its object (deleted, or replaced by another uploader's): store ours again.
        logger.warning("cold tier %s: committed %s lost its object; uploading it again", self.url, name)
        return self._write_and_commit(name, src, meta, repair=existing)

    def _write_and_commit(
        self, name: str, src: SourceReader, meta: dict[str, Any], repair: SegmentInfo | None = None
    ) -> SegmentInfo:
        """Write the object, then its marker (only if none exists, unless ``repair``: the committed
        info of these same bytes), then read both back."""
        size, checksum, tag = self._backend.put_stream(name, src)
        if repair is not None:
            info = dataclasses.replace(repair, tag=tag)
            self._backend.put_bytes(name + MARKER_SUFFIX, _marker_bytes(info))  # the same bytes: only the tag changes
        else:
            info = SegmentInfo(name, size, checksum, dict(meta), datetime.now(UTC), tag=tag)
            try:
                self._backend.put_bytes(name + MARKER_SUFFIX, _marker_bytes(info), exclusive=True)
            except ObjectExistsError:
                other = self._read_marker(name)
                if other is None or (other.size, other.checksum) != (size, checksum):
                    raise self._clash(name, other, size, checksum, racing=True) from None
                info = other  # another uploader committed the same bytes (a flush racing the writer's uploader)
        now = self._read_marker(name)  # read back: the marker, and the object it names, are still these bytes
        if now is None or (now.size, now.checksum) != (info.size, info.checksum) or not self._holds(name, now):
            raise SegmentClashError(
                f"segment {name!r} in {self.url} changed while it was committed (another uploader of the name): "
                "its object or marker is not this upload's",
                key=name,
                hint="the records stay where they are; the upload is retried (a later incarnation of the writer wins)",
            )
        logger.debug("cold put %s: %d bytes committed", name, size)
        return now

    def _clash(
        self, name: str, other: SegmentInfo | None, size: int, checksum: int, racing: bool = False
    ) -> SegmentClashError:
        stored = "by another uploader meanwhile" if racing else "already"
        theirs = "" if other is None else f" (stored size {other.size} checksum {other.checksum:#x})"
        return SegmentClashError(
            f"segment {name!r} in {self.url} is {stored} committed with different bytes{theirs}, "
            f"new size {size} checksum {checksum:#x}",
            key=name,
            hint="segments are immutable; delete_segment() first if replacing it is intended",
        )

    def _holds(self, name: str, info: SegmentInfo, *, trust_tag: bool = True) -> bool:
        """The object ``name`` holds the bytes ``info`` (a marker) describes: its size, then its tag
        when ``trust_tag`` and the marker records one, else its checksum, read back (an object
        written again, or a copied tier, has another tag)."""
        st = self._backend.stat(name)
        if st is None or st[0] != info.size:
            return False
        if trust_tag and info.tag is not None and st[1] == info.tag:
            return True
        data = self._backend.get(name)
        return data is not None and xxhash.xxh3_64_intdigest(data) == info.checksum

    def confirm_segment(self, name: str, source: Source) -> bool:
        """True when ``name`` is committed with exactly the bytes of ``source`` (bytes or a local
        file path) and its object is the one the marker names; False otherwise. Where writes are
        not fenced (:meth:`fenced_writes`), or the marker records no tag, the object is read back
        and checksummed too. What a writer asks before it drops its own copy. Raises when the
        store cannot be reached."""
        self._check_open()
        name = validate_segment_name(name)
        info = self._read_marker(name)
        if info is None or (info.size, info.checksum) != SourceReader(source).checksum():
            return False
        return self._holds(name, info, trust_tag=bool(self.fenced_writes()))

    def fenced_writes(self, *, probe: bool = True) -> bool | None:
        """Whether the store refuses a second conditional write of one key (``If-None-Match: *``
        on s3, a hard link on file://): only then does one of two uploaders of a segment name
        always lose. Probed once per tier (two writes and a delete of a key outside every
        listing), remembered, and warned about when False; ``probe=False`` only says what is
        remembered (None before the probe). Raises like any write when the store cannot be
        reached (nothing is remembered then)."""
        self._check_open()
        if self._fenced is not None or not probe:
            return self._fenced
        key = f"{_PROBE_PREFIX}fence-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            self._backend.put_bytes(key, b"1", exclusive=True)
            try:
                self._backend.put_bytes(key, b"2", exclusive=True)
                fenced = False
            except ObjectExistsError:
                fenced = True
        finally:
            self._backend.delete(key)
        if not fenced:
            logger.warning(
                "cold tier %s does not refuse a second conditional write: two uploaders of one segment name "
                "are not fenced (a writer drops its copy of a segment only after reading the committed one back)",
                self.url,
            )
        self._fenced = fenced
        return fenced

    def list_segments(self, prefix: str = "") -> list[SegmentInfo]:
        """Every committed segment whose name starts with ``prefix``, sorted by name.

        One listing plus one read per marker not seen before (concurrent on s3; markers are
        immutable, so parsed ones are cached). Objects without a marker, and markers whose object
        is missing or of another size, are left out (the latter logged).
        """
        self._check_open()
        prefix = validate_prefix(prefix)
        listing = self._backend.list(prefix)
        listing = {k: v for k, v in listing.items() if not k.startswith((DOCS_PREFIX, _PROBE_PREFIX))}
        marker_keys = [k for k in listing if k.endswith(MARKER_SUFFIX) and k[: -len(MARKER_SUFFIX)] in listing]
        for k in listing:
            if k.endswith(MARKER_SUFFIX) and k[: -len(MARKER_SUFFIX)] not in listing:
                logger.warning("cold tier %s: marker %s has no object; not listed", self.url, k)
        with self._marker_lock:
            # forget markers of segments under this prefix that are gone (deleted elsewhere)
            for k in [k for k in self._marker_cache if k[0].startswith(prefix) and k[0] not in listing]:
                del self._marker_cache[k]
            cached = {
                mk: self._marker_cache.get((mk, listing[mk], listing[mk[: -len(MARKER_SUFFIX)]])) for mk in marker_keys
            }
        blobs = self._backend.get_many([mk for mk in marker_keys if cached[mk] is None])
        out = []
        for mk in marker_keys:
            name = mk[: -len(MARKER_SUFFIX)]
            info = cached[mk]
            if info is None:
                blob = blobs.get(mk)
                if blob is None:  # deleted between listing and read
                    continue
                info = _parse_marker(name, blob)
                if info is not None:
                    with self._marker_lock:
                        self._marker_cache[(mk, listing[mk], listing[name])] = info
            if info is None:
                logger.warning("cold tier %s: unreadable marker %s; segment not listed", self.url, mk)
                continue
            if info.size != listing[name]:
                logger.warning(
                    "cold tier %s: object %s has %d bytes but its marker says %d; not listed",
                    self.url,
                    name,
                    listing[name],
                    info.size,
                )
                continue
            out.append(info)
        out.sort(key=lambda i: i.name)
        return out

    def segment_info(self, name: str) -> SegmentInfo | None:
        """The committed info of ``name`` (one marker read), or None if it is not committed."""
        self._check_open()
        return self._read_marker(validate_segment_name(name))

    def read(self, name: str, *, verify: bool = False) -> bytes:
        """The whole object ``name``. Missing -> :class:`RecordNotFoundError`.

        With ``verify=True`` the marker must exist and the bytes must match its size and
        checksum (else :class:`RecordNotFoundError` / :class:`CorruptRecordError`).
        """
        self._check_open()
        name = validate_segment_name(name)
        data = self._backend.get(name)
        if data is None:
            raise RecordNotFoundError(f"segment {name!r} not found in {self.url}", key=name)
        if verify:
            self.check_marker(name, data)
        return data

    def check_marker(self, name: str, data: bytes) -> None:
        """``data`` (the object ``name``, read) against its commit marker: RecordNotFoundError when it
        is not committed (or gone), CorruptRecordError when its size or checksum differs."""
        self._check_open()
        name = validate_segment_name(name)
        info = self._read_marker(name)
        if info is None:
            raise RecordNotFoundError(f"segment {name!r} in {self.url} is not committed", key=name)
        if len(data) != info.size or xxhash.xxh3_64_intdigest(data) != info.checksum:
            raise CorruptRecordError(f"segment {name!r} in {self.url} does not match its commit marker", key=name)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``start``; a negative ``start`` counts from the end.

        Follows Python slicing: ``read_range(n, -64, 64)`` is the last 64 bytes (fewer if the
        object is shorter), a range past the end gives fewer bytes or ``b""``. Missing ->
        :class:`RecordNotFoundError`.
        """
        self._check_open()
        name = validate_segment_name(name)
        if not isinstance(start, int) or not isinstance(length, int) or length < 0:
            raise ValueError(f"read_range({name!r}, {start!r}, {length!r}): start must be an int, length an int >= 0")
        data = self._backend.get_range(name, start, length)
        if data is None:
            raise RecordNotFoundError(f"segment {name!r} not found in {self.url}", key=name)
        return data

    def delete_segment(self, name: str) -> None:
        """Remove the marker, then the object. Deleting what does not exist succeeds."""
        self._check_open()
        name = validate_segment_name(name)
        with self._marker_lock:
            for k in [k for k in self._marker_cache if k[0] == name + MARKER_SUFFIX]:
                del self._marker_cache[k]
        self._backend.delete(name + MARKER_SUFFIX)
        self._backend.delete(name)

    # -- documents ------------------------------------------------------------------------
    def put_doc(self, name: str, obj: dict[str, Any]) -> None:
        """Store a small JSON document atomically (replacing any previous one)."""
        self._check_open()
        name = validate_path(name, "document name")
        if not isinstance(obj, dict):
            raise TypeError(f"document {name!r} must be a dict, not {type(obj).__name__}")
        self._backend.put_bytes(DOCS_PREFIX + name, json.dumps(obj, sort_keys=True).encode())

    def get_doc(self, name: str) -> dict[str, Any] | None:
        """The document ``name``, or None if there is none. Undecodable -> CorruptRecordError."""
        self._check_open()
        name = validate_path(name, "document name")
        blob = self._backend.get(DOCS_PREFIX + name)
        if blob is None:
            return None
        try:
            obj = json.loads(blob)
        except ValueError as e:
            raise CorruptRecordError(f"document {name!r} in {self.url} is not JSON: {e}", key=name) from e
        if not isinstance(obj, dict):
            raise CorruptRecordError(f"document {name!r} in {self.url} is not a JSON object", key=name)
        return obj

    def list_docs(self, prefix: str = "") -> list[str]:
        """Names of the documents starting with ``prefix`` (as :meth:`get_doc` takes them), sorted."""
        self._check_open()
        prefix = validate_prefix(prefix)
        n = len(DOCS_PREFIX)
        return sorted(k[n:] for k in self._backend.list(DOCS_PREFIX + prefix))

    def delete_doc(self, name: str) -> None:
        """Remove a document; a missing one is success."""
        self._check_open()
        name = validate_path(name, "document name")
        self._backend.delete(DOCS_PREFIX + name)

    # -- maintenance ----------------------------------------------------------------------
    def abort_stale_uploads(self, older_than: timedelta, prefix: str = "") -> list[str]:
        """Reclaim uploads that a crashed writer left behind, idle for more than ``older_than``.

        s3: aborts in-progress multipart uploads under ``prefix`` that were initiated, and last
        received a part, more than ``older_than`` ago (moto reports a fixed 2010 ``Initiated``,
        so there only the parts' times count); file://: removes temporary files last written
        more than ``older_than`` ago. Returns the names (relative to the root) whose upload was
        aborted, one entry per upload. Never touches committed segments or completed objects.
        ``timedelta(0)`` also aborts uploads in progress right now: use it only when no writer runs.
        """
        self._check_open()
        if not isinstance(older_than, timedelta):
            raise TypeError(f"older_than must be a datetime.timedelta, not {type(older_than).__name__}")
        prefix = validate_prefix(prefix)
        cutoff = datetime.now(UTC) - older_than
        return self._backend.abort_stale(prefix, cutoff)

    def remove_uncommitted(self, older_than: timedelta, prefix: str = "", *, dry_run: bool = False) -> dict[str, int]:
        """Delete the objects under ``prefix`` that have no commit marker and were last written more
        than ``older_than`` ago: what a crashed upload (the object, never its marker) or a crash
        between :meth:`delete_segment`'s two deletes leaves. Younger ones may be uploads under way.

        Returns ``{name: size}`` of what was deleted (with ``dry_run``: what would be). Each object is
        checked again right before its delete (no marker yet, not rewritten since), so an upload
        that commits meanwhile keeps it. Never touches documents, markers, temporaries or anything
        with a marker.
        """
        self._check_open()
        if not isinstance(older_than, timedelta):
            raise TypeError(f"older_than must be a datetime.timedelta, not {type(older_than).__name__}")
        prefix = validate_prefix(prefix)
        cutoff = datetime.now(UTC) - older_than
        listing = {k: v for k, v in self._backend.list_modified(prefix).items() if not k.startswith(DOCS_PREFIX)}
        out: dict[str, int] = {}
        for name, (size, modified) in sorted(listing.items()):
            if name.endswith(MARKER_SUFFIX) or name + MARKER_SUFFIX in listing or modified > cutoff:
                continue
            try:
                validate_segment_name(name)
            except InvalidNameError:
                continue
            if not dry_run:
                if self._backend.size(name + MARKER_SUFFIX) is not None:
                    continue  # committed since the listing
                now = self._backend.modified(name)
                if now is None or now > cutoff:
                    continue  # gone, or written again (an upload under way)
                self._backend.delete(name)
                logger.info(
                    "cold tier %s: removed %s, left without a commit marker since %s",
                    self.url,
                    name,
                    modified.isoformat(),
                )
            out[name] = size
        return out

    def health(self) -> None:
        """Return if the tier is reachable and usable; else raise ColdTierUnavailableError
        (or ColdTierError when the store refuses us, e.g. bad credentials or no such bucket)."""
        self._check_open()
        self._backend.health()

    def close(self) -> None:
        """Release the client; later calls raise StoreClosedError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> ColdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ColdTier({self.url!r})"

    # -- internals ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"cold tier {self.url} used after close()")

    def _read_marker(self, name: str) -> SegmentInfo | None:
        blob = self._backend.get(name + MARKER_SUFFIX)
        if blob is None:
            return None
        info = _parse_marker(name, blob)
        if info is None:
            logger.warning("cold tier %s: unreadable marker for %s; treating it as uncommitted", self.url, name)
        return info


def _marker_bytes(info: SegmentInfo) -> bytes:
    marker = {
        "v": _MARKER_VERSION,
        "size": info.size,
        "checksum": info.checksum,
        "algo": "xxh3_64",
        "created": info.created.isoformat(),
        "meta": info.meta,
        "tag": info.tag,
    }
    return json.dumps(marker, sort_keys=True).encode()


def _parse_marker(name: str, blob: bytes) -> SegmentInfo | None:
    try:
        d = json.loads(blob)
        tag = d.get("tag")
        return SegmentInfo(
            name=name,
            size=int(d["size"]),
            checksum=int(d["checksum"]),
            meta=dict(d.get("meta") or {}),
            created=datetime.fromisoformat(d["created"]),
            tag=tag if isinstance(tag, str) else None,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
