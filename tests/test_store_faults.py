"""Full disk: the store refuses new records with StoreFullError, keeps every acknowledged one,
and works again once GC frees space. Two real mechanisms: a small tmpfs (true ENOSPC; needs
mount permission, as root in CI) and RLIMIT_FSIZE in a child process (EFBIG; works anywhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from logstore import Channel, LogStore, RecordKey, codec
from logstore.errors import CorruptRecordError, RecordNotFoundError, StoreFullError
from server.testing import sample_tensor

ACT = Channel.activation(0)

pytest_plugins = ["server.pytest_fixtures"]


def _t(it: int, mb: int) -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(it * 10 + mb))  # 64 KiB, incompressible-ish


def _can_mount_tmpfs(where: Path) -> tuple[bool, str]:
    if shutil.which("mount") is None:
        return False, "no mount command"
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"mount -t tmpfs not permitted here: {r.stderr.strip()}"
    subprocess.run(["umount", str(where)], check=False)
    return True, ""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs mounted for the test (real ENOSPC)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    ok, why = _can_mount_tmpfs(mnt)
    if not ok:
        pytest.skip(why + " (the RLIMIT_FSIZE test still covers a full disk)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_on_tmpfs_then_gc_frees_space(small_disk: Path, tmp_path: Path) -> None:
    s = LogStore.open(
        small_disk, "run1", writer="stage0", cold_url=(tmp_path / "cold").as_uri(), codec="raw", segment_iters=1
    )
    acked: list[tuple[int, int]] = []
    with pytest.raises(StoreFullError, match="disk full"):
        for it in range(10_000):
            for mb in range(2):
                s.put(RecordKey(ACT, it, mb), _t(it, mb))
                acked.append((it, mb))
    assert len(acked) > 20
    for it, mb in acked:  # nothing acknowledged was lost
        assert torch.equal(s.get(RecordKey(ACT, it, mb)), _t(it, mb))
    # a checkpoint of the receiver + GC frees the disk, and logging resumes
    last = acked[-1][0]
    s.flush()
    s.register_checkpoint(1, last)
    rep = s.gc()
    assert rep.hot_segments > 0
    s.put(RecordKey(ACT, last + 1, 0), _t(last + 1, 0))
    assert torch.equal(s.get(RecordKey(ACT, last + 1, 0)), _t(last + 1, 0))
    assert s.verify().ok
    s.close()


@pytest.mark.slow
def test_writing_on_after_the_disk_is_full_never_kills_the_writer(small_disk: Path) -> None:
    """A writer keeps logging (and recording gaps) after its disk filled up, as the client's writer
    thread does: every put is a StoreFullError, the process lives. (The LMDB index mapped for
    writing died of SIGBUS here: a page of a sparse file that the full disk cannot back.)"""
    code = textwrap.dedent(
        f"""
        import torch
        from logstore import LogStore, Channel, RecordKey
        from logstore.errors import StoreFullError
        s = LogStore.open({str(small_disk / "node")!r}, "run1", writer="stage0", segment_iters=1)
        full = 0
        for it in range(400):
            try:
                s.put_many([(RecordKey(Channel.activation(0), it, mb), torch.randn(64, 1024)) for mb in range(2)])
            except StoreFullError as e:
                full += 1
                try:
                    s.record_gap(Channel.activation(0), it, 0, str(e))
                except StoreFullError:
                    pass
        print("FULL", full)
        s.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert int(out.stdout.split()[1]) > 300  # the disk was full for most of it


