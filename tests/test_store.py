"""The tiered store's contract, run over every cold tier (file://, moto S3, SeaweedFS).

Each test gets a fresh node root and a fresh cold prefix from ``cold_env`` (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from logstore import Channel, LogStore, RecordKey
from logstore.errors import ColdTierUnavailableError, ConfigError, CorruptRecordError, RecordNotFoundError
from logstore.hot import EVICTED, UPLOADED

ACT = Channel.activation(1)
GRAD = Channel.gradient(2)


@pytest.fixture
def cold_backend(cold_env):
    """(url, storage_options, server or None) of a fresh cold root on each backend."""
    return cold_env.url, cold_env.storage_options, cold_env.server


def _t(it: int, mb: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(it * 100 + mb)
    return torch.randn(4, 8, 16, generator=g).to(dtype)


def _open(root: Path, cold, writer: str | None = "stage1", **kw) -> LogStore:
    url, opts, _ = cold
    return LogStore.open(root, "run1", writer=writer, cold_url=url, cold_options=opts, segment_iters=2, **kw)


def _fill(store: LogStore, iters: range, mbs: int = 2) -> None:
    for it in iters:
        store.put_many([(RecordKey(ACT, it, mb), _t(it, mb)) for mb in range(mbs)])
        store.put_many([(RecordKey(GRAD, it, mb), _t(it, mb, torch.bfloat16)) for mb in range(mbs)])


def test_put_get_scan_flush_read_through(tmp_path: Path, cold_backend) -> None:
    s = _open(tmp_path / "node", cold_backend, upload=False)
    _fill(s, range(6))
    assert torch.equal(s.get(RecordKey(ACT, 3, 1)), _t(3, 1))
    got = list(s.scan(GRAD, 2, 4))
    assert [(k.iteration, k.micro_batch) for k, _ in got] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert all(torch.equal(t, _t(k.iteration, k.micro_batch, torch.bfloat16)) for k, t in got)
    assert s.flush() > 0
    st = s.stats()
    assert st["cold"]["records"] == st["hot"]["records"] == 24
    assert st["hot"]["raw_bytes"] > st["hot"]["stored_bytes"] > 0
    s.close()
    # another node (empty root) reads everything from the cold tier alone
    r = _open(tmp_path / "other-node", cold_backend, writer=None)
    assert len(r.keys(ACT)) == 12
    for it in range(6):
        for mb in range(2):
            assert torch.equal(r.get(RecordKey(ACT, it, mb)), _t(it, mb))
    with pytest.raises(RecordNotFoundError, match="act_1_2/it99"):
        r.get(RecordKey(ACT, 99))
    r.close()


def test_background_upload_and_eviction_fall_through(tmp_path: Path, cold_backend) -> None:
    s = _open(tmp_path / "node", cold_backend, hot_max_bytes=1)
    _fill(s, range(8))
    s.flush()
    states = {m.state for m in s.hot.segments()}
    assert states <= {UPLOADED, EVICTED} and EVICTED in states
    for it in range(8):
        assert torch.equal(s.get(RecordKey(ACT, it, 0)), _t(it, 0))
    assert s.verify().ok
    s.close()


def test_reader_in_another_process_while_writing(tmp_path: Path, cold_backend) -> None:
    s = _open(tmp_path / "node", cold_backend)
    _fill(s, range(2))
    url, opts, _ = cold_backend
    code = textwrap.dedent(
        f"""
        import torch
        from logstore import LogStore, Channel, RecordKey
        r = LogStore.open({str(tmp_path / "node")!r}, "run1", cold_url={url!r}, cold_options={opts!r})
        seen = 0
        for _ in range(200):
            seen = max(seen, len(r.keys(Channel.activation(1))))
            if seen >= 20:
                break
        t = r.get(RecordKey(Channel.activation(1), 0, 0))
        print("SEEN", seen, float(t.sum()))
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _fill(s, range(2, 10))
    out, err = p.communicate(timeout=120)
    assert "SEEN" in out, err
    assert int(out.split()[1]) >= 4
    assert float(out.split()[2]) == pytest.approx(float(_t(0, 0).sum()))
    s.close()


