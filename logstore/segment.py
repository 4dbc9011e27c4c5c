"""Segment files: the unit of storage shared by the hot tier (local file) and the cold tier (object).

A segment holds the records of ONE channel over a contiguous iteration range, appended in
arrival order. While open it lives only in the hot tier; sealing appends an index footer, and
the sealed file is uploaded byte-for-byte as an immutable cold object, so an offset recorded by
the hot index is valid in the cold object too.

Layout (all integers big-endian)::

    file header   MAGIC (8 bytes) | version u32 | reserved u32                       16 bytes
    frame         b"SWRF" | key (19) | blob_len u64 | blob_xxh3 u64 | hdr_crc u32       43 bytes
                  blob (blob_len bytes: a logstore.codec tensor record)
    ...           more frames
    footer index  n x (key (19) | offset u64 | length u64 | xxh3 u64)                  43 bytes each
    trailer       index_offset u64 | n u64 | index_xxh3 u64 | END_MAGIC (8)            32 bytes

``hdr_crc`` (zlib.crc32 of the frame header fields) detects a torn or corrupt frame header;
``blob_xxh3`` detects corrupt record bytes without decoding them. ``offset`` in the index is
the blob's offset. A key may appear twice (a re-sent record): the later frame wins.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import xxhash

from logstore.errors import CodecError, CorruptRecordError, SwiftlogError
from logstore.keys import KEY_SIZE, RecordKey

__all__ = [
    "FILE_HEADER",
    "FILE_HEADER_SIZE",
    "FRAME_HEADER_SIZE",
    "TRAILER_SIZE",
    "IndexEntry",
    "blob_checksum",
    "check_frame_header",
    "encode_frame_header",
    "scan_frames",
    "build_footer",
    "parse_trailer",
    "parse_index",
    "read_footer",
    "INDEX_ENTRY_SIZE",
]

MAGIC = b"SWLSEG\x00\x01"
VERSION = 1
FILE_HEADER = MAGIC + struct.pack(">II", VERSION, 0)
FILE_HEADER_SIZE = len(FILE_HEADER)

_FRAME = struct.Struct(">4s19sQQ")
_FRAME_CRC = struct.Struct(">I")
FRAME_MAGIC = b"SWRF"
FRAME_HEADER_SIZE = _FRAME.size + _FRAME_CRC.size  # 43

_ENTRY = struct.Struct(">19sQQQ")
INDEX_ENTRY_SIZE = _ENTRY.size  # 43
_TRAILER = struct.Struct(">QQQ8s")
END_MAGIC = b"SWLEND01"
TRAILER_SIZE = _TRAILER.size  # 32


def blob_checksum(blob: bytes | memoryview) -> int:
    """xxh3-64 of the stored record bytes (what frames and indexes carry)."""
    return xxhash.xxh3_64_intdigest(blob)


class BlobStream:
    """One stored record, read in chunks and verified on the way (what a download streams).

    Iterating yields the record's bytes in order. The checksum (``checksum``, known from the
    index before any byte is read) is computed over the chunks as they are read, and the last
    chunk is held back until it matches: a consumer that sees the iteration end normally has had
    every byte of an intact record; on a mismatch or a short read it gets CorruptRecordError
    instead of the last chunk, so a corrupt record is never delivered whole. ``head`` is the first
    chunk (already read: enough for the codec header). Never holds more than two chunks in memory.
    A stream over a map of the file (:meth:`of_view`) yields read-only views of the map instead of
    ``bytes``: nothing is copied, nothing is held but page cache.
    """

    def __init__(
        self,
        key: RecordKey,
        length: int,
        checksum: int,
        head: bytes | memoryview,
        rest: Iterator[bytes | memoryview],
        close: Callable[[], None] | None = None,
    ) -> None:
        self.key, self.length, self.checksum, self.head = key, length, checksum, head
        self._rest = rest
        self._close = close

    @classmethod
    def of_bytes(cls, key: RecordKey, blob: bytes, chunk_size: int) -> BlobStream:
        """A stream over a blob already read and verified."""
        mv = memoryview(blob)
        return cls(
            key,
            len(blob),
            blob_checksum(blob),
            bytes(mv[:chunk_size]),
            (bytes(mv[o : o + chunk_size]) for o in range(chunk_size, len(blob), chunk_size)),
        )

    @classmethod
    def of_file(
        cls, key: RecordKey, fd: int, offset: int, length: int, checksum: int, chunk_size: int, where: str
    ) -> BlobStream:
        """A stream over ``length`` bytes at ``offset`` of the open file ``fd`` (closed at the end)."""
        closed = False

        def release() -> None:
            nonlocal closed
            if not closed:
                closed = True
                _close_quietly(fd)

        try:
            first = os.pread(fd, min(chunk_size, length), offset)
        except BaseException:
            release()
            raise
        h = xxhash.xxh3_64()
        h.update(first)

        def rest() -> Iterator[bytes]:
            got, held = len(first), b""
            try:
                while got < length:
                    chunk = os.pread(fd, min(chunk_size, length - got), offset + got)
                    if not chunk:
                        break
                    h.update(chunk)
                    got += len(chunk)
                    if held:
                        yield held
                    held = chunk
                if got != length or h.intdigest() != checksum:
                    raise CorruptRecordError(f"corrupt record {key} in {where}: checksum mismatch", key=key)
                if held:
                    yield held
            finally:
                release()

        if len(first) < min(chunk_size, length):  # the file ends inside the record
            release()
            raise CorruptRecordError(
                f"corrupt record {key} in {where}: truncated ({len(first)} of {length} bytes)", key=key
            )
        if len(first) == length and h.intdigest() != checksum:
            release()
            raise CorruptRecordError(f"corrupt record {key} in {where}: checksum mismatch", key=key)
        return cls(key, length, checksum, first, rest(), close=release)

    @classmethod
    def of_view(cls, key: RecordKey, view: memoryview, checksum: int, chunk_size: int, where: str) -> BlobStream:
        """A stream over ``view`` (a map's pages) in chunks of ``chunk_size``. A one-chunk record is
        checked at once; otherwise each chunk after ``head`` is hashed just before it is handed out,
        and the last one only once the whole record matched."""
        length = len(view)
        head = view[:chunk_size]
        if len(head) == length:
            if blob_checksum(head) != checksum:
                raise CorruptRecordError(f"corrupt record {key} in {where}: checksum mismatch", key=key)
            return cls(key, length, checksum, head, iter(()))

        def rest() -> Iterator[memoryview]:
            h = xxhash.xxh3_64(head)
            for o in range(chunk_size, length, chunk_size):
                chunk = view[o : o + chunk_size]
                h.update(chunk)
                if o + chunk_size >= length and h.intdigest() != checksum:  # the last chunk only once all matched
                    raise CorruptRecordError(f"corrupt record {key} in {where}: checksum mismatch", key=key)
                yield chunk

        return cls(key, length, checksum, head, rest())

    def __iter__(self) -> Iterator[bytes | memoryview]:
        yield self.head
        yield from self._rest

    def close(self) -> None:
        """Release the file (also done when the iteration ends). Idempotent."""
        close = getattr(self._rest, "close", None)
        if close is not None:
            close()  # a started generator runs its finally
        if self._close is not None:
            self._close()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where one record's blob sits inside a segment."""

    key: RecordKey
    offset: int
    length: int
    checksum: int


def encode_frame_header(key_bytes: bytes, blob_len: int, checksum: int) -> bytes:
    head = _FRAME.pack(FRAME_MAGIC, key_bytes, blob_len, checksum)
    return head + _FRAME_CRC.pack(zlib.crc32(head))


def check_frame_header(buf: bytes, key: RecordKey, length: int, checksum: int, where: str) -> None:
    """Raise CorruptRecordError unless ``buf``, the FRAME_HEADER_SIZE bytes before a blob, is an
    intact frame header (magic, CRC) for ``key`` with that blob length and checksum: an index entry
    whose key or location was damaged would otherwise serve another record's intact bytes."""
    if len(buf) != FRAME_HEADER_SIZE:
        raise CorruptRecordError(f"record {key} in {where}: its frame header is cut short ({len(buf)} bytes)", key=key)
    try:
        key_bytes, blob_len, cs = _decode_frame_header(buf, where)
    except CorruptRecordError:
        raise CorruptRecordError(
            f"record {key} in {where}: no intact frame header before it (a damaged index entry or file)", key=key
        ) from None
    if key_bytes != key.encode():
        try:
            held = str(RecordKey.decode(key_bytes))
        except SwiftlogError:
            held = f"undecodable key bytes {key_bytes.hex()}"
        raise CorruptRecordError(
            f"record {key} in {where}: the index names it, but the frame there holds {held} (a damaged index key)",
            key=key,
        )
    if blob_len != length or cs != checksum:
        raise CorruptRecordError(
            f"record {key} in {where}: the index entry ({length} bytes, checksum {checksum:#x}) "
            f"does not match its frame ({blob_len} bytes, checksum {cs:#x}): a damaged index "
            "entry",
            key=key,
        )


def _decode_frame_header(buf: bytes, where: str) -> tuple[bytes, int, int]:
    head, (crc,) = buf[: _FRAME.size], _FRAME_CRC.unpack(buf[_FRAME.size : FRAME_HEADER_SIZE])
    magic, key_bytes, blob_len, checksum = _FRAME.unpack(head)
    if magic != FRAME_MAGIC or zlib.crc32(head) != crc:
        raise CorruptRecordError(f"corrupt frame header at {where}", key=where)
    return key_bytes, blob_len, checksum


def scan_frames(fd: int, end: int | None = None) -> Iterator[IndexEntry]:
    """Yield the frames of a segment file open as ``fd``, in file order, reading headers only.

    Stops at ``end`` (exclusive; default: the file size; never past the file size: an index may
    say more than a file kept after a power loss). A header cut short by that end is not a frame;
    a corrupt header, or a blob running past the end, is raised as CorruptRecordError (a torn
    frame's key, when its header is intact, is in the error's ``context["torn"]``). Never reads
    blob bytes.
    """
    size = os.fstat(fd).st_size
    if end is not None:
        size = min(size, end)
    head = os.pread(fd, FILE_HEADER_SIZE, 0)
    if head[:8] != MAGIC:
        raise CodecError("not a swiftlog segment file (bad magic)")
    pos = FILE_HEADER_SIZE
    while pos + FRAME_HEADER_SIZE <= size:
        buf = os.pread(fd, FRAME_HEADER_SIZE, pos)
        if buf[:4] == END_MAGIC[:4] or buf[:4] != FRAME_MAGIC:
            # start of the footer of a sealed segment
            break
        key_bytes, blob_len, checksum = _decode_frame_header(buf, f"offset {pos}")
        off = pos + FRAME_HEADER_SIZE
        if off + blob_len > size:
            raise CorruptRecordError(
                f"torn frame at offset {pos}: blob runs past end {size}",
                key=f"offset {pos}",
                torn=RecordKey.decode(key_bytes),
            )
        yield IndexEntry(RecordKey.decode(key_bytes), off, blob_len, checksum)
        pos = off + blob_len


def build_footer(entries: list[IndexEntry], index_offset: int) -> bytes:
    """Index + trailer to append at ``index_offset`` when sealing a segment."""
    index = b"".join(_ENTRY.pack(e.key.encode(), e.offset, e.length, e.checksum) for e in entries)
    trailer = _TRAILER.pack(index_offset, len(entries), xxhash.xxh3_64_intdigest(index), END_MAGIC)
    return index + trailer


def parse_trailer(trailer: bytes, where: str, size: int | None = None) -> tuple[int, int, int]:
    """(index_offset, n_entries, index_checksum) from a sealed segment's last TRAILER_SIZE bytes.
    With the segment's ``size``, the index must end where the trailer begins (a damaged trailer
    would otherwise ask its reader for any number of bytes). Raises CorruptRecordError."""
    if len(trailer) != TRAILER_SIZE:
        raise CorruptRecordError(f"segment {where}: short trailer ({len(trailer)} bytes)", key=where)
    index_offset, n, csum, magic = _TRAILER.unpack(trailer)
    if magic != END_MAGIC:
        raise CorruptRecordError(f"segment {where}: bad trailer magic (not sealed or corrupt)", key=where)
    if size is not None and index_offset + n * INDEX_ENTRY_SIZE + TRAILER_SIZE != size:
        raise CorruptRecordError(
            f"segment {where}: damaged trailer (an index of {n} entries at offset {index_offset} does not end where "
            f"the trailer of the {size}-byte object begins)",
            key=where,
        )
    return index_offset, n, csum


def read_footer(fd: int, size: int, where: str) -> tuple[int, list[IndexEntry]]:
    """(index_offset, entries) of the sealed segment file open as ``fd`` of ``size`` bytes, from its
    footer (checked as :func:`parse_trailer` and :func:`parse_index` do). Raises CorruptRecordError."""
    index_offset, n, csum = parse_trailer(os.pread(fd, TRAILER_SIZE, max(0, size - TRAILER_SIZE)), where, size)
    return index_offset, parse_index(os.pread(fd, n * INDEX_ENTRY_SIZE, index_offset), n, csum, where)


def parse_index(index: bytes, n: int, checksum: int, where: str) -> list[IndexEntry]:
    """Decode a footer index, verifying its checksum. Raises CorruptRecordError naming ``where``."""
    if len(index) != n * _ENTRY.size or xxhash.xxh3_64_intdigest(index) != checksum:
        raise CorruptRecordError(f"segment {where}: index checksum mismatch", key=where)
    out = []
    for i in range(n):
        kb, off, ln, cs = _ENTRY.unpack_from(index, i * _ENTRY.size)
        out.append(IndexEntry(RecordKey.decode(kb), off, ln, cs))
    return out


assert KEY_SIZE == 19
