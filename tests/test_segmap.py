"""logstore.segmap: read-only maps of sealed segment files shared by downloads, and streams over them.

A page of a map past the end of its file is a SIGBUS that kills the process: the tests below hold
that only a sealed segment of the size its index gives is mapped, and that a segment cut short,
still open, or deleted while it is sent never crashes the reader.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from logstore import segmap
from logstore.errors import CorruptRecordError
from logstore.hot import OPEN, SEALED, HotTier
from logstore.keys import Channel, RecordKey
from logstore.segment import BlobStream, blob_checksum

KEY = RecordKey(Channel.activation(0), 0, 0)


def _view(maps: segmap.SegmentMaps, path: Path, offset: int, length: int) -> memoryview | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return maps.view(fd, offset, length, path.stat().st_size)
    finally:
        os.close(fd)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _until(cond, what: str) -> None:
    for _ in range(3000):  # the sweeper runs every idle/2 seconds; a loaded machine may be slow to schedule it
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_views_are_the_file_bytes_from_one_map_per_file(tmp_path: Path) -> None:
    path = tmp_path / "a.seg"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    fds = _open_fds()
    maps = segmap.SegmentMaps(idle=600)
    try:
        assert bytes(_view(maps, path, 10, 1000)) == data[10:1010]
        v = _view(maps, path, 2 << 20, 4096)
        assert bytes(v) == data[2 << 20 : (2 << 20) + 4096] and v.readonly
        assert len(maps) == 1
        assert _view(maps, path, len(data) - 10, 11) is None  # past the end of the file: never mapped
        assert _view(maps, path, 0, 0) == b""
        with pytest.raises(TypeError):
            v[0] = 0  # read-only
        del v
    finally:
        maps.close()
    assert len(maps) == 0 and _open_fds() == fds  # the maps' own descriptors are closed with them


def test_a_file_of_another_size_than_the_index_says_is_never_mapped(tmp_path: Path) -> None:
    """A sealed file cut short (a power loss before its pages reached the disk) or grown: refused
    before any map is made, so that no page past its end can ever be touched."""
    path = tmp_path / "s.seg"
    path.write_bytes(b"a" * 10_000)
    maps = segmap.SegmentMaps(idle=600)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert maps.view(fd, 0, 100, 20_000) is None  # the index says 20000 bytes: the file is shorter
        assert maps.view(fd, 0, 100, 5_000) is None  # or longer
        assert maps.view(fd, 9_000, 2_000, 10_000) is None  # the record ends past the size
        assert len(maps) == 0
        assert bytes(maps.view(fd, 9_000, 1_000, 10_000)) == b"a" * 1000
    finally:
        os.close(fd)
        maps.close()


def test_maps_beyond_the_bound_go_least_recently_used_first(tmp_path: Path) -> None:
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.seg")
        paths[-1].write_bytes(bytes([i]) * 8192)
    maps = segmap.SegmentMaps(idle=600, max_maps=2)
    try:
        _view(maps, paths[0], 0, 10)
        _view(maps, paths[1], 0, 10)
        _view(maps, paths[0], 0, 10)  # used again: paths[1] is now the least recent
        _view(maps, paths[2], 0, 10)
        assert len(maps) == 2
        idents = {(os.stat(p).st_dev, os.stat(p).st_ino) for p in (paths[0], paths[2])}
        assert set(maps._maps) == idents
    finally:
        maps.close()


def test_idle_maps_and_maps_of_deleted_files_are_dropped(tmp_path: Path) -> None:
    """A map keeps a deleted file's disk space: GC deletes segment files to free it."""
    kept, gone = tmp_path / "kept.seg", tmp_path / "gone.seg"
    kept.write_bytes(b"k" * 8192)
    gone.write_bytes(b"g" * 8192)
    fds = _open_fds()
    maps = segmap.SegmentMaps(idle=600)
    try:
        _view(maps, kept, 0, 10)
        view = _view(maps, gone, 0, 10)
        gone.unlink()
        _until(lambda: len(maps) == 1, "the deleted file's map dropped")
        assert bytes(view) == b"g" * 10  # a view still out keeps its pages until it goes
        del view
        assert _open_fds() == fds + 2  # the kept file: the map's descriptor and the one mmap keeps
    finally:
        maps.close()
    assert _open_fds() == fds
    idle = segmap.SegmentMaps(idle=0.2)
    try:
        _view(idle, kept, 0, 10)
        _until(lambda: len(idle) == 0, "the idle map dropped")
    finally:
        idle.close()
    assert _open_fds() == fds


@pytest.fixture
def installed() -> Iterator[segmap.SegmentMaps]:
    maps = segmap.install(idle=600)
    try:
        yield maps
    finally:
        segmap.uninstall()


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