def test_checkpoint_gc_deletes_exactly_the_garbage(tmp_path: Path, cold_backend) -> None:
    s = _open(tmp_path / "node", cold_backend)
    _fill(s, range(10))
    s.flush()
    # stage 2 receives ACT (1->2); stage 1 receives GRAD (2->1)
    s.register_checkpoint(2, 6, uri="file:///ckpt/2/6")
    dry = s.gc(dry_run=True)
    assert dry.dry_run and dry.hot_records == 12 and dry.cold_segments == 3
    assert len(s.keys(ACT)) == 8  # reads already hide garbage; nothing deleted yet
    assert all(k.iteration >= 6 for k in s.keys(ACT))
    rep = s.gc()
    assert rep.hot_records == 12 and rep.cold_segments == 3
    assert s.gc().hot_records == 0  # idempotent
    # exactly: ACT below 6 gone in both tiers, everything else intact
    r = _open(tmp_path / "fresh", cold_backend, writer=None)
    assert sorted({k.iteration for k in r.keys(ACT)}) == [6, 7, 8, 9]
    assert len(r.keys(GRAD)) == 20
    with pytest.raises(RecordNotFoundError, match="garbage-collected"):
        r.get(RecordKey(ACT, 5, 0))
    for it in range(10):
        assert torch.equal(r.get(RecordKey(GRAD, it, 1)), _t(it, 1, torch.bfloat16))
    assert [c.iteration for c in r.checkpoints()] == [6]
    r.close()
    s.close()


def test_stats_show_the_range_left_after_gc_inside_a_segment(tmp_path: Path) -> None:
    """GC deletes the garbage records of a segment that keeps live ones: the hot range reported
    (``swiftlog stat``) starts at the first record left, not at the segment's first."""
    s = LogStore.open(tmp_path / "node", "run1", writer="stage1", segment_iters=100)
    _fill(s, range(10))
    s.register_checkpoint(2, 6)
    assert s.gc().hot_records == 12
    hot = s.stats()["channels"][ACT.name]["hot"]
    assert (hot["lo"], hot["hi"], hot["records"]) == (6, 9, 8)
    with pytest.raises(
        RecordNotFoundError,
        match=r"act_1_2/it11/mb0/p0 of run 'run1' not found in the hot tiers \(no cold tier given\)",
    ) as e:
        s.get(RecordKey(ACT, 11, 0))  # (a store opened without its cold tier says so)
    assert "--cold-url" in (e.value.hint or "")
    s.close()


def test_a_segment_garbage_collected_during_its_upload_is_no_cold_tier_fault(tmp_path: Path, caplog) -> None:
    s = LogStore.open(
        tmp_path / "node",
        "run1",
        writer="stage1",
        cold_url=f"file://{tmp_path / 'cold'}",
        segment_iters=2,
        upload=False,
    )
    _fill(s, range(4))
    real = s.cold.put_segment
    gone: list[str] = []

    def collected_first(
        name, source, **kw
    ):  # a checkpoint's GC deletes the file between the uploader's check and its read
        if not gone:
            gone.append(source)
            Path(source).unlink()
        return real(name, source, **kw)

    s.cold.put_segment = collected_first
    with caplog.at_level("WARNING", logger="logstore"):
        assert s.flush() >= 1  # the other segments are shipped
    up = s.stats()["upload"]
    assert gone and up["errors"] == 0 and up["last_error"] is None and "cold tier error" not in caplog.text

    def broken(name, source, **kw):  # the file is still there: a real failure is still one
        raise ColdTierUnavailableError("object store down")

    s.put(RecordKey(ACT, 9, 0), _t(9, 0))
    s.cold.put_segment = broken
    with pytest.raises(ColdTierUnavailableError):
        s.flush()
    assert s.stats()["upload"]["errors"] == 1
    s.cold.put_segment = real
    s.close()


