"""The cold tier: immutable segments and small JSON documents in object storage.

One class, :class:`ColdTier`, with the same contract over two backends:

- ``file:///abs/dir`` (or a plain directory path): the embedded default, a local or shared
  filesystem; every write is temp file + fsync + rename + fsync of the directory.
- ``s3://bucket/prefix``: any S3-compatible server through s3fs's aiobotocore client
  (``storage_options`` go to ``s3fs.S3FileSystem``: ``key``, ``secret``,
  ``client_kwargs={"endpoint_url": ..., "region_name": ...}``, ``config_kwargs``...).

Layout under the tier root (names are caller-chosen ``/``-separated paths, every component a
:func:`logstore.keys.validate_name` name)::

    <name>                      a segment's bytes; immutable once committed
    <name>.commit               its commit marker, written LAST and only if none exists: JSON
                                {v, size, checksum (xxh3-64 of the bytes, as
                                logstore.segment.blob_checksum), algo, created, meta, tag (the
                                object as the store reported it: ETag on s3, device and inode
                                on file://)}
    _docs/<name>                small JSON documents (checkpoint registry, gaps)
    .<base>.tmp-<pid>-<hex>     file:// temporaries, never listed (abort_stale_uploads removes them)

What is promised:

- A segment is visible to :meth:`ColdTier.list_segments` only once its marker exists, and the
  marker is written only after the whole object is stored, so the listing is the index: a store
  rebuilds its state after a crash from one listing plus marker reads (no HEAD per object).
- No partial object is ever visible under a segment name (file: rename; s3: one PUT or a
  completed multipart upload). A crash mid-upload leaves at most an uncommitted object or an
  in-progress multipart upload / temp file, which a re-put overwrites and
  :meth:`ColdTier.abort_stale_uploads` reclaims (:meth:`ColdTier.remove_uncommitted` the objects).
- ``put_segment`` is idempotent: re-putting identical bytes under a committed name is a no-op.
- Of two uploaders of one name with different bytes (a stage thought dead and its replacement),
  at most one commits: the marker is written conditionally (``If-None-Match: *`` on s3, a hard
  link on file://) and both marker and object are read back. An object replaced after its
  commit is caught by :meth:`ColdTier.confirm_segment`, which says whether a committed copy is
  exactly given bytes (a writer drops its own copy only then); a re-put of the committed bytes
  repairs it.
  :meth:`ColdTier.fenced_writes` probes whether the store refuses a second conditional write
  (some S3-compatible stores ignore the header).
- Deletes remove the marker first, then the object; not-found counts as success.
- Backend errors are translated at this boundary (``raise ... from e``): unreachable / timeouts
  / 5xx / throttling -> :class:`ColdTierUnavailableError` (retryable, after a bounded number of
  short retries), refusals (403, 400, missing bucket...) -> :class:`ColdTierError`, a missing
  object -> :class:`RecordNotFoundError`. No call waits without a bound: connect and read
  timeouts are set on the client and retries stop at ``timeout_s``.
- Safe to share between threads, and usable after ``fork()`` (the s3fs client is re-created per
  process).

What is never done: reading or writing outside the tier root, listing an uncommitted segment,
rewriting a committed marker for other bytes, writing over a committed object with other bytes
once its marker was seen (two uploaders that both saw none race; the loser fails, and the
winner's :meth:`ColdTier.confirm_segment` says so if the loser's object landed last), loading a
whole source file into memory for a multipart upload, and (for ``read``) checking the marker
unless ``verify=True``.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import errno
import json
import logging
import os
import re
import secrets
import stat
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from logstore.errors import (
    ColdTierError,
    ColdTierUnavailableError,
    ConfigError,
    CorruptRecordError,
    InvalidNameError,
    RecordNotFoundError,
    SegmentClashError,
    StoreClosedError,
    StoreError,
    translate_os_error,
)
from logstore.keys import validate_name

__all__ = ["ColdTier", "SegmentInfo", "parse_cold_url", "MARKER_SUFFIX", "DOCS_PREFIX", "MIN_PART_SIZE"]

logger = logging.getLogger(__name__)

MiB = 2**20
MARKER_SUFFIX = ".commit"
DOCS_PREFIX = "_docs/"  # "_" cannot start a valid name component, so docs never collide with segments
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every multipart part but the last
MAX_PARTS = 10_000
_MARKER_VERSION = 1
_MAX_NAME_LEN = 768  # S3 keys are at most 1024 bytes, leave room for the root prefix
_TMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-\d+-[0-9a-f]+$")
_PREFIX_TAIL_RE = re.compile(r"^[A-Za-z0-9._-]*$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MARKER_READ_CONCURRENCY = 16
_PROBE_PREFIX = "_swiftlog-probe/"  # "_" starts no valid name: never a segment, a document or a listing of either
_NOT_FENCED_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})  # hard links refused


class _Exists(Exception):
    """An exclusive write found the key taken (internal: put_segment and the probe handle it)."""


Source = bytes | bytearray | memoryview | str | os.PathLike

T = TypeVar("T")


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


# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------
def _validate_path(name: object, what: str) -> str:
    """A ``/``-joined relative path whose every component is a valid name."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError(
            f"invalid {what} {name!r}", hint="give a non-empty relative path like 'run/act_0_1/seg-0'"
        )
    if len(name) > _MAX_NAME_LEN:
        raise InvalidNameError(f"invalid {what}: {len(name)} characters, at most {_MAX_NAME_LEN}")
    for part in name.split("/"):
        try:
            validate_name(part, "path component")
        except InvalidNameError as e:
            raise InvalidNameError(
                f"invalid {what} {name!r}: component {part!r} is not allowed "
                "(no empty components, no absolute paths, no '..')",
                hint=e.hint,
            ) from None
    return name