@pytest.mark.slow
def test_file_size_limit_is_reported_as_store_full(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from logstore import LogStore, Channel, RecordKey
        from logstore.errors import StoreFullError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        s = LogStore.open({str(tmp_path / "node")!r}, "run1", writer="stage0", codec="raw",
                          segment_max_bytes=64 << 20, segment_iters=100_000)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        n = 0
        try:
            for it in range(1000):
                s.put(RecordKey(Channel.activation(0), it, 0), torch.full((64, 256), float(it)))
                n += 1
        except StoreFullError as e:
            print("FULL", n, e)
        for it in range(n):
            assert torch.equal(s.get(RecordKey(Channel.activation(0), it, 0)), torch.full((64, 256), float(it)))
        print("INTACT", n)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert "FULL" in out.stdout, out.stderr
    n = int(out.stdout.split()[1])
    assert 20 < n < 40
    assert f"INTACT {n}" in out.stdout


@pytest.mark.s3
@pytest.mark.slow
def test_close_is_bounded_when_the_object_store_hangs(moto_server, tmp_path: Path) -> None:
    """An object store that accepts connections and never answers (SIGSTOPped): ``close(flush=True,
    timeout=2)`` returns while the store still hangs, every record stays in the hot tier, and the
    uploader thread that outlives the close ends without an uncaught error."""
    import threading

    from logstore.errors import ColdTierUnavailableError

    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_value)  # type: ignore[assignment]
    opts = {**moto_server.storage_options, "config_kwargs": {"read_timeout": 1.0, "connect_timeout": 1.0}}
    s = LogStore.open(
        tmp_path / "node",
        "hang",
        writer="stage0",
        cold_url=moto_server.url(f"hang-{uuid.uuid4().hex[:6]}"),
        cold_options=opts,
        segment_iters=1,
    )
    try:
        s.put(RecordKey(ACT, 0, 0), _t(0, 0))
        s.flush()  # the store works
        moto_server.pause()
        for it in range(1, 8):
            s.put(RecordKey(ACT, it, 0), _t(it, 0))
        with pytest.raises(ColdTierUnavailableError):
            s.flush(timeout=2.0)
        s.close(flush=True, timeout=2.0)  # returns while the store still hangs (resumed only below)
        uploader = [t for t in threading.enumerate() if t.name == "swiftlog-upload-hang"]
        for t in uploader:
            t.join(timeout=30)
    finally:
        moto_server.resume()
        threading.excepthook = previous
    assert errors == [] and not any(t.is_alive() for t in uploader), errors
    r = LogStore.open(tmp_path / "node", "hang")
    assert all(torch.equal(r.get(RecordKey(ACT, it, 0)), _t(it, 0)) for it in range(8))
    r.close()


def test_a_store_root_that_cannot_hold_directories_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A store root that is a file (runs anywhere; the read-only mount below needs mount rights):
    a ConfigError naming the root and why, not a bare OSError."""
    from logstore.errors import ConfigError

    (tmp_path / "node").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"store root .*node.*: cannot write under .*: Not a directory") as e:
        LogStore.open(tmp_path / "node", "run1", writer="stage0")
    assert "writable directory" in (e.value.hint or "")


def test_a_read_only_store_root_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A store root on a read-only mount: a ConfigError naming the root and why (not a bare OSError)."""
    from logstore.errors import ConfigError

    mnt = tmp_path / "ro"
    ok, why = _can_mount_tmpfs(mnt)
    if not ok:
        pytest.skip(why)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], check=True)
    try:
        with pytest.raises(
            ConfigError, match=r"store root .*ro/node.*: cannot write under .*: Read-only file system"
        ) as e:
            LogStore.open(mnt / "node", "run1", writer="stage0")
        assert "writable directory" in (e.value.hint or "")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_verify_reports_what_the_indexes_list_but_no_tier_holds_and_a_lost_cold_copy_is_uploaded_again(
    tmp_path,
) -> None:
    """verify used to say ok (exit 0) when a record's segment file and cold object were both gone,
    and a writer never re-uploaded a segment whose cold object had disappeared."""
    from logstore import Channel, LogStore, RecordKey

    act = Channel.activation(1)
    cold = tmp_path / "cold"
    s = LogStore.open(tmp_path / "node", "run1", writer="w0", cold_url=f"file://{cold}", segment_iters=1)
    for it in range(4):
        s.put(RecordKey(act, it, 0), torch.full((4,), float(it)))
    s.flush()
    segs = sorted(s.hot.segments(), key=lambda m: m.lo)
    s.close()
    assert LogStore.open(tmp_path / "node", "run1", cold_url=f"file://{cold}").verify().ok
    # segment of it 0: cold object gone, local file kept; it 1: both gone; it 2: a file no index knows
    for m in segs[:2]:
        (cold / m.cold_name).unlink()
    (tmp_path / "node" / "run1" / "w0" / "segments" / f"{segs[1].id:010d}.seg").unlink()
    stray = tmp_path / "node" / "run1" / "w0" / "segments" / "0000009999.seg"
    stray.write_bytes(b"x")
    rep = LogStore.open(tmp_path / "node", "run1", cold_url=f"file://{cold}").verify()
    got = {(p["key"], p["error"].split(":")[0].split(" (")[0]) for p in rep.problems}
    assert got == {
        ("act_1_2/it0/mb0/p0", "uploaded, but the cold tier no longer has it"),
        ("act_1_2/it1/mb0/p0", "uploaded, but the cold tier no longer has it and the local file is gone"),
        ("", "segment file not in the writer's index"),
    }, rep.problems
    assert not rep.ok
    stray.unlink()
    w = LogStore.open(tmp_path / "node", "run1", writer="w0", cold_url=f"file://{cold}", segment_iters=1)
    w.flush()  # the reopened writer queued segment 0 again
    w.close()
    assert (cold / segs[0].cold_name).exists()
    left = LogStore.open(tmp_path / "node", "run1", cold_url=f"file://{cold}").verify().problems
    assert [p["key"] for p in left] == ["act_1_2/it1/mb0/p0"]  # lost: nothing to upload it from