def test_inputs_sealed_during_a_long_upload_pass_go_before_the_rest_of_its_backlog(tmp_path: Path) -> None:
    """After an outage the uploader's pass over the bulk backlog can take minutes: a first stage's
    inputs sealed meanwhile (what its commit waits for) are shipped next, not after the whole pass
    (they used to wait for it, so a stage that stopped waiting never caught up)."""
    inp = Channel.input(0)
    s = LogStore.open(
        tmp_path / "node", "run1", writer="stage1", cold_url=f"file://{tmp_path / 'cold'}", segment_iters=1
    )
    real = s.cold.put_segment
    shipped: list[str] = []
    two_done = threading.Event()

    def slow(name, source, **kw):
        time.sleep(0.05)
        out = real(name, source, **kw)
        shipped.append(name)
        if len(shipped) == 2:
            two_done.set()
        return out

    s.cold.put_segment = slow
    _fill(s, range(12))
    s.seal()  # a backlog of 24 sealed segments, going up one by one
    assert two_done.wait(30)
    s.put_many([(RecordKey(inp, 12, mb), _t(12, mb)) for mb in range(2)])
    s.seal([inp])
    assert s.wait_shipped([inp], 12, timeout=30)
    s.flush()
    at = next(i for i, n in enumerate(shipped) if "input_0" in n)
    assert at <= 4 and len(shipped) == 25, (at, shipped)  # after the upload in flight, not after the other 20
    s.cold.put_segment = real
    s.close()


def test_inputs_targets_and_meta_go_first_even_when_nobody_sealed_them_as_such(tmp_path: Path) -> None:
    """The inputs-first order lived in memory (channels given to seal()): a reopened writer, or
    another process's flush (swiftlog flush, POST /flush), uploaded by id. Inputs, targets and META
    now go first by their kind."""
    s = LogStore.open(
        tmp_path / "node",
        "run1",
        writer="stage0",
        cold_url=f"file://{tmp_path / 'cold'}",
        segment_iters=1,
        upload=False,
    )
    for it in range(4):  # rotation seals the segments of iterations 0..2
        _fill(s, range(it, it + 1))
        s.put(RecordKey(Channel.input(0), it, 0), _t(it, 0))
        s.put(RecordKey(Channel.meta(0), it, 0), _t(it, 0))
    s.close()  # sealed, nothing uploaded
    other = LogStore.open(
        tmp_path / "node", "run1", cold_url=f"file://{tmp_path / 'cold'}"
    )  # another process: no writer
    rep = other.upload_sealed()
    kinds = [n.split("/")[2].split("_")[0] for n in rep["uploaded"]]
    assert len(kinds) == 16 and sorted(kinds[:8]) == ["input"] * 4 + ["meta"] * 4, kinds
    assert set(kinds[8:]) == {"act", "grad"}
    other.close()