def _validate_segment_name(name: object) -> str:
    name = _validate_path(name, "segment name")
    if name.endswith(MARKER_SUFFIX):
        raise InvalidNameError(
            f"invalid segment name {name!r}: the suffix {MARKER_SUFFIX!r} is reserved for commit markers"
        )
    return name


def _validate_prefix(prefix: object) -> str:
    """A listing prefix: complete valid components, then an optional partial last component."""
    if not isinstance(prefix, str):
        raise InvalidNameError(f"invalid prefix {prefix!r}: must be a string")
    if prefix == "":
        return prefix
    head, sep, tail = prefix.rpartition("/")
    if sep:
        _validate_path(head, "prefix")  # also rejects a leading '/' (empty first component)
    if not _PREFIX_TAIL_RE.match(tail) or ".." in tail or (tail and not tail[0].isalnum()):
        raise InvalidNameError(f"invalid prefix {prefix!r}: last component {tail!r} is not allowed")
    return prefix


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------
class _Source:
    """Bytes in memory or a local file, read in parts (a file is never loaded whole)."""

    def __init__(self, source: Source) -> None:
        if isinstance(source, (bytes, bytearray, memoryview)):
            self.path: str | None = None
            self.buf: memoryview | None = memoryview(source).cast("B")
            self.size = self.buf.nbytes
        elif isinstance(source, (str, os.PathLike)):
            self.path = os.fspath(source)
            self.buf = None
            try:
                self.size = os.stat(self.path).st_size
            except OSError as e:
                raise translate_os_error(e, f"cannot read segment source {self.path!r}") from e
        else:
            raise TypeError(f"segment source must be bytes, memoryview or a file path, not {type(source).__name__}")

    def chunks(self, size: int) -> Iterator[memoryview | bytes]:
        """Consecutive chunks of at most ``size`` bytes (at least one chunk, maybe empty)."""
        if self.buf is not None:
            if self.size == 0:
                yield self.buf
            for off in range(0, self.size, size):
                yield self.buf[off : off + size]
            return
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                first = True
                while True:
                    data = f.read(size)
                    if not data and not first:
                        return
                    first = False
                    yield data
                    if len(data) < size:
                        return
        except OSError as e:
            raise translate_os_error(e, f"cannot read segment source {self.path!r}") from e

    def checksum(self) -> tuple[int, int]:
        h = xxhash.xxh3_64()
        n = 0
        for c in self.chunks(8 * MiB):
            h.update(c)
            n += len(c)
        return n, h.intdigest()


# ---------------------------------------------------------------------------------------------
# the tier
# ---------------------------------------------------------------------------------------------


