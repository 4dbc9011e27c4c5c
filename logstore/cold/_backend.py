"""The backend contract: raw object operations that :class:`~logstore.cold.ColdTier` needs from
one storage kind, and the source a segment is read from.

Keys given to a backend are relative to the tier root and already validated. Each backend
translates its own errors into :mod:`logstore.errors` (``raise ... from e``).

Never: loads a whole source file into memory.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator
from datetime import datetime

import xxhash

from logstore.errors import translate_os_error

__all__ = ["MiB", "Source", "SourceReader", "Backend"]

MiB = 2**20

Source = bytes | bytearray | memoryview | str | os.PathLike


class SourceReader:
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


class Backend(abc.ABC):
    """Raw object operations of one storage kind; ``FileBackend`` (``_file``) and ``S3Backend`` (``_s3``) fill it in."""

    @abc.abstractmethod
    def put_stream(self, key: str, src: SourceReader) -> tuple[int, int, str | None]:
        """Store ``src`` atomically under ``key``; return (size, xxh3-64, tag of the object written)."""
        ...

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Store ``data`` atomically under ``key``; ``exclusive``: only if there is no object
        there (else :class:`ObjectExistsError`; a store that ignores the condition overwrites)."""
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