def test_a_stream_over_a_view_checks_every_byte(tmp_path: Path) -> None:
    blob = bytearray(os.urandom(10_000))
    cs = blob_checksum(bytes(blob))
    chunks = list(BlobStream.of_view(KEY, memoryview(bytes(blob)), cs, 4096, "test"))
    assert all(isinstance(c, memoryview) for c in chunks) and len(chunks) == 3  # views: nothing copied
    assert b"".join(chunks) == blob
    blob[5000] ^= 1  # a flipped byte in the middle: the last chunk is never handed out
    got = []
    with pytest.raises(CorruptRecordError, match="checksum mismatch"):
        for c in BlobStream.of_view(KEY, memoryview(bytes(blob)), cs, 4096, "test"):
            got.append(len(c))
    assert 0 < sum(got) < len(blob)
    with pytest.raises(CorruptRecordError, match="checksum mismatch"):  # one chunk: refused before any is handed out
        BlobStream.of_view(KEY, memoryview(bytes(blob)), cs, 1 << 20, "test")


def _hot(tmp_path: Path, n: int = 4) -> tuple[HotTier, list[bytes]]:
    """A hot tier whose segment of iterations 0-1 is sealed and whose segment of 2-3 is open."""
    hot = HotTier(tmp_path / "r" / "w", owner=True, segment_iters=2)
    blobs = [os.urandom(10_000) for _ in range(n)]
    for it, blob in enumerate(blobs):
        hot.append([(RecordKey(KEY.channel, it), blob, len(blob))])
    return hot, blobs


def test_only_sealed_segments_are_sent_from_maps(tmp_path: Path, installed: segmap.SegmentMaps) -> None:
    hot, blobs = _hot(tmp_path)
    try:
        for it, blob in enumerate(blobs):
            key = RecordKey(KEY.channel, it)
            loc = hot.lookup(key)
            chunks = list(hot.stream_local(loc, key, 4096))
            assert b"".join(chunks) == blob
            kind = memoryview if loc.segment.state == SEALED else bytes
            assert all(isinstance(c, kind) for c in chunks), (loc.segment.state, {type(c) for c in chunks})
        assert {hot.lookup(RecordKey(KEY.channel, it)).segment.state for it in range(4)} == {SEALED, OPEN}
        assert len(installed) == 1  # the sealed segment alone
    finally:
        hot.close()


def test_a_sealed_segment_cut_short_is_read_with_pread_and_fails_cleanly(
    tmp_path: Path, installed: segmap.SegmentMaps
) -> None:
    """The index says sealed at N bytes; the file has fewer (a power loss, a hand-made copy): never
    mapped, so the short read is an error, never a SIGBUS."""
    hot, blobs = _hot(tmp_path)
    try:
        key = RecordKey(KEY.channel, 1)
        loc = hot.lookup(key)
        assert loc.segment.state == SEALED
        os.truncate(hot.seg_path(loc.segment.id), loc.offset + 5000)
        with pytest.raises(CorruptRecordError):
            b"".join(hot.stream_local(loc, key, 4096))
        assert len(installed) == 0
    finally:
        hot.close()


def test_a_segment_deleted_while_it_is_sent_is_sent_whole(tmp_path: Path, installed: segmap.SegmentMaps) -> None:
    """GC or eviction deletes a sealed file under a download: the map keeps its pages until the last
    view goes, and is then dropped (its disk space freed)."""
    hot, blobs = _hot(tmp_path)
    try:
        key = RecordKey(KEY.channel, 0)
        loc = hot.lookup(key)
        stream = hot.stream_local(loc, key, 4096)
        it = iter(stream)
        first = bytes(next(it))
        hot.seg_path(loc.segment.id).unlink()
        _until(lambda: len(installed) == 0, "the deleted file's map dropped")
        assert first + b"".join(bytes(c) for c in it) == blobs[0]
    finally:
        hot.close()


def test_an_open_segment_cut_by_its_writer_under_a_reader_never_crashes_it(tmp_path: Path) -> None:
    """A reader process with the maps installed streams a record of an open segment while the file is
    cut back below the record (what a writer's crash recovery does to an open segment): the reader
    reads it with pread and gets CorruptRecordError, it is not killed by SIGBUS."""
    hot, blobs = _hot(tmp_path)
    key = RecordKey(KEY.channel, 3)
    loc = hot.lookup(key)
    assert loc.segment.state == OPEN
    path = hot.seg_path(loc.segment.id)
    code = textwrap.dedent(
        f"""
        import os, sys
        from logstore import segmap
        from logstore.errors import CorruptRecordError
        from logstore.hot import HotTier
        from logstore.keys import RecordKey
        segmap.install(idle=600)
        r = HotTier({str(tmp_path / "r" / "w")!r}, owner=False)
        key = RecordKey.parse({str(key)!r})
        s = r.stream_local(r.lookup(key), key, 4096)
        it = iter(s)
        next(it)
        os.truncate({str(path)!r}, {loc.offset + 100})
        try:
            b"".join(it)
        except CorruptRecordError as e:
            print("REFUSED", e)
        print("ALIVE", len(segmap.installed()))
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        hot.close()
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert "REFUSED" in out.stdout and "ALIVE 0" in out.stdout, out.stdout + out.stderr


def test_without_maps_streams_read_bytes(tmp_path: Path) -> None:
    assert segmap.installed() is None
    hot, blobs = _hot(tmp_path)
    try:
        key = RecordKey(KEY.channel, 0)
        chunks = list(hot.stream_local(hot.lookup(key), key, 4096))
        assert all(isinstance(c, bytes) for c in chunks) and b"".join(chunks) == blobs[0]
    finally:
        hot.close()
