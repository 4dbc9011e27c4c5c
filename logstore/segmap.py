"""Read-only maps of sealed segment files, shared by the record downloads of one process.

Mapping a record's pages and unmapping them again costs about as much as copying its bytes. A
server that sends many records of a few segment files maps each file once and sends from the map,
so that no byte is copied on the way to a socket. :func:`install` turns the maps on for the
process (``swiftlog serve`` does). Without them, and for every file they refuse, the hot tier
reads with ``pread``.

A page of a map past the end of its file raises SIGBUS on access, which kills the process. So:

1. Only a sealed segment is mapped. Its writer appended the footer and cut the file to its final
   size before the index called it sealed, and no part of swiftlog truncates a sealed file again:
   crash recovery cuts only open segments, GC and eviction delete whole files.
2. A file is mapped only when its size, read under the maps' lock right before mapping, is the
   size the index gives the sealed segment (``SegmentMeta.file_size``), and only up to that size.
   A file of another size (cut short by a power loss, replaced) is refused: the caller reads it
   with ``pread``, where a short file is a short read and an error, never a signal.
3. A deleted file's map stays valid: the kernel keeps its pages while they are mapped. The maps of
   deleted files are dropped within a second, so GC and eviction still free the disk space.
4. A map is dropped when it was not used for ``idle`` seconds, when its file was deleted, and
   beyond ``max_maps`` (the least recently used first). A thread looks at the maps every second
   while any is kept. A dropped map whose pages are still being sent (a view of it is alive) goes
   with its last view.

Never: writes to a file, maps a file of a size other than the one it was told, or maps past the
end of one.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["SegmentMaps", "install", "installed", "uninstall"]

logger = logging.getLogger(__name__)

_SWEEP_EVERY = 1.0  # seconds between the thread's looks at the maps, at most


@dataclass(slots=True)
class _Map:
    fd: int  # the map's own descriptor: tells whether the file was deleted
    mm: mmap.mmap
    size: int
    used: float


class SegmentMaps:
    """Maps of sealed segment files by identity (device, inode). Thread-safe.

    ``idle``: seconds an unused map is kept. ``max_maps``: maps kept at most.
    """

    def __init__(self, idle: float = 2.0, max_maps: int = 16) -> None:
        if idle <= 0 or max_maps < 1:
            raise ValueError(f"idle must be > 0 and max_maps >= 1 (got {idle}, {max_maps})")
        self.idle, self.max_maps = idle, max_maps
        self._maps: OrderedDict[tuple[int, int], _Map] = OrderedDict()
        self._cond = threading.Condition()
        self._sweeper: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._maps)

    def view(self, fd: int, offset: int, length: int, file_size: int) -> memoryview | None:
        """A read-only view of ``length`` bytes at ``offset`` of the sealed file open as ``fd``, or
        None when the file is not ``file_size`` bytes long or the bytes are not inside it (the caller
        reads with ``pread`` then). ``fd`` stays the caller's: a new map keeps a duplicate. Raises
        OSError when the file cannot be mapped."""
        if offset < 0 or length < 0 or offset + length > file_size:
            return None
        with self._cond:
            if self._closed:
                return None
            st = os.fstat(fd)  # under the lock: no map is made of a size read before another was dropped
            if st.st_size != file_size:
                return None
            if length == 0:
                return memoryview(b"")
            ident = (st.st_dev, st.st_ino)
            m = self._maps.get(ident)
            if m is None or m.size != file_size:
                if m is not None:
                    self._drop(ident)
                m = self._map(fd, file_size)
                self._maps[ident] = m
                while len(self._maps) > self.max_maps:
                    self._drop(next(iter(self._maps)))
                self._start_sweeper()
            m.used = time.monotonic()
            self._maps.move_to_end(ident)
            return memoryview(m.mm)[offset : offset + length]

    @staticmethod
    def _map(fd: int, size: int) -> _Map:
        own = os.dup(fd)
        try:
            mm = mmap.mmap(own, size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(own)
            raise
        return _Map(own, mm, size, 0.0)

    def close(self) -> None:
        """Drop every map and stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            for ident in list(self._maps):
                self._drop(ident)
            self._cond.notify_all()

    def _drop(self, ident: tuple[int, int]) -> None:
        m = self._maps.pop(ident)
        try:
            m.mm.close()
        except BufferError:  # a view is still being sent: the map goes with the last one
            pass
        _close_quietly(m.fd)

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="swiftlog-segment-maps", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
        """Drop idle maps and maps of deleted files until none is left."""
        with self._cond:
            while self._maps and not self._closed:
                self._cond.wait(min(self.idle / 2, _SWEEP_EVERY))
                now = time.monotonic()
                for ident in [i for i, m in self._maps.items() if now - m.used >= self.idle or _deleted(m.fd)]:
                    self._drop(ident)
            self._sweeper = None


def _deleted(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_installed: SegmentMaps | None = None
_install_lock = threading.Lock()


def install(idle: float = 2.0, max_maps: int = 16) -> SegmentMaps:
    """Turn the maps on for this process (replacing maps installed before) and return them."""
    global _installed
    maps = SegmentMaps(idle, max_maps)
    with _install_lock:
        old, _installed = _installed, maps
    if old is not None:
        old.close()
    return maps


def installed() -> SegmentMaps | None:
    """The maps of this process, if :func:`install` turned them on."""
    return _installed


def uninstall() -> None:
    """Turn the maps off and drop them."""
    global _installed
    with _install_lock:
        old, _installed = _installed, None
    if old is not None:
        old.close()