def parse_cold_url(url: object) -> tuple[str, str, str]:
    """A cold tier URL as (scheme, where, prefix): ``("file", "/abs/dir", "")`` or ``("s3", bucket, prefix)``.

    A plain path is a ``file://`` directory. Raises ConfigError naming the URL for anything else:
    a scheme without ``://`` (``s3:/bucket``), a relative ``file://`` path, an invalid bucket or
    prefix, an unsupported scheme. Never touches the filesystem or the network.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"cold tier url {url!r} is not a non-empty string", hint="e.g. file:///data/cold or s3://bucket/prefix"
        )
    scheme, sep, rest = url.partition("://")
    if not sep:
        # "s3:/bucket", "file:/dir": a URL with a typo, not a directory named "s3:"
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", url):
            raise ConfigError(
                f"cold tier url {url!r} is not a URL (scheme without '://') nor a plain path",
                hint="write s3://bucket/prefix or file:///abs/dir",
            )
        scheme, rest = "file", os.path.abspath(url)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise ConfigError(f"cold tier url {url!r}: file:// needs an absolute path", hint="write file:///abs/dir")
        return "file", os.path.normpath(rest), ""
    if scheme in ("s3", "s3a"):
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET_RE.match(bucket):
            raise ConfigError(f"cold tier url {url!r}: {bucket!r} is not a valid bucket name")
        if prefix:
            try:
                _validate_path(prefix, "cold tier prefix")
            except InvalidNameError as e:
                raise ConfigError(f"cold tier url {url!r}: {e}") from None
        return "s3", bucket, prefix
    raise ConfigError(f"cold tier url {url!r}: scheme {scheme!r} not supported", hint="use file:// or s3://")


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
            self._backend: _Backend = _LocalBackend(where, part_size=part_size)
            self.url = "file://" + where
        else:
            self.url = f"s3://{where}/{prefix}" if prefix else f"s3://{where}"
            self._backend = _S3Backend(
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
        name = _validate_segment_name(name)
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, not {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(f"meta for segment {name!r} is not JSON-serialisable: {e}") from None
        src = _Source(source)
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
        self, name: str, src: _Source, meta: dict[str, Any], repair: SegmentInfo | None = None
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
            except _Exists:
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
        name = _validate_segment_name(name)
        info = self._read_marker(name)
        if info is None or (info.size, info.checksum) != _Source(source).checksum():
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
            except _Exists:
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
        prefix = _validate_prefix(prefix)
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
        return self._read_marker(_validate_segment_name(name))

    def read(self, name: str, *, verify: bool = False) -> bytes:
        """The whole object ``name``. Missing -> :class:`RecordNotFoundError`.

        With ``verify=True`` the marker must exist and the bytes must match its size and
        checksum (else :class:`RecordNotFoundError` / :class:`CorruptRecordError`).
        """
        self._check_open()
        name = _validate_segment_name(name)
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
        name = _validate_segment_name(name)
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
        name = _validate_segment_name(name)
        if not isinstance(start, int) or not isinstance(length, int) or length < 0:
            raise ValueError(f"read_range({name!r}, {start!r}, {length!r}): start must be an int, length an int >= 0")
        data = self._backend.get_range(name, start, length)
        if data is None:
            raise RecordNotFoundError(f"segment {name!r} not found in {self.url}", key=name)
        return data

    def delete_segment(self, name: str) -> None:
        """Remove the marker, then the object. Deleting what does not exist succeeds."""
        self._check_open()
        name = _validate_segment_name(name)
        with self._marker_lock:
            for k in [k for k in self._marker_cache if k[0] == name + MARKER_SUFFIX]:
                del self._marker_cache[k]
        self._backend.delete(name + MARKER_SUFFIX)
        self._backend.delete(name)

    # -- documents ------------------------------------------------------------------------
    def put_doc(self, name: str, obj: dict[str, Any]) -> None:
        """Store a small JSON document atomically (replacing any previous one)."""
        self._check_open()
        name = _validate_path(name, "document name")
        if not isinstance(obj, dict):
            raise TypeError(f"document {name!r} must be a dict, not {type(obj).__name__}")
        self._backend.put_bytes(DOCS_PREFIX + name, json.dumps(obj, sort_keys=True).encode())

    def get_doc(self, name: str) -> dict[str, Any] | None:
        """The document ``name``, or None if there is none. Undecodable -> CorruptRecordError."""
        self._check_open()
        name = _validate_path(name, "document name")
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
        prefix = _validate_prefix(prefix)
        n = len(DOCS_PREFIX)
        return sorted(k[n:] for k in self._backend.list(DOCS_PREFIX + prefix))

    def delete_doc(self, name: str) -> None:
        """Remove a document; a missing one is success."""
        self._check_open()
        name = _validate_path(name, "document name")
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
        prefix = _validate_prefix(prefix)
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
        prefix = _validate_prefix(prefix)
        cutoff = datetime.now(UTC) - older_than
        listing = {k: v for k, v in self._backend.list_modified(prefix).items() if not k.startswith(DOCS_PREFIX)}
        out: dict[str, int] = {}
        for name, (size, modified) in sorted(listing.items()):
            if name.endswith(MARKER_SUFFIX) or name + MARKER_SUFFIX in listing or modified > cutoff:
                continue
            try:
                _validate_segment_name(name)
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


# ---------------------------------------------------------------------------------------------
# backends: raw object operations on keys relative to the root; names are already validated
# ---------------------------------------------------------------------------------------------
class _Backend(abc.ABC):
    """Raw object operations of one storage kind; the two implementations below fill it in."""

    @abc.abstractmethod
    def put_stream(self, key: str, src: _Source) -> tuple[int, int, str | None]:
        """Store ``src`` atomically under ``key``; return (size, xxh3-64, tag of the object written)."""
        ...

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Store ``data`` atomically under ``key``; ``exclusive``: only if there is no object
        there (else :class:`_Exists`; a store that ignores the condition overwrites)."""
        ...

    @abc.abstractmethod
    def stat(self, key: str) -> tuple[int, str | None] | None:
        """(size, tag) of the object, or None if there is none."""
        ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    def get_many(self, keys: list[str]) -> dict[str, bytes | None]:
        return {k: self.get(k) for k in keys}

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, or None if there is no object."""
        ...

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes | None: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> dict[str, int]:
        """{key: size} of every object whose key starts with ``prefix`` (temporaries excluded)."""
        ...

    @abc.abstractmethod
    def list_modified(self, prefix: str) -> dict[str, tuple[int, datetime]]:
        """{key: (size, last written, UTC)} of every object whose key starts with ``prefix``
        (temporaries excluded)."""
        ...

    @abc.abstractmethod
    def modified(self, key: str) -> datetime | None:
        """When the object was last written (UTC), or None if there is no object."""
        ...

    @abc.abstractmethod
    def abort_stale(self, prefix: str, cutoff: datetime) -> list[str]: ...

    @abc.abstractmethod
    def health(self) -> None: ...

    def close(self) -> None:  # noqa: B027 (optional: a backend with nothing to release keeps it)
        pass

    def _after_part(self, key: str, part_number: int) -> None:  # noqa: B027 (a seam, empty on purpose)
        """Called after each part of a streamed upload is written: a seam for fault-injection
        tests (kill the process mid-upload). Does nothing."""


class _LocalBackend(_Backend):
    """file://: plain files under ``root``; atomic writes by temp file + fsync + rename + fsync dir."""

    def __init__(self, root: str, *, part_size: int) -> None:
        self.root = Path(root)
        self.part_size = part_size

    def _path(self, key: str) -> Path:
        return self.root / key

    def _what(self, op: str, key: str) -> str:
        return f"cold tier file://{self.root}: {op} {key!r}"

    def _makedirs(self, d: Path) -> None:
        # Create missing directories and fsync each parent, so a committed name survives power loss.
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            try:
                m.mkdir()
            except FileExistsError:
                pass
            _fsync_dir(m.parent)

    def _write_atomic(self, key: str, write: Callable[[Any], T], *, exclusive: bool = False) -> tuple[T, str]:
        """Write through a temporary file, then rename it over ``key`` (``exclusive``: hard-link it
        to ``key``, which fails if ``key`` exists: :class:`_Exists`). Returns what ``write``
        returned and the file's tag."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            self._makedirs(path.parent)
            with open(tmp, "wb") as f:
                result = write(f)
                f.flush()
                os.fsync(f.fileno())
                tag = _file_tag(os.fstat(f.fileno()))
            if exclusive and not self._link(tmp, path):
                _unlink_quiet(tmp)
                raise _Exists(key)
            if exclusive:
                _unlink_quiet(tmp)
            else:
                os.replace(tmp, path)
            _fsync_dir(path.parent)
            return result, tag
        except OSError as e:
            _unlink_quiet(tmp)
            raise _local_error(e, self._what("write", key), key=key) from e
        except BaseException:
            _unlink_quiet(tmp)
            raise

    @staticmethod
    def _link(tmp: Path, path: Path) -> bool:
        """Hard-link ``tmp`` to ``path``: False if ``path`` exists. A filesystem without hard links
        gets a plain rename (not fenced: ``fenced_writes`` finds that out)."""
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NOT_FENCED_ERRNOS:
                raise
            os.replace(tmp, path)
            return True

    def put_stream(self, key: str, src: _Source) -> tuple[int, int, str | None]:
        def write(f: Any) -> tuple[int, int]:
            h = xxhash.xxh3_64()
            n = 0
            for i, chunk in enumerate(src.chunks(self.part_size), 1):
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
                if src.size > self.part_size:
                    f.flush()
                    self._after_part(key, i)
            return n, h.intdigest()

        (size, checksum), tag = self._write_atomic(key, write)
        return size, checksum, tag

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        self._write_atomic(key, lambda f: f.write(data), exclusive=exclusive)

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("read", key), key=key) from e

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("stat", key), key=key) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def stat(self, key: str) -> tuple[int, str | None] | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("stat", key), key=key) from e
        return (st.st_size, _file_tag(st)) if stat.S_ISREG(st.st_mode) else None

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                pos = max(size + start, 0) if start < 0 else start
                if pos >= size or length == 0:
                    return b""
                f.seek(pos)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("read", key), key=key) from e

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise _local_error(e, self._what("delete", key), key=key) from e
        try:
            _fsync_dir(path.parent)
        except OSError as e:
            raise _local_error(e, self._what("delete", key), key=key) from e

    def _walk(self, prefix: str) -> Iterator[tuple[Path, str, bool]]:
        """(path, key, is_temp) of every file under the directory that holds ``prefix``."""
        head = prefix.rpartition("/")[0]
        base = self.root / head if head else self.root

        def unreadable(
            e: OSError,
        ) -> None:  # os.walk would skip a directory it cannot list: an unreadable cold tier read as empty
            if not isinstance(e, FileNotFoundError):
                raise e

        try:
            for dirpath, dirnames, filenames in os.walk(base, onerror=unreadable):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel_dir = os.path.relpath(dirpath, self.root)
                for fn in filenames:
                    key = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                    if fn.startswith("."):
                        if _TMP_RE.match(fn):
                            yield Path(dirpath) / fn, key, True
                        continue
                    if key.startswith(prefix):
                        yield Path(dirpath) / fn, key, False
        except OSError as e:  # a directory that cannot be listed (onerror), stat and friends
            raise _local_error(e, self._what("list", prefix)) from e

    def list(self, prefix: str) -> dict[str, int]:
        return {k: size for k, (size, _) in self.list_modified(prefix).items()}

    def list_modified(self, prefix: str) -> dict[str, tuple[int, datetime]]:
        out = {}
        for path, key, is_temp in self._walk(prefix):
            if is_temp:
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted while listing
            except OSError as e:
                raise _local_error(e, self._what("list", prefix), key=key) from e
            out[key] = (st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))
        return out

    def modified(self, key: str) -> datetime | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("stat", key), key=key) from e
        return datetime.fromtimestamp(st.st_mtime, UTC) if stat.S_ISREG(st.st_mode) else None

    def abort_stale(self, prefix: str, cutoff: datetime) -> list[str]:
        out = []
        limit = cutoff.timestamp()
        for path, key, is_temp in self._walk(prefix):
            if not is_temp:
                continue
            m = _TMP_RE.match(path.name)
            assert m is not None
            target = key.rpartition("/")[0]
            target = f"{target}/{m['base']}" if target else m["base"]
            if not target.startswith(prefix):
                continue
            try:
                if path.stat().st_mtime > limit:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _local_error(e, self._what("remove stale temporary", key), key=key) from e
            logger.info("cold tier file://%s: removed stale upload temporary %s", self.root, key)
            out.append(target)
        return out

    def health(self) -> None:
        try:
            self._makedirs(self.root)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.root))
        except OSError as e:
            raise ColdTierUnavailableError(
                f"cold tier file://{self.root} is not usable: {e}",
                hint="mount / create the directory and make it writable",
            ) from e


_UNAVAILABLE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.ENOTCONN,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EAGAIN,
    }
)


def _local_error(e: OSError, what: str, *, key: str | None = None) -> StoreError:
    """An OSError of the file:// tier as the same errors the s3 tier raises.

    Full disk and a failing (network) filesystem -> ColdTierUnavailableError (retryable, the
    records stay hot); anything else (permissions, read-only filesystem...) -> ColdTierError.
    """
    if e.errno in _UNAVAILABLE_ERRNOS:
        return ColdTierUnavailableError(
            f"{what}: {e.strerror or e}", key=key, hint="free space on / repair the cold tier's filesystem; retry later"
        )
    return ColdTierError(f"{what}: {e.strerror or e}", key=key, hint="check the cold tier directory's permissions")


def _utc(t: datetime) -> datetime:
    """``t`` with a time zone (S3 clients give UTC; a naive value is taken as UTC)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _file_tag(st: os.stat_result) -> str:
    """A file's identity as a tag: another write of the name (a rename over it) is another inode.
    Not the mtime: damage in place keeps the file, and its checksums are what catch that."""
    return f"{st.st_dev}-{st.st_ino}"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# S3