@pytest.mark.parametrize("cold", [False, True], ids=["hot-only", "with-cold"])
def test_verify_during_a_gc_does_not_report_what_became_garbage(tmp_path, cold) -> None:
    """A checkpoint and its GC landing while verify runs (the client GCs after every checkpoint):
    verify listed the segments at its start and reported those the GC then deleted as "segment file
    missing and never uploaded: lost" (hot) or "not found" (cold), exit 1 on a healthy store."""
    act = Channel.activation(1)
    cold_url = f"file://{tmp_path / 'cold'}" if cold else None
    with LogStore.open(tmp_path / "node", "r1", writer="stage1", cold_url=cold_url, segment_iters=1) as w:
        for it in range(12):
            w.put(RecordKey(act, it, 0), torch.full((8,), float(it)))
        if cold:
            w.flush()
    reader = LogStore.open(tmp_path / "node", "r1", cold_url=cold_url)
    gcer = LogStore.open(tmp_path / "node", "r1", cold_url=cold_url)
    fired: list[str] = []

    def progress(tier: str, done: int, total: int) -> None:
        if not fired:  # the first step of verify's first pass: a checkpoint of the receiver (stage 2) at 9, and its GC
            fired.append(tier)
            gcer.register_checkpoint(stage=2, iteration=9)
            gc = gcer.gc()
            assert gc.hot_segments + gc.cold_segments >= 9

    rep = reader.verify(progress=progress)
    assert fired and rep.ok, rep.problems
    reader.close()
    gcer.close()


def test_a_store_whose_index_was_lost_is_whole_again_when_its_writer_reopens(tmp_path) -> None:
    """Every record of a writer whose LMDB index was deleted is readable (and counted) again after
    its writer reopens: the segment files are re-indexed; readers meanwhile see verify name them."""
    from logstore import Channel, LogStore, RecordKey

    act = Channel.activation(1)
    want = {
        RecordKey(act, it, mb): torch.randn(3, 5, generator=torch.Generator().manual_seed(it * 10 + mb))
        for it in range(6)
        for mb in range(2)
    }
    s = LogStore.open(tmp_path / "node", "run1", writer="w0", segment_iters=2)
    s.put_many(want.items())
    s.close()
    with LogStore.open(tmp_path / "node", "run1") as r:
        before = r.stats()["hot"]
    index = tmp_path / "node" / "run1" / "w0" / "index"
    for p in index.iterdir():
        p.unlink()
    r = LogStore.open(tmp_path / "node", "run1")
    assert r.keys() == [] and [p["error"].split(":")[0] for p in r.verify().problems] == [
        f"the LMDB index of {index.parent} is missing (no {index / 'data.mdb'})"
    ]
    r.close()
    s = LogStore.open(tmp_path / "node", "run1", writer="w0", segment_iters=2)
    assert all(torch.equal(s.get(k), v) for k, v in want.items()) and s.keys() == sorted(want)
    s.close()
    after = LogStore.open(tmp_path / "node", "run1")
    assert after.verify().ok and {k: after.stats()["hot"][k] for k in ("records", "raw_bytes", "stored_bytes")} == {
        k: before[k] for k in ("records", "raw_bytes", "stored_bytes")
    }
    after.close()