def test_gc_concurrent_with_writer(tmp_path: Path, cold_backend) -> None:
    import threading

    s = _open(tmp_path / "node", cold_backend, upload=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for it in range(40):
                s.put(RecordKey(ACT, it, 0), _t(it, 0))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    th = threading.Thread(target=writer)
    th.start()
    g = _open(tmp_path / "node", cold_backend, writer=None)
    wm = 0
    while not stop.is_set():
        wm += 1
        g.register_checkpoint(2, wm)
        g.gc()
        time.sleep(0.01)
    th.join()
    assert not errors
    keys = s.keys(ACT)
    assert [k.iteration for k in keys] == list(range(wm, 40))
    for k in keys:
        assert torch.equal(s.get(k), _t(k.iteration, 0))
    g.close()
    s.close()


def test_corrupt_bit_in_cold_record_detected(tmp_path: Path, cold_backend, cold_env) -> None:
    s = _open(tmp_path / "node", cold_backend, hot_max_bytes=1)
    _fill(s, range(2))
    s.flush()
    # rewrite the object with one flipped bit (marker untouched): reads and verify must notice
    seg = next(m for m in s.hot.segments() if m.channel == ACT.name)
    data = bytearray(s.cold.read(seg.cold_name))
    loc = s.hot.lookup(RecordKey(ACT, 0, 0))
    data[loc.offset + 40] ^= 0x10
    cold_env.raw_put(seg.cold_name, bytes(data))
    with pytest.raises(CorruptRecordError, match=r"act_1_2/it0/mb0"):
        s.get(RecordKey(ACT, 0, 0))
    rep = s.verify()
    assert not rep.ok and any("act_1_2/it0/mb0" in p["key"] for p in rep.problems)
    s.close()


def test_a_corrupt_hot_copy_is_read_from_its_intact_cold_copy(tmp_path: Path, cold_backend, caplog) -> None:
    """The hot copy of an uploaded record is corrupt, the cold one intact: a read returns the intact
    bytes (verified) and warns; without the cold tier it is a CorruptRecordError; verify still lists it."""
    s = _open(tmp_path / "node", cold_backend)
    _fill(s, range(2))
    s.flush()
    key = RecordKey(GRAD, 1, 1)
    loc = s.hot.lookup(key)
    path = s.hot.seg_path(loc.segment.id)
    data = bytearray(path.read_bytes())
    data[loc.offset + loc.length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="logstore"):
        assert torch.equal(s.get(key), _t(1, 1, torch.bfloat16))
    assert "corrupt record grad_2_1/it1/mb1" in caplog.text and "intact copy" in caplog.text
    assert not s.verify().ok
    s.close()
    hot_only = LogStore.open(tmp_path / "node", "run1")
    with pytest.raises(CorruptRecordError, match=r"grad_2_1/it1/mb1"):
        hot_only.get(key)
    hot_only.close()
    url, opts, _ = cold_backend
    if url.startswith("file://"):  # both copies corrupt: the error names both
        obj = Path(url[len("file://") :]) / loc.segment.cold_name
        data = bytearray(obj.read_bytes())
        data[loc.offset + loc.length // 2] ^= 0x01
        obj.write_bytes(bytes(data))
        both = _open(tmp_path / "node", cold_backend, writer=None)
        with pytest.raises(
            CorruptRecordError,
            match=r"in hot tier \(.*\): checksum mismatch; the cold copy is corrupt too: "
            r"corrupt record grad_2_1/it1/mb1/p0 in cold object",
        ):
            both.get(key)
        both.close()


def test_corrupt_bit_in_hot_record_detected(tmp_path: Path, cold_backend) -> None:
    s = _open(tmp_path / "node", cold_backend, upload=False)
    _fill(s, range(2))
    loc = s.hot.lookup(RecordKey(GRAD, 1, 1))
    path = s.hot.seg_path(loc.segment.id)
    data = bytearray(path.read_bytes())
    data[loc.offset + loc.length - 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match=r"grad_2_1/it1/mb1"):
        s.get(RecordKey(GRAD, 1, 1))
    rep = s.verify()
    assert [p["key"] for p in rep.problems] == ["grad_2_1/it1/mb1/p0"]
    s.close()


@pytest.mark.s3
@pytest.mark.parametrize("cold_env", ["moto", "seaweedfs"], indirect=True)
def test_object_store_down_keeps_records_hot_and_resumes(tmp_path: Path, cold_backend, cold_env) -> None:
    server = cold_env.server
    s = _open(tmp_path / "node", cold_backend)
    _fill(s, range(2))
    s.flush()
    server.kill()
    try:
        _fill(s, range(2, 6))  # training goes on
        with pytest.raises(ColdTierUnavailableError):
            s.flush()
        st = s.stats()
        assert st["upload"]["backlog_bytes"] > 0 and st["upload"]["last_error"]
        for it in range(6):
            assert torch.equal(s.get(RecordKey(ACT, it, 1)), _t(it, 1))
    finally:
        server.restart()
    deadline = time.monotonic() + 60
    while True:
        try:
            s.flush()
            break
        except ColdTierUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    s.close()
    # moto keeps objects in memory: its restart forgets what was uploaded before the outage
    first = 4 if cold_env.kind == "moto" else 0
    r = _open(tmp_path / "fresh", cold_backend, writer=None)
    assert [k.iteration for k in r.keys(ACT)] == [it for it in range(first // 2, 6) for _ in range(2)]
    assert len(r.keys(GRAD)) == 12 - first
    r.close()


@pytest.mark.s3
@pytest.mark.parametrize("cold_env", ["moto"], indirect=True)
def test_wait_shipped_says_when_sealed_records_are_in_the_cold_tier(tmp_path: Path, cold_backend, cold_env) -> None:
    """What a first / last stage's commit waits for: its records of an iteration in the cold tier.
    Open segments are never shipped; a sealed channel goes up first; with the object store down
    the wait ends at its timeout (False), and the records go up once it is back."""
    inp = Channel.input(0)
    s = _open(tmp_path / "node", cold_backend)
    try:
        _fill(s, range(2))
        s.put_many([(RecordKey(inp, 1, mb), _t(1, mb)) for mb in range(2)])
        assert s.wait_shipped([inp], 1, timeout=0.2) is False  # still in an open segment
        s.seal([inp])
        assert s.wait_shipped([inp], 1, timeout=30) is True
        r = _open(tmp_path / "elsewhere", cold_backend, writer=None)  # another machine sees them
        assert [k.iteration for k in r.keys(inp)] == [1, 1]
        r.close()
        cold_env.server.kill()
        s.put_many([(RecordKey(inp, 2, mb), _t(2, mb)) for mb in range(2)])
        s.seal([inp])
        t0 = time.monotonic()
        assert s.wait_shipped([inp], 2, timeout=0.5) is False  # it ends at its timeout, never waits for the store
        assert time.monotonic() - t0 > 0.4
        assert s.wait_shipped([inp], 1, timeout=0) is True  # what went up before stays up
    finally:
        cold_env.server.restart()
    assert s.wait_shipped([inp], 2, timeout=60) is True
    s.close()


@pytest.mark.s3
@pytest.mark.parametrize("cold_env", ["moto", "seaweedfs"], indirect=True)
def test_gc_aborts_stale_multipart_upload(tmp_path: Path, cold_backend, cold_env) -> None:
    """An uploader that died mid-multipart leaves an in-progress upload: never visible as a
    segment, and aborted by the store's GC."""
    from datetime import timedelta

    s = _open(tmp_path / "node", cold_backend, upload=False, stale_upload_age=timedelta(0))
    _fill(s, range(2))
    s.flush()
    c = cold_env.client()
    key = f"{cold_env.prefix}/run1/segments/act_1_2/000000000004-000000000005.stage1.0000000099.seg"
    up = c.create_multipart_upload(Bucket=cold_env.server.bucket, Key=key)
    c.upload_part(Bucket=cold_env.server.bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * (5 << 20))
    assert len(s.keys(ACT)) == 4  # the partial upload is invisible
    rep = s.gc()
    assert len(rep.aborted_uploads) == 1
    assert cold_env.multipart_uploads() == []
    assert len(s.keys(ACT)) == 4
    s.close()


def test_gaps_reach_the_cold_tier_without_blocking_the_writer(tmp_path: Path, cold_backend) -> None:
    """A gap is in the writer's index at once and goes to the cold tier with the uploads, never
    during ``record_gap``: another node sees it only after the flush."""
    s = _open(tmp_path / "node", cold_backend, upload=False)
    r = _open(tmp_path / "other-node", cold_backend, writer=None)
    s.record_gap(ACT, 7, 1, "queue full")
    assert [(g["channel"], g["iteration"], g["micro_batch"]) for g in s.gaps()] == [("act_1_2", 7, 1)]
    assert r.gaps() == []  # not written to the object store by the caller
    s.flush()
    s.close()
    assert [(g["channel"], g["iteration"], g["reason"]) for g in r.gaps()] == [("act_1_2", 7, "queue full")]
    r.close()


def _file_cold(tmp_path: Path) -> tuple[str, dict, None]:
    return f"file://{tmp_path / 'cold'}", {}, None


def test_a_damaged_index_is_left_out_and_listed_and_the_other_writers_stay_readable(tmp_path: Path) -> None:
    """A QA check: bytes flipped in one writer's LMDB index made every command of the run fail with
    an lmdb traceback (verify too). A reader now walks a foreign index once when it opens it and
    leaves a damaged one out (warned, and listed by verify); the other writer's records, and the
    damaged writer's uploaded ones (cold tier), stay readable."""
    cold = _file_cold(tmp_path)
    a = _open(tmp_path / "node", cold, writer="stage1")
    _fill(a, range(2))
    a.close(flush=True)  # uploaded
    b = _open(tmp_path / "node", cold, writer="stage2", upload=False)
    b.put(RecordKey(Channel.activation(2), 0, 0), _t(0, 0))
    b.close(flush=False)
    data = tmp_path / "node" / "run1" / "stage1" / "index" / "data.mdb"
    raw = bytearray(data.read_bytes())
    for i in range(0, len(raw), 97):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    r = _open(tmp_path / "node", cold, writer=None)
    rep = r.verify()
    assert [(p["tier"], p["where"].endswith("stage1/index")) for p in rep.problems] == [("hot", True)], rep.problems
    assert "cannot be" in rep.problems[0]["error"]
    assert torch.equal(r.get(RecordKey(Channel.activation(2), 0, 0)), _t(0, 0))  # the other writer's
    assert torch.equal(r.get(RecordKey(ACT, 1, 1)), _t(1, 1))  # the damaged writer's, from the cold tier
    r.close()


def test_damaged_cold_trailers_unreadable_and_truncated_hot_files_are_errors_naming_them(tmp_path: Path) -> None:
    """QA checks: one flipped byte in a cold object's trailer asked for any number of bytes
    (MemoryError); a segment file that cannot be read (here a directory in its place) raised a bare
    IsADirectoryError from verify; a truncated one-chunk record failed a stream with struct.error
    (a 500 from /raw). Each is now a CorruptRecordError naming it, and reads fall back to another copy."""
    cold = _file_cold(tmp_path)
    s = _open(tmp_path / "node", cold)
    _fill(s, range(4))
    s.flush()
    key = RecordKey(ACT, 3, 0)
    loc = s.hot.lookup(key)
    s.close()
    # the hot file truncated inside the record: a stream of it falls back to the cold copy
    path = tmp_path / "node" / "run1" / "stage1" / "segments" / f"{loc.segment.id:010d}.seg"
    os.truncate(path, loc.offset + 10)
    r = _open(tmp_path / "node", cold, writer=None)
    stream = r.open_blob(key)
    assert b"".join(stream) == r.get_blob(key)
    r.close()
    # a directory where the file was: verify lists it, a read falls back
    path.unlink()
    path.mkdir()
    r = _open(tmp_path / "node", cold, writer=None)
    assert torch.equal(r.get(key), _t(3, 0))
    assert any("unreadable segment file" in p["error"] for p in r.verify().problems)
    r.close()
    # a damaged trailer in the cold tier, with no hot copy: an error naming the object, for reads and verify
    shutil.rmtree(tmp_path / "node" / "run1" / "stage1")
    obj = Path(str(cold[0])[len("file://") :]) / loc.segment.cold_name
    raw = bytearray(obj.read_bytes())
    raw[-20] ^= 0xFF  # the trailer's entry count
    obj.write_bytes(bytes(raw))
    r = _open(tmp_path / "node", cold, writer=None)
    with pytest.raises(CorruptRecordError, match=r"damaged trailer"):
        r.get(key)
    assert any("damaged trailer" in p["error"] for p in r.verify().problems)
    r.close()


def test_checkpoint_meta_must_be_portable_json(tmp_path: Path) -> None:
    """A lone surrogate or a NaN in a registration's meta was stored as given; every later read of
    the run's checkpoints then failed to serve it. Refused, naming what is wrong; bool stages too."""
    with LogStore.open(tmp_path, "run1", writer="admin") as s:
        for meta in ({"a": "\ud800"}, {"x": float("nan")}, {"o": object()}):
            with pytest.raises(ConfigError, match=r"checkpoint meta of stage 1 iteration 2 is not portable JSON"):
                s.register_checkpoint(1, 2, meta=meta)
        with pytest.raises(ConfigError, match=r"stage >= 0"):
            s.register_checkpoint(True, 2)  # type: ignore[arg-type]
        assert s.checkpoints() == []
        s.register_checkpoint(1, 2, meta={"é": "ü", "n": 1.5})
        assert s.checkpoints()[0].meta == {"é": "ü", "n": 1.5}


def test_a_truncated_or_lost_index_is_listed_and_never_rewritten(tmp_path: Path) -> None:
    """QA checks: an index cut in the middle killed a reader with SIGBUS (the memory map reaches past the
    file's end) or was silently replaced by a fresh, empty one (a reader opened it writable and created
    its databases), so the evidence was gone; an index directory lost entirely made verify say ok. A
    reader now opens a foreign index without creating anything and refuses one shorter than its pages;
    verify lists both cases."""
    cold = _file_cold(tmp_path)
    for w in ("stage1", "stage2"):
        s = _open(tmp_path / "node", cold, writer=w, upload=False)
        _fill(s, range(6)) if w == "stage1" else s.put(RecordKey(Channel.activation(2), 0, 0), _t(0, 0))
        s.close()
    data = tmp_path / "node" / "run1" / "stage1" / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    before = data.read_bytes()
    r = _open(tmp_path / "node", cold, writer=None)
    problems = r.verify().problems
    assert any(p["where"].endswith("stage1/index") and "is truncated" in p["error"] for p in problems), problems
    assert (
        list(r.unreadable_writers()) == ["stage1"] and "is truncated" in r.unreadable_writers()["stage1"]
    )  # what stat shows
    assert torch.equal(r.get(RecordKey(Channel.activation(2), 0, 0)), _t(0, 0))
    r.close()
    assert data.read_bytes() == before  # untouched
    shutil.rmtree(data.parent)  # the index lost: its segment files are listed as unreadable
    r = _open(tmp_path / "node", cold, writer=None)
    problems = r.verify().problems
    assert any("segment file(s) but no index" in p["error"] for p in problems), problems
    r.close()


def test_gc_never_deletes_a_segment_file_its_index_does_not_describe(tmp_path: Path) -> None:
    """A QA check: another writer's index copied over stage 1's made `gc --confirm` delete stage 1's
    files by the other index's garbage (data only that writer had among them). GC removes a file
    only when its size and its footer's records are what the index says."""
    cold = _file_cold(tmp_path)
    a = _open(tmp_path / "node", cold, writer="stage1", upload=False)
    _fill(a, range(6))
    a.close()
    b = _open(tmp_path / "node", cold, writer="stage2", upload=False)
    for it in range(6):
        b.put(RecordKey(Channel.gradient(3), it, 0), _t(it, 0))  # grad_3_2: owned by stage 2
    b.close()
    run = tmp_path / "node" / "run1"
    files = sorted(p.name for p in (run / "stage1" / "segments").glob("*.seg"))
    shutil.copy(run / "stage2" / "index" / "data.mdb", run / "stage1" / "index" / "data.mdb")
    with LogStore.open(tmp_path / "node", "run1", writer="admin") as s:
        s.register_checkpoint(2, 4)  # stage 2's records below 4 are garbage: in stage 2's index, and in the copy
        s.gc()
    assert sorted(p.name for p in (run / "stage1" / "segments").glob("*.seg")) == files


def test_verify_checks_each_cold_object_against_its_commit_marker(tmp_path: Path) -> None:
    """A QA check: a commit marker whose checksum no longer matches its object passed verify."""
    import json as _json

    cold = _file_cold(tmp_path)
    s = _open(tmp_path / "node", cold)
    _fill(s, range(2))
    s.flush()
    assert s.verify().ok
    marker = next((tmp_path / "cold").rglob("*.seg.commit"))
    doc = _json.loads(marker.read_text())
    doc["checksum"] = doc["checksum"] ^ 1
    marker.write_text(_json.dumps(doc))
    s.close()
    r = _open(tmp_path / "node", cold, writer=None)
    problems = r.verify().problems
    assert any(p["tier"] == "cold" and "does not match its commit marker" in p["error"] for p in problems), problems
    r.close()


def test_gc_removes_cold_objects_left_without_a_marker_once_older_than_the_stale_upload_age(
    tmp_path: Path, cold_backend, cold_env
) -> None:
    """The cold tier leaked objects without a marker: a crashed upload's, or one whose marker GC had
    deleted when it crashed (before the object). GC removes them once older than stale_upload_age
    (younger ones may be uploads under way), counts them with the cold segments it deleted, and
    never touches a committed segment."""
    from datetime import timedelta

    s = _open(tmp_path / "node", cold_backend)
    _fill(s, range(6))
    s.flush()
    s.register_checkpoint(2, 2)  # ACT below 2 is garbage: GC deletes its cold segment, marker first
    doomed, size = next((seg.name, seg.size) for seg in s._cold_index.segments(ACT, refresh=True) if seg.hi < 2)
    cold_env.raw_delete(doomed + ".commit")  # ... and crashed before the object
    crashed = f"run1/segments/{ACT.name}/000000000006-000000000007.stage1.0000000099.seg"
    cold_env.raw_put(crashed, b"the first bytes of an upload that never finished")
    rep = s.gc()
    assert rep.cold_segments == 0 and all(cold_env.object_exists(n) for n in (doomed, crashed))  # young: kept
    old = _open(tmp_path / "node", cold_backend, writer=None, stale_upload_age=timedelta(0))
    dry = old.gc(dry_run=True)
    assert sorted(dry.segments) == sorted([doomed, crashed]) and dry.cold_segments == 2
    assert dry.cold_bytes == size + len(b"the first bytes of an upload that never finished")
    assert all(cold_env.object_exists(n) for n in (doomed, crashed))
    rep = old.gc()
    assert sorted(rep.segments) == sorted([doomed, crashed])
    assert not any(cold_env.object_exists(n) for n in (doomed, crashed))
    assert old.gc().segments == []
    for it in range(2, 6):  # what is live is untouched, in both tiers
        assert torch.equal(old.get(RecordKey(ACT, it, 1)), _t(it, 1))
    assert len(old.keys(GRAD)) == 12 and old.verify().ok
    old.close()
    s.close()


@pytest.mark.parametrize("evict", [True, False], ids=["hot-evicted", "hot-kept"])
def test_gc_with_watermarks_inside_segments_keeps_every_record_at_or_above_them(
    tmp_path: Path, cold_backend, evict: bool
) -> None:
    """Cold GC was tested only with watermarks on segment edges: deleting every cold segment that
    merely starts below the watermark (``seg.lo < w``) passed, and deleted live iterations 6-7 of
    a 4-iteration segment at a checkpoint at 6. Each tier is checked on its own, with watermarks
    inside segments: every record at or above the watermark survives, every one below is gone."""
    url, opts, _ = cold_backend
    s = LogStore.open(
        tmp_path / "node",
        "run1",
        writer="stage1",
        cold_url=url,
        cold_options=opts,
        segment_iters=4,
        hot_max_bytes=1 if evict else None,
    )
    _fill(s, range(12))  # ACT (owner 2) and GRAD (owner 1): segments of iterations 0-3, 4-7, 8-11
    s.flush()
    assert ({m.state for m in s.hot.segments()} == {EVICTED}) == evict
    for w in (1, 2, 5, 6, 7, 9, 11):
        s.register_checkpoint(2, w)
        s.gc()
        cold_only = LogStore.open(tmp_path / "other-node", "run1", cold_url=url, cold_options=opts)
        tiers = [("cold", cold_only)]
        if not evict:
            tiers.append(("hot", LogStore.open(tmp_path / "node", "run1")))  # no cold tier: the hot tier alone
        for tier, r in tiers:
            assert r.keys(ACT) == [RecordKey(ACT, it, mb) for it in range(w, 12) for mb in range(2)], (tier, w)
            for it in range(w, 12):
                for mb in range(2):
                    assert torch.equal(r.get(RecordKey(ACT, it, mb)), _t(it, mb)), (tier, w, it, mb)
            assert len(r.keys(GRAD)) == 24, (tier, w)  # stage 1 has no checkpoint: nothing of it is garbage
            r.close()
        cold = [(seg.lo, seg.hi) for seg in s._cold_index.segments(ACT, refresh=True)]
        assert cold == [(lo, lo + 3) for lo in (0, 4, 8) if lo + 3 >= w], (w, cold)
        if not evict:
            assert sorted((m.lo, m.hi) for m in s.hot.segments() if m.channel == ACT.name) == cold, w
    s.close()


def test_a_corrupt_record_whose_only_copy_is_cold_is_never_returned(tmp_path: Path, cold_backend, cold_env) -> None:
    """Skipping the checksum of cold reads went unnoticed: get() still failed (the codec's own
    checksum), but get_blob, what a download and a replay fetch serve, returned the corrupt bytes.
    Both cold read paths refuse them, naming the key and the object: a writer's node whose hot copy
    was evicted (its index knows where the record is) and a node without any hot copy."""
    s = _open(tmp_path / "node", cold_backend, hot_max_bytes=1)
    _fill(s, range(2))
    s.flush()
    key, other = RecordKey(GRAD, 1, 0), RecordKey(GRAD, 1, 1)
    loc = s.hot.lookup(key)
    assert loc.segment.state == EVICTED
    data = bytearray(s.cold.read(loc.segment.cold_name))
    data[loc.offset + loc.length // 2] ^= 0x04  # marker untouched: the object keeps its size
    cold_env.raw_put(loc.segment.cold_name, bytes(data))
    r = _open(tmp_path / "empty-node", cold_backend, writer=None)
    name = loc.segment.cold_name
    for store in (s, r):
        for read in (store.get_blob, lambda k, st=store: b"".join(st.open_blob(k)), store.get):
            with pytest.raises(CorruptRecordError, match=rf"corrupt record {key} in cold object {name}"):
                read(key)
        assert torch.equal(store.get(other), _t(1, 1, torch.bfloat16))  # its neighbour in the object is intact
    r.close()
    s.close()