# ---------------------------------------------------------------------------------------------
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
        "OperationAborted",
        "XAmzContentSHA256Mismatch",
        "BadDigest",
        "ConditionalRequestConflict",  # two conditional writes of one key at once: retried, then one of them fails
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})


def _classify(e: BaseException) -> str:
    """'missing', 'transient' or 'fatal' for an exception raised by an aiobotocore call."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError  # throttling replies with invalid XML (s3fs #484)

    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {}) or {}
        code = str(err.get("Code", ""))
        status = (e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0
        if code in _MISSING_CODES or (status == 404 and code != "NoSuchBucket"):
            return "missing"
        if code == "PreconditionFailed" or status == 412:
            return "exists"  # a conditional write (If-None-Match: *) found the key taken
        if code in _TRANSIENT_CODES or status >= 500 or status in (408, 429):
            return "transient"
        return "fatal"
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.ParamValidationError)):
        return "fatal"
    if isinstance(
        e,
        (
            bx.EndpointConnectionError,
            bx.ConnectionClosedError,
            bx.HTTPClientError,
            bx.ConnectTimeoutError,
            bx.ReadTimeoutError,
            bx.ResponseStreamingError,
            bx.IncompleteReadError,
            ResponseParserError,
        ),
    ):
        return "transient"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return "transient"
    try:
        import aiohttp

        if isinstance(e, aiohttp.ClientError):
            return "transient"
    except ImportError:  # pragma: no cover - s3fs depends on aiohttp
        pass
    if isinstance(e, OSError):
        return "transient"
    if isinstance(e, bx.BotoCoreError):
        return "fatal"
    return "bug"


_session: list[Any] = [None, -1]  # [AioSession, pid]
_session_lock = threading.Lock()


def _shared_session() -> Any:
    """One aiobotocore session per process for every cold tier: each client still gets its own
    endpoint and credentials, but the service models are loaded once (~0.2 s of CPU per tier)."""
    with _session_lock:
        if _session[0] is None or _session[1] != os.getpid():
            import aiobotocore.session

            _session[0], _session[1] = aiobotocore.session.AioSession(), os.getpid()
        return _session[0]


# Fork safety. The parent's event loop (fsspec's IO loop) and its pooled aiohttp connections are
# copied into a forked child and share the kernel's epoll instance, self-pipe and sockets with the
# parent. Whatever the child does through them hits the parent: closing a pooled connection (aiohttp
# does so when a connector is garbage-collected) runs epoll_ctl(DEL) on the PARENT's epoll, whose
# next request on that connection then waits for its read timeout (seen with SeaweedFS keep-alive
# connections); loop.close() would even unregister the parent's self-pipe and wedge its loop. So in
# the child we only mark our copy of every loop a cold tier used as closed (no system call at all):
# asyncio's and aiohttp's clean-up paths then return early. The parent's clients are also kept
# referenced so that nothing of theirs is finalized while the child runs.
_loops_in_use: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_inherited_clients: list[Any] = []


def _after_fork_in_child() -> None:
    global _session_lock
    _session_lock = threading.Lock()  # a parent thread may have held it at fork() time
    for loop in list(_loops_in_use):
        try:
            loop._thread_id = None  # type: ignore[attr-defined]  # its thread did not survive fork()
            loop._closed = True  # type: ignore[attr-defined]  # NOT loop.close(): see above
        except Exception:  # noqa: BLE001 - never fail a fork
            pass
    _loops_in_use.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _S3Backend(_Backend):
    """s3://: objects under ``bucket``/``prefix`` through s3fs's aiobotocore client."""

    def __init__(
        self,
        url: str,
        bucket: str,
        prefix: str,
        storage_options: dict[str, Any],
        *,
        part_size: int,
        multipart_threshold: int,
        retries: int,
        timeout_s: float,
    ) -> None:
        self.url = url
        self.bucket = bucket
        self.root = prefix + "/" if prefix else ""
        self.part_size = part_size
        self.threshold = multipart_threshold
        self.retries = retries
        self.timeout_s = timeout_s
        opts = dict(storage_options)
        opts["skip_instance_cache"] = True
        opts["use_listings_cache"] = False
        config = {
            "connect_timeout": min(2.0, timeout_s),  # a dead endpoint fails in seconds, not minutes
            "read_timeout": timeout_s,
            "retries": {"total_max_attempts": 1, "mode": "standard"},
        }
        config.update(opts.get("config_kwargs") or {})
        opts["config_kwargs"] = config
        client_kwargs = dict(opts.get("client_kwargs") or {})
        if not opts.get("region_name") and not client_kwargs.get("region_name"):
            client_kwargs["region_name"] = "us-east-1"
        opts["client_kwargs"] = client_kwargs
        self.endpoint = client_kwargs.get("endpoint_url") or opts.get("endpoint_url") or "AWS S3"
        self._opts = opts
        self._fs: Any = None
        self._pid = -1
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------
    def _get_fs(self) -> Any:
        # s3fs instances are bound to the event loop of the process that made them; a forked
        # child makes its own (and must not close the parent's).
        if self._pid != os.getpid():
            # A lock some parent thread held at fork() time would never be released in this child.
            self._lock = threading.Lock()
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                import s3fs

                if self._fs is not None:
                    _inherited_clients.append(self._fs)  # a parent's client: never close it here
                opts = dict(self._opts)
                if "session" not in opts and "profile" not in opts:
                    opts["session"] = _shared_session()
                fs = s3fs.S3FileSystem(**opts)
                fs.retries = 1  # s3fs's own retry loop off: _call retries with our classification
                _loops_in_use.add(fs.loop)
                self._fs, self._pid = fs, os.getpid()
            return self._fs

    def _key(self, key: str) -> str:
        return self.root + key

    def _rel(self, full: str) -> str:
        return full[len(self.root) :]

    def _run(self, coro_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        from fsspec.asyn import sync

        fs = self._get_fs()
        return sync(fs.loop, coro_fn, fs, *args)

    async def _call(self, fs: Any, op: str, key: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``fn(client)`` with bounded retries of transient failures; translate errors."""
        try:
            client = await fs.set_session()  # no network I/O: builds the client once per process
        except Exception as e:  # noqa: BLE001 - a configuration the client library refuses
            raise ColdTierError(
                f"cannot create an S3 client for {self.url}: {type(e).__name__}: {e}",
                key=key or None,
                hint="check the cold tier storage options",
            ) from e
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        delay = 0.05
        attempt = 0
        while True:
            try:
                return await fn(client)
            except Exception as e:  # noqa: BLE001 - classified and re-raised below
                kind = _classify(e)
                if kind == "transient" and attempt < self.retries and loop.time() + delay < deadline:
                    attempt += 1
                    logger.debug("cold %s %s: transient %r, retry %d in %.2fs", op, key, e, attempt, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise self._translate(e, kind, op, key, attempt + 1) from e

    def _translate(self, e: BaseException, kind: str, op: str, key: str, attempts: int) -> BaseException:
        where = f"{self.url} (endpoint {self.endpoint})"
        op = f"{op} {key!r}" if key else op
        if kind == "exists":
            return _Exists(key)
        if kind == "missing":
            return RecordNotFoundError(f"{op}: not found in {where}", key=key)
        if kind == "transient":
            return ColdTierUnavailableError(
                f"{op} on {where} failed after {attempts} attempt(s): {type(e).__name__}: {e}",
                key=key,
                hint="the object store is unreachable or failing; retry later (records stay in the hot tier)",
            )
        if kind == "fatal":
            return ColdTierError(
                f"{op} refused by {where}: {type(e).__name__}: {e}",
                key=key,
                hint="check the bucket, credentials and permissions in the cold tier storage options",
            )
        return StoreError(f"{op} on {where}: unexpected {type(e).__name__}: {e}", key=key)

    # -- operations -----------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        self._put_object(key, data, exclusive)

    def _put_object(self, key: str, data: bytes, exclusive: bool = False) -> str | None:
        """One PUT; its ETag. ``exclusive``: If-None-Match: * (:class:`_Exists` when refused, also when
        the refusal reaches us as another error, e.g. a connection closed, and the key is taken)."""
        full = self._key(key)
        kw: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}

        async def go(fs: Any) -> str | None:
            r = await self._call(fs, "put", key, lambda c: c.put_object(Bucket=self.bucket, Key=full, Body=data, **kw))
            return r.get("ETag")

        try:
            return self._run(go)
        except StoreError:
            if exclusive and self.stat(key) is not None:
                raise _Exists(key) from None
            raise

    def put_stream(self, key: str, src: _Source) -> tuple[int, int, str | None]:
        if src.size <= self.threshold:
            h = xxhash.xxh3_64()
            data = b"".join(bytes(c) for c in src.chunks(max(src.size, 1)))
            h.update(data)
            tag = self._put_object(key, data)
            return len(data), h.intdigest(), tag
        return self._put_multipart(key, src)

    def _put_multipart(self, key: str, src: _Source) -> tuple[int, int, str | None]:
        full = self._key(key)
        part_size = max(self.part_size, -(-src.size // MAX_PARTS))

        async def create(fs: Any) -> str:
            r = await self._call(
                fs, "create_multipart_upload", key, lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=full)
            )
            return r["UploadId"]

        async def upload(fs: Any, upload_id: str, number: int, body: bytes) -> str:
            r = await self._call(
                fs,
                f"upload_part {number}",
                key,
                lambda c: c.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body),
            )
            return r["ETag"]

        async def complete(fs: Any, upload_id: str, parts: list[dict[str, Any]]) -> str | None:
            r = await self._call(
                fs,
                "complete_multipart_upload",
                key,
                lambda c: c.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
            return r.get("ETag")

        async def abort(fs: Any, upload_id: str) -> None:
            client = await fs.set_session()
            await client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

        upload_id = self._run(create)
        h = xxhash.xxh3_64()
        n = 0
        parts: list[dict[str, Any]] = []
        try:
            # Parts are read here, in the caller's thread, one at a time: memory stays at one part.
            for number, chunk in enumerate(src.chunks(part_size), 1):
                h.update(chunk)
                n += len(chunk)
                etag = self._run(upload, upload_id, number, bytes(chunk))
                parts.append({"ETag": etag, "PartNumber": number})
                self._after_part(key, number)
            tag = self._run(complete, upload_id, parts)
        except BaseException:
            try:
                self._run(abort, upload_id)
            except Exception as e:  # noqa: BLE001 - best effort; abort_stale_uploads reclaims it
                logger.warning("cold tier %s: could not abort upload %s of %s: %r", self.url, upload_id, key, e)
            raise
        return n, h.intdigest(), tag

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[key]

    def get_many(self, keys: list[str]) -> dict[str, bytes | None]:
        async def go(fs: Any) -> dict[str, bytes | None]:
            sem = asyncio.Semaphore(_MARKER_READ_CONCURRENCY)

            async def one(k: str) -> tuple[str, bytes | None]:
                async def fetch(c: Any) -> bytes:
                    r = await c.get_object(Bucket=self.bucket, Key=self._key(k))
                    async with r["Body"] as body:
                        return await body.read()

                async with sem:
                    try:
                        return k, await self._call(fs, "get", k, fetch)
                    except RecordNotFoundError:
                        return k, None

            return dict(await asyncio.gather(*(one(k) for k in keys)))

        return self._run(go) if keys else {}

    def size(self, key: str) -> int | None:
        st = self.stat(key)
        return None if st is None else st[0]

    def stat(self, key: str) -> tuple[int, str | None] | None:
        full = self._key(key)

        async def go(fs: Any) -> tuple[int, str | None] | None:
            try:
                r = await self._call(fs, "head", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
            except RecordNotFoundError:
                return None
            return int(r["ContentLength"]), r.get("ETag")

        return self._run(go)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        full = self._key(key)
        if length == 0:

            async def head(fs: Any) -> bytes | None:
                try:
                    await self._call(fs, "head", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
                except RecordNotFoundError:
                    return None
                return b""

            return self._run(head)
        rng = f"bytes={start}-{start + length - 1}" if start >= 0 else f"bytes={start}"

        async def fetch(c: Any) -> bytes:
            from botocore.exceptions import ClientError

            try:
                r = await c.get_object(Bucket=self.bucket, Key=full, Range=rng)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":
                    return b""  # start at or past the end (or an empty object)
                raise
            async with r["Body"] as body:
                return await body.read()

        async def go(fs: Any) -> bytes | None:
            try:
                return await self._call(fs, "read_range", key, fetch)
            except RecordNotFoundError:
                return None

        data = self._run(go)
        if data is not None and start < 0:
            data = data[:length]  # a suffix range returns up to -start bytes
        return data

    def delete(self, key: str) -> None:
        full = self._key(key)

        async def go(fs: Any) -> None:
            try:
                await self._call(fs, "delete", key, lambda c: c.delete_object(Bucket=self.bucket, Key=full))
            except RecordNotFoundError:
                pass

        self._run(go)

    def list(self, prefix: str) -> dict[str, int]:
        return {k: size for k, (size, _) in self.list_modified(prefix).items()}

    def modified(self, key: str) -> datetime | None:
        full = self._key(key)

        async def go(fs: Any) -> datetime | None:
            try:
                r = await self._call(fs, "head", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
            except RecordNotFoundError:
                return None
            return _utc(r["LastModified"])

        return self._run(go)

    def list_modified(self, prefix: str) -> dict[str, tuple[int, datetime]]:
        full = self._key(prefix)

        async def go(fs: Any) -> dict[str, tuple[int, datetime]]:
            out: dict[str, tuple[int, datetime]] = {}
            token = None
            while True:
                kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
                if token:
                    kw["ContinuationToken"] = token
                page = await self._call(fs, "list", prefix, lambda c, kw=kw: c.list_objects_v2(**kw))
                for obj in page.get("Contents", []) or []:
                    k = obj["Key"]
                    if k.endswith("/"):
                        continue  # directory placeholders some servers keep
                    t = obj.get("LastModified")
                    t = _utc(t) if isinstance(t, datetime) else datetime.now(UTC)  # (left out: never stale)
                    out[self._rel(k)] = (int(obj.get("Size", 0)), t)
                if not page.get("IsTruncated"):
                    return out
                token = page.get("NextContinuationToken")
                if not token:
                    return out

        return self._run(go)

    def abort_stale(self, prefix: str, cutoff: datetime) -> list[str]:
        full = self._key(prefix)

        async def go(fs: Any) -> list[str]:
            stale: list[tuple[str, str]] = []
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            while True:
                page = await self._call(fs, "list_multipart_uploads", prefix, lambda c: c.list_multipart_uploads(**kw))
                for up in page.get("Uploads", []) or []:
                    initiated = up.get("Initiated")
                    if isinstance(initiated, datetime):
                        if initiated.tzinfo is None:
                            initiated = initiated.replace(tzinfo=UTC)
                        if initiated > cutoff:
                            continue
                    stale.append((up["Key"], up["UploadId"]))  # initiated before the cutoff
                if not page.get("IsTruncated"):
                    break
                kw["KeyMarker"] = page.get("NextKeyMarker")
                kw["UploadIdMarker"] = page.get("NextUploadIdMarker")
                if not kw["KeyMarker"]:
                    break
            out = []
            for k, uid in stale:
                rel = self._rel(k)
                try:
                    if await self._last_part_time(fs, k, uid, rel) > cutoff:
                        continue  # parts still arriving: a long upload, not an abandoned one
                    await self._call(
                        fs,
                        "abort_multipart_upload",
                        rel,
                        lambda c, k=k, uid=uid: c.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid),
                    )
                except RecordNotFoundError:
                    continue  # completed or aborted meanwhile
                logger.info("cold tier %s: aborted stale multipart upload %s of %s", self.url, uid, rel)
                out.append(rel)
            return out

        return self._run(go)

    async def _last_part_time(self, fs: Any, full: str, upload_id: str, rel: str) -> datetime:
        """When the upload last received a part (datetime.min if none)."""
        latest = datetime.min.replace(tzinfo=UTC)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id}
        while True:
            page = await self._call(fs, "list_parts", rel, lambda c, kw=kw: c.list_parts(**kw))
            for part in page.get("Parts", []) or []:
                t = part.get("LastModified")
                if isinstance(t, datetime):
                    latest = max(latest, t if t.tzinfo else t.replace(tzinfo=UTC))
            marker = page.get("NextPartNumberMarker")
            if not page.get("IsTruncated") or not marker:
                return latest
            kw["PartNumberMarker"] = marker

    def health(self) -> None:
        async def go(fs: Any) -> None:
            try:
                await self._call(fs, "head_bucket", "", lambda c: c.head_bucket(Bucket=self.bucket))
            except RecordNotFoundError as e:
                raise ColdTierError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint}",
                    hint="create the bucket or fix the cold tier url",
                ) from e

        self._run(go)

    def close(self) -> None:
        with self._lock:
            fs, self._fs = self._fs, None
            if fs is None or self._pid != os.getpid():
                return
        creator = getattr(fs, "_s3creator", None)
        if creator is not None and getattr(fs, "_s3", None) is not None:
            try:
                type(fs).close_session(fs.loop, creator)
            except Exception as e:  # noqa: BLE001 - closing is best effort
                logger.debug("cold tier %s: closing the s3 session failed: %r", self.url, e)