def test_a_writer_restarted_on_a_fresh_root_does_not_reuse_its_earlier_uploads_names(tmp_path) -> None:
    """A rollback restarts a stage on a new store root: its segment ids began at 1 again, so its
    uploads had the names of the previous incarnation's, which the cold tier refuses (immutable,
    other bytes): nothing of the new run was shipped, and a first stage's commits waited 10 s."""
    from logstore import Channel, LogStore, RecordKey

    inp = Channel.input(0)
    cold = f"file://{tmp_path / 'cold'}"
    old = LogStore.open(tmp_path / "gen0", "run1", writer="stage0", cold_url=cold, segment_iters=1)
    old.put_many([(RecordKey(inp, it, 0), torch.full((4,), float(it))) for it in range(3)])
    old.flush()
    old.close()
    new = LogStore.open(tmp_path / "gen1", "run1", writer="stage0", cold_url=cold, segment_iters=1)
    new.put_many(
        [(RecordKey(inp, it, 0), torch.full((4,), 100.0 + it)) for it in range(3)]
    )  # other bytes, same iterations
    new.seal([inp])
    assert new.wait_shipped([inp], 2, timeout=30)
    assert new.flush() == 0 and new.stats()["upload"]["errors"] == 0
    new.close()
    with LogStore.open(tmp_path / "elsewhere", "run1", cold_url=cold) as r:  # the newest copy wins on read
        assert [float(r.get(RecordKey(inp, it, 0))[0]) for it in range(3)] == [100.0, 101.0, 102.0]


def test_a_name_clash_in_the_cold_tier_is_shipped_under_a_new_name(tmp_path, caplog) -> None:
    """The same restart, with the cold tier unreachable when the new writer opened (so it could not
    number past the old uploads): its first upload met a name committed with other bytes and the
    uploader stopped there for good (ColdTierError, head of line). Now it renumbers and ships."""
    from logstore import Channel, LogStore, RecordKey

    inp = Channel.input(0)
    cold = f"file://{tmp_path / 'cold'}"
    with LogStore.open(tmp_path / "gen0", "run1", writer="stage0", cold_url=cold, segment_iters=1) as old:
        old.put_many([(RecordKey(inp, it, 0), torch.full((4,), float(it))) for it in range(3)])
        old.flush()
    new = LogStore.open(
        tmp_path / "gen1", "run1", writer="stage0", cold_url=cold, segment_iters=1, upload=False
    )  # as if the listing at open failed
    new.put_many([(RecordKey(inp, it, 0), torch.full((4,), 100.0 + it)) for it in range(4)])
    with caplog.at_level("WARNING", logger="logstore"):
        assert new.flush() == 4
    assert (
        caplog.text.count("is taken in the cold tier by other bytes") == 3 and new.stats()["upload"]["errors"] == 0
    )  # its first three
    new.close()
    with LogStore.open(tmp_path / "elsewhere", "run1", cold_url=cold) as r:
        assert [float(r.get(RecordKey(inp, it, 0))[0]) for it in range(4)] == [100.0, 101.0, 102.0, 103.0]


def test_an_earlier_incarnation_still_writing_never_wins_in_the_cold_tier(tmp_path) -> None:
    """A stage thought dead but still running (a partition: a "zombie") and its replacement write as
    the same writer, on their own roots, into one cold tier. Which copy of a record a cold read
    returned was decided by the segment id: the zombie's, numbered on, could win (a cold-only
    reader got {4..7: replacement, 8..9: zombie}, and verify said ok). Every upload now carries
    its writer's incarnation (when it opened): a read takes the later incarnation's copy first, and
    a name clash with a later incarnation's upload fences the earlier writer (WriterFencedError,
    nothing more uploaded; its records stay in its hot tier)."""
    from logstore.errors import WriterFencedError

    act = Channel.activation(1)
    cold = f"file://{tmp_path / 'cold'}"

    def put(s: LogStore, its: range, value: float) -> None:
        s.put_many([(RecordKey(act, it, 0), torch.full((4,), value)) for it in its])

    def cold_values(its: range) -> dict[int, float]:
        with LogStore.open(tmp_path / "reader", "r1", cold_url=cold) as r:
            return {it: float(r.get(RecordKey(act, it, 0))[0]) for it in its}

    zombie = LogStore.open(tmp_path / "A", "r1", writer="stage1", cold_url=cold, segment_iters=1)
    put(zombie, range(0, 6), 1.0)
    zombie.flush()  # ids 1-6
    # the replacement opened while the cold tier could not be listed: its ids start at 1, below the zombie's
    replacement = LogStore.open(tmp_path / "B", "r1", writer="stage1", cold_url=cold, segment_iters=1, upload=False)
    put(replacement, range(4, 10), 2.0)  # ids 1-6
    put(zombie, range(6, 10), 1.0)  # ids 7-10
    zombie.flush()
    replacement.flush()
    assert cold_values(range(10)) == {**{it: 1.0 for it in range(4)}, **{it: 2.0 for it in range(4, 10)}}
    replacement.close()
    # a second replacement, opened normally (it numbers past every upload), ships iteration 10 as id 11; the zombie's
    # next segment, iteration 10 as id 11 too, meets that name: it is the earlier incarnation, and stops uploading
    second = LogStore.open(tmp_path / "B2", "r1", writer="stage1", cold_url=cold, segment_iters=1)
    put(second, range(10, 11), 3.0)
    second.flush()
    put(zombie, range(10, 11), 1.0)
    with pytest.raises(
        WriterFencedError, match=r"writer stage1 of run 'r1': .* was uploaded by a later incarnation of this writer"
    ):
        zombie.flush()
    with pytest.raises(WriterFencedError):  # for good
        zombie.flush()
    assert float(zombie.get(RecordKey(act, 10, 0))[0]) == 1.0  # its own records are still in its hot tier
    zombie.close()
    second.close()
    assert cold_values(range(4, 11)) == {**{it: 2.0 for it in range(4, 10)}, 10: 3.0}


