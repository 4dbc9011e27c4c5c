"""Hot tier: LMDB index + segment files. Crash recovery, concurrent readers, GC bounds, map growth."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from logstore.errors import CorruptRecordError, StoreError
from logstore.hot import EVICTED, OPEN, SEALED, HotTier
from logstore.keys import Channel, RecordKey

ACT = Channel.activation(0)


def _blob(i: int, n: int = 1000) -> bytes:
    return (i.to_bytes(8, "big") * (n // 8 + 1))[:n]


def test_append_lookup_and_roll(tmp_path: Path) -> None:
    h = HotTier(tmp_path / "r" / "w", owner=True, segment_iters=2)
    for it in range(6):
        h.append([(RecordKey(ACT, it, mb), _blob(it * 10 + mb), 1000) for mb in range(3)])
    segs = h.segments()
    assert [(m.lo, m.hi, m.state) for m in segs] == [(0, 1, SEALED), (2, 3, SEALED), (4, 5, OPEN)]
    for it in range(6):
        for mb in range(3):
            loc = h.lookup(RecordKey(ACT, it, mb))
            assert h.read_local(loc) == _blob(it * 10 + mb)
    assert h.lookup(RecordKey(ACT, 9)) is None
    assert [k.iteration for k, _ in h.keys(ACT, 2, 4)] == [2, 2, 2, 3, 3, 3]
    h.close()


def test_second_writer_refused_reader_allowed(tmp_path: Path) -> None:
    h = HotTier(tmp_path / "r" / "w", owner=True)
    h.append([(RecordKey(ACT, 0), b"x" * 10, 10)])
    code = textwrap.dedent(
        f"""
        from logstore.hot import HotTier
        from logstore.errors import StoreError
        try:
            HotTier({str(tmp_path / "r" / "w")!r}, owner=True)
            print("WROTE")
        except StoreError as e:
            print("REFUSED", e)
        r = HotTier({str(tmp_path / "r" / "w")!r}, owner=False)
        print("READ", len(r.keys()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "REFUSED another process is already writing" in out.stdout, out.stderr
    assert "READ 1" in out.stdout
    h.close()


def test_overwrite_same_key_latest_wins(tmp_path: Path) -> None:
    h = HotTier(tmp_path / "r" / "w", owner=True)
    k = RecordKey(ACT, 3, 1)
    h.append([(k, b"old" * 10, 30)])
    h.append([(k, b"new" * 10, 30)])
    assert h.read_local(h.lookup(k)) == b"new" * 10
    assert sum(m.live for m in h.segments()) == 1
    h.close()


def test_corrupt_byte_detected(tmp_path: Path) -> None:
    h = HotTier(tmp_path / "r" / "w", owner=True)
    k = RecordKey(ACT, 0)
    h.append([(k, _blob(1), 1000)])
    loc = h.lookup(k)
    path = h.seg_path(loc.segment.id)
    data = bytearray(path.read_bytes())
    data[loc.offset + 17] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError):
        h.read_local(loc)
    h.close()


def test_gc_rolling_window_stays_within_1_5x_live(tmp_path: Path) -> None:
    """Write 200 iterations, checkpoint every 20, GC each time: disk <= 1.5x live data."""
    h = HotTier(tmp_path / "r" / "w", owner=True, segment_iters=4, map_size=1 << 20)
    rec = 64 << 10
    ratios = []
    for it in range(200):
        h.append([(RecordKey(ACT, it, mb), os.urandom(rec), rec) for mb in range(4)])
        if it % 20 == 19:
            h.gc({1: it + 1 - 20}, dry_run=False)  # keep the last checkpoint interval live
            live = sum(m.live_bytes for m in h.segments())
            ratios.append(h.disk_bytes() / live)
    assert max(ratios[2:]) <= 1.5, ratios
    h.close()


def test_map_grows_by_itself(tmp_path: Path) -> None:
    h = HotTier(tmp_path / "r" / "w", owner=True, map_size=64 << 10, segment_iters=1000)
    for it in range(3000):
        h.append([(RecordKey(ACT, it), b"z", 1)])
    assert h.env.info()["map_size"] > 64 << 10
    assert len(h.keys()) == 3000
    h.close()


def test_sigkill_mid_write_keeps_acknowledged_records(tmp_path: Path) -> None:
    d = tmp_path / "r" / "w"
    code = textwrap.dedent(
        f"""
        import sys
        from logstore.hot import HotTier
        from logstore.keys import Channel, RecordKey
        h = HotTier({str(d)!r}, owner=True, segment_iters=3)
        it = 0
        while True:
            blob = (str(it) * 5000).encode()[:20000]
            h.append([(RecordKey(Channel.activation(0), it, mb), blob, len(blob)) for mb in range(2)])
            print(it, flush=True)  # acknowledged
            it += 1
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    acked = -1
    t0 = time.monotonic()
    while acked < 40 and time.monotonic() - t0 < 60:
        acked = int(p.stdout.readline())
    p.kill()
    p.wait()
    # whatever is in the pipe was acknowledged too
    for line in p.stdout:
        acked = max(acked, int(line))
    h = HotTier(d, owner=True, segment_iters=3)
    assert all(m.state != OPEN for m in h.segments())  # recovered: open segments sealed
    for it in range(acked + 1):
        blob = (str(it) * 5000).encode()[:20000]
        for mb in range(2):
            assert h.read_local(h.lookup(RecordKey(ACT, it, mb))) == blob
    # the store keeps working after recovery
    h.append([(RecordKey(ACT, acked + 100), b"after", 5)])
    assert h.read_local(h.lookup(RecordKey(ACT, acked + 100))) == b"after"
    h.close()


def test_reader_only_open_of_missing_dir_is_clear(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no hot tier"):
        HotTier(tmp_path / "nope", owner=False)


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 20])
def test_stream_local_yields_the_record_and_holds_back_a_corrupt_end(tmp_path: Path, chunk: int) -> None:
    hot = HotTier(tmp_path, owner=True)
    key = RecordKey(Channel.activation(0), 0, 0)
    blob = os.urandom(10_000)
    hot.append([(key, blob, len(blob))])
    loc = hot.lookup(key)
    assert b"".join(hot.stream_local(loc, key, chunk)) == blob
    fds = len(os.listdir("/proc/self/fd"))
    s = hot.stream_local(loc, key, chunk)
    s.close()  # never iterated: the file is still released
    assert len(os.listdir("/proc/self/fd")) == fds
    with open(hot.seg_path(loc.segment.id), "r+b") as f:  # flip a byte in the middle
        f.seek(loc.offset + 5000)
        b = f.read(1)
        f.seek(loc.offset + 5000)
        f.write(bytes([b[0] ^ 1]))
    if chunk >= len(blob):  # one chunk: refused before anything is handed out
        with pytest.raises(CorruptRecordError):
            hot.stream_local(loc, key, chunk)
    else:
        got = []
        with pytest.raises(CorruptRecordError, match="checksum mismatch"):
            for c in hot.stream_local(loc, key, chunk):
                got.append(c)
        assert 0 < sum(map(len, got)) < len(blob)  # never the whole record
    assert len(os.listdir("/proc/self/fd")) == fds
    hot.close()


def test_a_lost_index_is_rebuilt_from_the_segment_files_and_none_is_overwritten(tmp_path: Path, caplog) -> None:
    """The index gone (deleted, or replaced by an empty one): the next writer numbered its segments
    from 1 again and truncated the old files, silently. Now it re-indexes them (sealed ones from
    their footers, the one that was open from its frames) and numbers new segments past them."""
    import shutil

    d = tmp_path / "r" / "w"
    h = HotTier(d, owner=True, segment_iters=1)
    for it in range(4):
        h.append([(RecordKey(ACT, it, mb), _blob(it * 10 + mb), 1000) for mb in range(2)])
    assert [m.state for m in h.segments()] == [SEALED, SEALED, SEALED, OPEN]
    shutil.copytree(d / "segments", tmp_path / "as-it-was")  # the open segment without its footer, as a crash leaves it
    h.close()
    shutil.rmtree(d / "segments")
    shutil.copytree(tmp_path / "as-it-was", d / "segments")
    before = {p.name: p.read_bytes() for p in (d / "segments").iterdir()}
    for p in (d / "index").iterdir():
        p.unlink()
    with caplog.at_level("WARNING", logger="logstore.hot"):
        h = HotTier(d, owner=True, segment_iters=1)
    assert (
        caplog.text.count("was not in the index: re-indexed 2 record(s) of act_0_1") == 4
        and "from its frames" in caplog.text
    )
    assert h.orphan_files() == [] and [(m.id, m.lo, m.hi, m.state, m.live) for m in h.segments()] == [
        (i + 1, i, i, SEALED, 2) for i in range(4)
    ]
    for it in range(4):
        for mb in range(2):
            assert h.read_local(h.lookup(RecordKey(ACT, it, mb))) == _blob(it * 10 + mb)
    for it in range(10, 12):
        h.append([(RecordKey(ACT, it, 0), _blob(it), 1000)])
    assert [m.id for m in h.segments()][4:] == [5, 6] and h.read_local(h.lookup(RecordKey(ACT, 11, 0))) == _blob(11)
    for name, data in before.items():  # the sealed files untouched; the open one only gained its footer
        assert (d / "segments" / name).read_bytes()[: len(data)] == data
    h.close()


def test_a_segment_file_no_index_can_take_is_kept_and_numbered_past(tmp_path: Path, caplog) -> None:
    d = tmp_path / "r" / "w"
    h = HotTier(d, owner=True, segment_iters=1)
    h.append([(RecordKey(ACT, 0, 0), _blob(0), 1000)])
    h.close()
    stray = d / "segments" / "0000000007.seg"
    stray.write_bytes(b"not a segment")
    with caplog.at_level("WARNING", logger="logstore.hot"):
        h = HotTier(d, owner=True, segment_iters=1)
    assert (
        "0000000007.seg is not in the index and cannot be re-indexed" in caplog.text
        and "numbered from 8" in caplog.text
    )
    assert h.orphan_files() == [stray]
    h.append([(RecordKey(ACT, 1, 0), _blob(1), 1000)])
    assert stray.read_bytes() == b"not a segment" and [m.id for m in h.segments()] == [1, 8]
    h.close()


def test_a_segment_file_without_its_header_is_moved_aside_and_the_writer_reopens(tmp_path: Path, caplog) -> None:
    """A full disk refuses the header of a new segment file, leaving it empty: the writer's next
    open failed with "bad magic" (not naming the file), so a restarted training process crashed."""
    d = tmp_path / "r" / "w"
    h = HotTier(d, owner=True, segment_iters=1)
    h.append([(RecordKey(ACT, 0, 0), _blob(0), 1000)])
    h._new_segment(ACT, 5)  # as a put on a full disk left it: in the index, open, its file empty
    empty = d / "segments" / "0000000002.seg"
    empty.write_bytes(b"")
    h.close()
    with caplog.at_level("WARNING", logger="logstore.hot"):
        h = HotTier(d, owner=True, segment_iters=1)
    assert f"open segment file {empty} (0 bytes) has no segment header" in caplog.text and not empty.exists()
    assert (d / "segments" / "0000000002.seg.unreadable").exists() and [m.id for m in h.segments()] == [1]
    assert h.read_local(h.lookup(RecordKey(ACT, 0, 0))) == _blob(0)
    h.append([(RecordKey(ACT, 6, 0), _blob(6), 1000)])
    assert h.read_local(h.lookup(RecordKey(ACT, 6, 0))) == _blob(6)
    h.close()


def test_an_older_copy_of_the_index_loses_no_acknowledged_record(tmp_path: Path, caplog) -> None:
    """The index put back from an older copy knows a segment as open with fewer records, which the
    writer's recovery truncated (destroying the footer and later records, silently). A segment
    sealed on disk is now re-indexed from its footer; later segments are adopted as orphans."""
    import shutil

    d = tmp_path / "r" / "w"
    h = HotTier(d, owner=True, segment_iters=2)
    h.append([(RecordKey(ACT, 0, mb), _blob(mb), 1000) for mb in range(2)])
    h.close()  # (close seals; an open segment in the copy is what matters: reopen and take the copy mid-segment)
    h = HotTier(d, owner=True, segment_iters=2)
    h.append([(RecordKey(ACT, 2, 0), _blob(20), 1000)])  # segment 2 open with one record
    shutil.copytree(d / "index", tmp_path / "old-index")
    h.append(
        [(RecordKey(ACT, 2, mb), _blob(20 + mb), 1000) for mb in range(1, 4)]
        + [(RecordKey(ACT, 4, 0), _blob(40), 1000)]
    )
    h.close()
    shutil.rmtree(d / "index")
    shutil.copytree(tmp_path / "old-index", d / "index")
    with caplog.at_level("WARNING", logger="logstore.hot"):
        h = HotTier(d, owner=True, segment_iters=2)
    assert "is sealed on disk (4 records) but open in the index" in caplog.text
    for key, blob in [(RecordKey(ACT, 2, mb), _blob(20 + mb)) for mb in range(4)] + [(RecordKey(ACT, 4, 0), _blob(40))]:
        assert h.read_local(h.lookup(key)) == blob, key
    h.close()


def test_fsync_durability_syncs_the_segments_directory_after_creating_or_deleting_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """durability="fsync" synced segment data and index commits but never the ``segments/``
    directory: after a power loss a new segment file's name (and with it every record the index
    acknowledged in it) could be gone, and a deleted one back. The real fsyncs are watched here,
    by the path of the descriptor each one is given."""
    d = tmp_path / "r" / "w"
    synced: list[str] = []
    real_fsync = os.fsync

    def watched(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    seg_dir = str(d / "segments")
    h = HotTier(d, owner=True, durability="fsync", segment_iters=1)
    synced.clear()
    h.append([(RecordKey(ACT, 0, 0), _blob(0), 1000)])  # creates segment 1
    assert seg_dir in synced
    synced.clear()
    h.append([(RecordKey(ACT, 1, 0), _blob(1), 1000)])  # seals 1, creates 2
    assert seg_dir in synced
    synced.clear()
    _, dead = h.gc({1: 1}, dry_run=False)  # stage 1 receives act_0_1: segment 1 is garbage, its file deleted
    assert [m.id for m in dead] == [1] and not h.seg_path(1).exists() and seg_dir in synced
    h.append([(RecordKey(ACT, 2, 0), _blob(2), 1000)])  # seals 2
    synced.clear()
    h.set_state(2, EVICTED)  # (uploaded) its file deleted
    assert not h.seg_path(2).exists() and seg_dir in synced
    h.close()
    synced.clear()
    p = HotTier(d, owner=True, durability="process", segment_iters=1)  # the default never syncs
    p.append([(RecordKey(ACT, 5, 0), _blob(5), 1000)])
    assert synced == []
    p.close()