def test_segments_shipped_by_another_process_carry_their_writers_incarnation(tmp_path) -> None:
    """The replacement's segments uploaded by another process (`swiftlog flush`, POST /flush: it
    was down, or closed with them sealed) carried no incarnation, counted as the oldest, and the
    zombie's copies won every cold read. The incarnation lives in the writer's index now, so any
    shipper stamps it."""
    act = Channel.activation(1)
    cold = f"file://{tmp_path / 'cold'}"

    def put(s: LogStore, value: float) -> None:
        s.put_many([(RecordKey(act, it, 0), torch.full((4,), value)) for it in range(4, 8)])

    zombie = LogStore.open(tmp_path / "zombie", "r1", writer="stage1", cold_url=cold, segment_iters=1, upload=False)
    put(zombie, 1.0)
    replacement = LogStore.open(
        tmp_path / "replacement", "r1", writer="stage1", cold_url=cold, segment_iters=1, upload=False
    )
    put(replacement, 2.0)
    replacement.close()  # sealed, not uploaded
    with LogStore.open(tmp_path / "replacement", "r1", cold_url=cold) as shipper:  # not the writer
        assert len(shipper.upload_sealed()["uploaded"]) == 4
    from logstore.errors import WriterFencedError

    with pytest.raises(WriterFencedError):  # the same names, uploaded for a later incarnation
        zombie.flush()
    zombie.close()
    with LogStore.open(tmp_path / "reader", "r1", cold_url=cold) as r:
        assert [float(r.get(RecordKey(act, it, 0))[0]) for it in range(4, 8)] == [2.0] * 4


@pytest.mark.parametrize("zombie_first", [True, False], ids=["zombie-shipped-first", "replacement-shipped-first"])
def test_another_process_ships_each_incarnation_by_the_same_rules(tmp_path, zombie_first) -> None:
    """Both incarnations' segments shipped by other processes (`swiftlog flush` on each root, POST
    /flush). Zombie first: the replacement's met the same names and the shipper gave up (only the
    writer's own process renamed): the replacement's records never reached the cold tier, and reads
    returned the zombie's. Now a shipper renumbers a later incarnation's segment past an earlier
    one's names, and refuses (WriterFencedError) to ship an earlier incarnation's over a later one's."""
    from logstore.errors import WriterFencedError

    act = Channel.activation(1)
    cold = f"file://{tmp_path / 'cold'}"

    def write(root: str, value: float) -> None:
        w = LogStore.open(tmp_path / root, "r1", writer="stage1", cold_url=cold, segment_iters=1, upload=False)
        w.put_many([(RecordKey(act, it, 0), torch.full((4,), value)) for it in range(4, 8)])
        w.close()  # sealed, not uploaded

    write("zombie", 1.0)
    write("replacement", 2.0)
    for root in ("zombie", "replacement") if zombie_first else ("replacement", "zombie"):
        with LogStore.open(tmp_path / root, "r1", cold_url=cold) as shipper:
            if root == "zombie" and not zombie_first:
                with pytest.raises(WriterFencedError, match="later incarnation"):
                    shipper.upload_sealed()
            else:
                assert len(shipper.upload_sealed()["uploaded"]) == 4
    with LogStore.open(tmp_path / "reader", "r1", cold_url=cold) as r:
        assert [float(r.get(RecordKey(act, it, 0))[0]) for it in range(4, 8)] == [2.0] * 4


def test_a_logging_groups_records_stay_until_every_member_checkpointed_past_them(tmp_path) -> None:
    """Logging groups replay together from the newest checkpoint every member has: a member's own,
    newer checkpoint made the records it received garbage, and a group replay from the common one
    found target_3 of iteration 6 gone ("no record of target_3", a rollback). With the groups named
    in the registrations, a member's watermark is its group's oldest newest checkpoint."""
    tgt, act = Channel.target(3), Channel.activation(0)  # act_0_1: received by stage 1
    cold = f"file://{tmp_path / 'cold'}"
    with LogStore.open(tmp_path / "node", "r1", writer="stage3", cold_url=cold, segment_iters=1) as w:
        w.put_many([(RecordKey(tgt, it, 0), torch.full((2,), float(it))) for it in range(10)])
        w.put_many([(RecordKey(act, it, 0), torch.full((2,), float(it))) for it in range(10)])
        w.flush()
        groups = {"logging_groups": [2, 2]}
        w.register_checkpoint(stage=2, iteration=6, meta=groups)
        w.register_checkpoint(stage=3, iteration=9, meta=groups)
        w.register_checkpoint(stage=1, iteration=8, meta=groups)  # stage 0 has none: group (0, 1) keeps everything
        assert w.watermarks() == {1: 0, 2: 6, 3: 6}
        w.gc()
        assert float(w.get(RecordKey(tgt, 6, 0))[0]) == 6.0 and float(w.get(RecordKey(act, 2, 0))[0]) == 2.0
        with pytest.raises(RecordNotFoundError, match="garbage-collected"):
            w.get(RecordKey(tgt, 5, 0))
    with LogStore.open(tmp_path / "other", "r1", cold_url=cold) as r:  # the registrations in the cold tier say the same
        assert r.watermarks() == {1: 0, 2: 6, 3: 6} and float(r.get(RecordKey(tgt, 6, 0))[0]) == 6.0


# ------------------------------------------------------------------ a writer reopening after a crash
def _tensor(it: int, mb: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(it * 10 + mb))


def _write_and_die(root: Path, iterations: int, docs: bool = False, **store_kw: object) -> None:
    """A writer process logs ACT x ``iterations`` x 2 micro-batches and dies by SIGKILL: its open
    segment stays open, as a crash leaves it. ``docs``: it first records a gap (ACT, 99, 0) and
    registers a checkpoint of stage 3 at 7."""
    code = textwrap.dedent(
        f"""
        import os, signal, torch
        from logstore import LogStore, Channel, RecordKey
        s = LogStore.open({str(root)!r}, "run1", writer="stage0", **{store_kw!r})
        if {docs!r}:
            s.record_gap(Channel.activation(0), 99, 0, "queue full")
            s.register_checkpoint(3, 7)
        for it in range({iterations}):
            g = [torch.Generator().manual_seed(it * 10 + mb) for mb in range(2)]
            s.put_many([(RecordKey(Channel.activation(0), it, mb), torch.randn(16, 32, generator=g[mb]))
                        for mb in range(2)])
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]


def _open_segment_of(root: Path, key: RecordKey) -> tuple[Path, int, int]:
    """(file, blob offset, blob length) of ``key`` in the writer's open segment, from its index."""
    from logstore.hot import OPEN, HotTier

    hot = HotTier(root / "run1" / "stage0", owner=False)
    try:
        loc = hot.lookup(key)
        assert loc is not None and loc.segment.state == OPEN
        return hot.seg_path(loc.segment.id), loc.offset, loc.length
    finally:
        hot.close()


@pytest.mark.parametrize("cut", ["frame-header", "two-frames"])
def test_a_writer_reopens_a_segment_shorter_than_its_index_says_and_records_the_loss_as_gaps(
    tmp_path: Path, cut: str
) -> None:
    """Power loss after the index pages reached disk but not the segment's last pages (or a file cut
    inside the last acknowledged frame header): the writer's reopen died with a bare struct.error.
    It now drops what is torn, records each lost record as a gap, and goes on."""
    from logstore.segment import FRAME_HEADER_SIZE

    root = tmp_path / "node"
    _write_and_die(root, 6, segment_iters=4)  # iterations 4, 5 in the open segment
    last = RecordKey(ACT, 5, 1)
    path, off, _ = _open_segment_of(root, last)
    if cut == "frame-header":  # inside the last frame's header
        lost = [last]
        os.truncate(path, off - FRAME_HEADER_SIZE + 20)
    else:  # inside the blob of the frame before it: two records lost
        lost = [RecordKey(ACT, 5, 0), last]
        _, off0, len0 = _open_segment_of(root, lost[0])
        os.truncate(path, off0 + len0 // 2)
    s = LogStore.open(root, "run1", writer="stage0", segment_iters=4)
    kept = [RecordKey(ACT, it, mb) for it in range(6) for mb in range(2) if RecordKey(ACT, it, mb) not in lost]
    assert s.keys() == kept
    for k in kept:
        assert torch.equal(s.get(k), _tensor(k.iteration, k.micro_batch))
    for k in lost:
        with pytest.raises(RecordNotFoundError):
            s.get(k)
    gaps = s.gaps()
    assert [(g["channel"], g["iteration"], g["micro_batch"]) for g in gaps] == [
        (ACT.name, k.iteration, k.micro_batch) for k in lost
    ]
    assert all("torn" in g["reason"] for g in gaps), gaps
    s.put(RecordKey(ACT, 6, 0), _tensor(6, 0))  # logging goes on
    s.close()
    with LogStore.open(root, "run1") as r:
        assert r.verify().ok and len(r.keys()) == len(kept) + 1


@pytest.mark.parametrize("page", ["records", "segments"])
def test_a_writer_whose_own_index_is_damaged_re_indexes_its_segment_files(tmp_path: Path, page: str, caplog) -> None:
    """A flipped page in a writer's own LMDB index: its reopen failed with MDB_CORRUPTED and no hint,
    so the training process could not start. The writer now moves the damaged index aside (kept, for
    a post-mortem), re-indexes its segment files, keeps the documents still readable (a gap, a
    checkpoint registration), and records the torn record of its open segment (cut inside its blob:
    the frame header still names it) as a gap."""
    import struct

    import lmdb

    root = tmp_path / "node"
    _write_and_die(root, 6, docs=True, segment_iters=4)
    torn = RecordKey(ACT, 5, 1)
    path, off, ln = _open_segment_of(root, torn)
    os.truncate(path, off + ln // 2)
    index = root / "run1" / "stage0" / "index"
    env = lmdb.open(str(index), readonly=True, lock=False, max_dbs=4)  # compacted: no stale copy of a page is left
    (tmp_path / "compact").mkdir()
    env.copy(str(tmp_path / "compact"), compact=True)
    psize = env.stat()["psize"]
    env.close()
    raw = bytearray((tmp_path / "compact" / "data.mdb").read_bytes())
    needle = RecordKey(ACT, 2, 0).encode() if page == "records" else f'[1,"{ACT.name}"'.encode()  # a key; segment 1
    pages = {i // psize for i in range(len(raw)) if raw[i : i + len(needle)] == needle}
    assert len(pages) == 1
    struct.pack_into("<H", raw, pages.pop() * psize + 10, 0)  # its flags: a page of the wrong type (MDB_CORRUPTED)
    (index / "data.mdb").write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="logstore.hot"):
        s = LogStore.open(root, "run1", writer="stage0", segment_iters=4)
    kept = [RecordKey(ACT, it, mb) for it in range(6) for mb in range(2) if (it, mb) != (5, 1)]
    assert s.keys() == kept
    for k in kept:
        assert torch.equal(s.get(k), _tensor(k.iteration, k.micro_batch))
    assert "is damaged" in caplog.text and "re-indexed" in caplog.text, caplog.text
    aside = [p.name for p in (root / "run1" / "stage0").iterdir() if p.name.startswith("index.damaged-")]
    assert len(aside) == 1 and aside[0] in caplog.text
    assert [(g["channel"], g["iteration"], g["micro_batch"]) for g in s.gaps()] == [(ACT.name, 5, 1), (ACT.name, 99, 0)]
    assert [(c.stage, c.iteration) for c in s.checkpoints()] == [(3, 7)]
    s.put(RecordKey(ACT, 6, 0), _tensor(6, 0))
    s.close()
    with LogStore.open(root, "run1") as r:
        assert r.verify().ok and len(r.keys()) == len(kept) + 1


def test_a_damaged_index_key_is_never_served_under_the_wrong_key(tmp_path: Path) -> None:
    """A flipped byte in a key of a writer's LMDB index turned p0 into p1: verify said ok, and
    get(p1) returned the bytes logged as p0 (``swiftlog show .../p1`` exited 0). The frame header
    holds the true key (under its CRC): reads and verify compare it with the index's."""
    from server.testing import subprocess_env

    root = tmp_path / "node"
    p0, p1 = RecordKey(ACT, 1, 0, part=0), RecordKey(ACT, 1, 0, part=1)
    with LogStore.open(root, "run1", writer="stage0") as s:
        s.put_many([(RecordKey(ACT, it, mb), _tensor(it, mb)) for it in range(3) for mb in range(2)])
    data = root / "run1" / "stage0" / "index" / "data.mdb"
    raw = data.read_bytes()
    assert raw.count(p0.encode()) >= 1 and p1.encode() not in raw
    data.write_bytes(raw.replace(p0.encode(), p1.encode()))
    r = LogStore.open(root, "run1")
    assert p1 in r.keys()  # what the damaged index says
    with pytest.raises(CorruptRecordError, match=r"act_0_1/it1/mb0/p1 .*the frame there holds act_0_1/it1/mb0/p0"):
        r.get_blob(p1)
    with pytest.raises(CorruptRecordError, match=r"act_0_1/it1/mb0/p1"):
        b"".join(r.open_blob(p1))
    rep = r.verify()
    assert [p["key"] for p in rep.problems] == [str(p1)], rep.problems
    assert "frame there holds" in rep.problems[0]["error"]
    assert torch.equal(r.get(RecordKey(ACT, 1, 1)), _tensor(1, 1))  # the others intact
    r.close()
    show = subprocess.run(
        [sys.executable, "-m", "server.cli", "show", str(p1), "--root", str(root), "--run", "run1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert show.returncode == 1 and "act_0_1/it1/mb0/p1" in show.stderr, (show.stdout, show.stderr)
    assert "Traceback" not in show.stderr


def test_the_api_and_the_cli_refuse_a_corrupt_record_whose_only_copy_is_cold(store_copy, tmp_path: Path) -> None:
    """No test read a corrupt record whose only copy is cold through the admin API or the CLI:
    skipping the cold checksum let ``GET .../raw`` serve the corrupt bytes (200, with their own
    checksum in the header), and ``swiftlog export`` refused them only by the codec's second check,
    without naming the corrupt copy. Stage 3's hot copies are evicted here: ``swiftlog export``
    exits 1 naming the key and the object, and writes nothing; the raw download answers 409."""
    import httpx

    from logstore.hot import EVICTED, HotTier
    from server.testing import ServerProcess
    from tests.test_cli_commands import swiftlog

    key, other = RecordKey(Channel.gradient(3), 2, 1), RecordKey(Channel.gradient(3), 2, 0)
    hot = HotTier(store_copy.root / store_copy.run / "stage3", owner=False)
    loc = hot.lookup(key)
    hot.close()
    assert loc.segment.state == EVICTED and loc.segment.cold_name
    obj = store_copy.cold_dir / loc.segment.cold_name
    data = bytearray(obj.read_bytes())
    data[loc.offset + loc.length // 2] ^= 0x08
    obj.write_bytes(bytes(data))
    out = tmp_path / "x.pt"
    p = swiftlog(
        "export",
        str(key),
        "--root",
        store_copy.root,
        "--run",
        store_copy.run,
        "--cold-url",
        store_copy.cold_url,
        "-o",
        out,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    assert f"corrupt record {key} in cold object {loc.segment.cold_name}" in p.stderr, p.stderr
    assert not out.exists()
    server = ServerProcess(store_copy.root, cold_url=store_copy.cold_url)
    with server as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        bad = c.get(f"/v1/runs/{store_copy.run}/records/{key}/raw")
        assert bad.status_code == 409, (bad.status_code, bad.content[:200])
        assert bad.json()["error"]["code"] == "corrupt_record"
        assert f"{key} in cold object {loc.segment.cold_name}" in bad.json()["error"]["message"]
        good = c.get(f"/v1/runs/{store_copy.run}/records/{other}/raw")
        assert good.status_code == 200
        assert torch.equal(codec.decode_tensor(good.content), sample_tensor(other.channel, 2, 0))
