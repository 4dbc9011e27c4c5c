"""The cold-tier contract, run over every backend: file://, moto S3, SeaweedFS S3.

Every test taking ``cold_tier`` / ``cold_env`` runs once per backend (see tests/conftest.py).
Fault tests: an uploader SIGKILLed mid-multipart, and the object store going down and coming back.
"""

from __future__ import annotations

import http.server
import multiprocessing
import os
import signal
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import xxhash

from logstore.cold import ColdTier, SegmentInfo
from logstore.errors import (
    ColdTierError,
    ColdTierUnavailableError,
    ConfigError,
    InvalidNameError,
    RecordNotFoundError,
    SegmentClashError,
    StoreClosedError,
)
from logstore.testing.s3servers import free_port

if TYPE_CHECKING:
    from conftest import ColdEnv

MiB = 2**20


def _xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


# ---------------------------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------------------------
def test_put_list_read_roundtrip(cold_tier: ColdTier) -> None:
    a = os.urandom(1000)
    b = b"footer-test-" * 20
    before = datetime.now(UTC) - timedelta(seconds=5)
    ia = cold_tier.put_segment("run1/act_0_1/seg-000", a, meta={"it_lo": 0, "it_hi": 10})
    ib = cold_tier.put_segment("run1/grad_1_0/seg-000", memoryview(b), meta={})
    cold_tier.put_segment("run2/act_0_1/seg-000", b"x", meta={"k": "v"})

    assert ia == SegmentInfo("run1/act_0_1/seg-000", len(a), _xxh(a), {"it_lo": 0, "it_hi": 10}, ia.created)
    assert ia.created.tzinfo is not None and ia.created >= before
    assert (ib.size, ib.checksum) == (len(b), _xxh(b))

    listed = cold_tier.list_segments()
    assert [s.name for s in listed] == ["run1/act_0_1/seg-000", "run1/grad_1_0/seg-000", "run2/act_0_1/seg-000"]
    assert listed[0] == ia  # the listing carries everything the marker recorded
    assert [s.name for s in cold_tier.list_segments("run1/")] == ["run1/act_0_1/seg-000", "run1/grad_1_0/seg-000"]
    assert [s.name for s in cold_tier.list_segments("run1/act")] == ["run1/act_0_1/seg-000"]
    assert cold_tier.list_segments("run3/") == []
    assert cold_tier.segment_info("run2/act_0_1/seg-000").meta == {"k": "v"}
    assert cold_tier.segment_info("run2/nope") is None

    assert cold_tier.read("run1/act_0_1/seg-000") == a
    assert cold_tier.read("run1/act_0_1/seg-000", verify=True) == a
    name = "run1/grad_1_0/seg-000"
    assert cold_tier.read_range(name, 0, 11) == b[:11]
    assert cold_tier.read_range(name, 5, 30) == b[5:35]
    assert cold_tier.read_range(name, -64, 64) == b[-64:]  # a footer read
    assert cold_tier.read_range(name, -64, 10) == b[-64:-54]
    assert cold_tier.read_range(name, -10_000, 3) == b[:3]  # longer than the object: from its start
    assert cold_tier.read_range(name, len(b) - 4, 100) == b[-4:]
    assert cold_tier.read_range(name, len(b), 10) == b""
    assert cold_tier.read_range(name, len(b) + 100, 10) == b""
    assert cold_tier.read_range(name, 3, 0) == b""
    with pytest.raises(ValueError):
        cold_tier.read_range(name, 0, -1)


def test_sources_file_path_and_empty(cold_tier: ColdTier, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    p = tmp_path / "seg.bin"
    p.write_bytes(data)
    info = cold_tier.put_segment("r/from-path", p, meta={})
    info2 = cold_tier.put_segment("r/from-str", str(p), meta={})
    assert (info.size, info.checksum) == (info2.size, info2.checksum) == (len(data), _xxh(data))
    assert cold_tier.read("r/from-path") == cold_tier.read("r/from-str") == data
    empty = cold_tier.put_segment("r/empty", b"", meta={})
    assert (empty.size, empty.checksum) == (0, _xxh(b""))
    assert cold_tier.read("r/empty") == b""
    assert cold_tier.read_range("r/empty", -64, 64) == b""
    assert [s.name for s in cold_tier.list_segments("r/")] == ["r/empty", "r/from-path", "r/from-str"]


def test_idempotent_reput(cold_tier: ColdTier, tmp_path: Path) -> None:
    data = os.urandom(4096)
    first = cold_tier.put_segment("r/seg", data, meta={"n": 1})
    time.sleep(0.01)
    again = cold_tier.put_segment("r/seg", data, meta={"n": 1})
    assert again == first  # skipped: the stored marker (same created time) comes back
    p = tmp_path / "same.bin"
    p.write_bytes(data)
    assert cold_tier.put_segment("r/seg", p, meta={"n": 1}) == first
    with pytest.raises(ColdTierError, match="already committed with different bytes"):
        cold_tier.put_segment("r/seg", data + b"!", meta={})
    assert cold_tier.read("r/seg") == data
    cold_tier.delete_segment("r/seg")
    replaced = cold_tier.put_segment("r/seg", b"new", meta={})
    assert cold_tier.read("r/seg") == b"new" and replaced.size == 3
    assert len(cold_tier.list_segments()) == 1


def test_marker_last_uncommitted_object_not_listed(cold_env: ColdEnv, cold_tier: ColdTier) -> None:
    # A crash between the object and its marker leaves just the object: not a segment.
    cold_env.raw_put("r/crashed", b"partial-story")
    assert cold_tier.list_segments() == []
    assert cold_tier.segment_info("r/crashed") is None
    with pytest.raises(RecordNotFoundError):
        cold_tier.read("r/crashed", verify=True)
    # The re-put overwrites it and commits.
    info = cold_tier.put_segment("r/crashed", b"whole-story", meta={})
    assert cold_tier.list_segments() == [info]
    assert cold_tier.read("r/crashed", verify=True) == b"whole-story"
    # A marker whose object vanished, or whose object has another size, is not listed either.
    cold_tier.put_segment("r/lost", b"abc", meta={})
    cold_env.raw_delete("r/lost")
    cold_tier.put_segment("r/swapped", b"abc", meta={})
    cold_env.raw_put("r/swapped", b"abcdef")
    assert [s.name for s in cold_tier.list_segments()] == ["r/crashed"]
    # Re-putting the committed bytes repairs both.
    cold_tier.put_segment("r/lost", b"abc", meta={})
    cold_tier.put_segment("r/swapped", b"abc", meta={})
    assert [s.name for s in cold_tier.list_segments()] == ["r/crashed", "r/lost", "r/swapped"]
    assert cold_tier.read("r/swapped", verify=True) == b"abc"


def test_objects_without_a_marker_are_removed_once_older_than_the_given_age(
    cold_env: ColdEnv, cold_tier: ColdTier
) -> None:
    """What a crashed upload (the object, no marker) or a crash between delete_segment's marker and
    object deletes leaves was never reclaimed: invisible to listings, it stayed forever. Such an
    object is removed once it is older than the age given (younger: an upload may be under way);
    committed segments, documents and other prefixes are never touched."""
    committed = cold_tier.put_segment("r/segs/a.seg", b"committed", meta={})
    cold_env.raw_put("r/segs/crashed.seg", b"crashed upload")
    cold_tier.put_segment("r/segs/half-deleted.seg", b"half deleted", meta={})
    cold_env.raw_delete("r/segs/half-deleted.seg.commit")  # delete_segment's first step, then a crash
    cold_env.raw_put("other/segs/x.seg", b"another prefix")
    cold_tier.put_doc("r/segs/doc.json", {"a": 1})
    assert cold_tier.remove_uncommitted(timedelta(hours=1), prefix="r/") == {}  # young: kept
    orphans = {"r/segs/crashed.seg": 14, "r/segs/half-deleted.seg": 12}
    assert cold_tier.remove_uncommitted(timedelta(0), prefix="r/", dry_run=True) == orphans
    assert all(cold_env.object_exists(n) for n in orphans)
    assert cold_tier.remove_uncommitted(timedelta(0), prefix="r/") == orphans
    assert not any(cold_env.object_exists(n) for n in orphans)
    assert cold_tier.list_segments() == [committed] and cold_tier.read("r/segs/a.seg", verify=True) == b"committed"
    assert cold_env.object_exists("other/segs/x.seg") and cold_tier.get_doc("r/segs/doc.json") == {"a": 1}
    assert cold_tier.remove_uncommitted(timedelta(0), prefix="r/") == {}  # idempotent
    with pytest.raises(TypeError, match="timedelta"):
        cold_tier.remove_uncommitted(3600, prefix="r/")  # type: ignore[arg-type]


def test_large_segment_goes_multipart(cold_env: ColdEnv, cold_tier: ColdTier, tmp_path: Path) -> None:
    size = 2 * cold_env.part_size + 123_457  # 3 parts: 5 MiB, 5 MiB, the rest
    assert size > cold_env.multipart_threshold
    data = os.urandom(size)
    p = tmp_path / "big.seg"
    p.write_bytes(data)
    info = cold_tier.put_segment("run/act_0_1/big", p, meta={"parts": 3})
    assert (info.size, info.checksum) == (size, _xxh(data))
    assert cold_tier.read("run/act_0_1/big", verify=True) == data
    boundary = cold_env.part_size - 100
    assert cold_tier.read_range("run/act_0_1/big", boundary, 300) == data[boundary : boundary + 300]
    assert cold_tier.read_range("run/act_0_1/big", -64, 64) == data[-64:]
    # from memory too (sliced without copying the whole buffer)
    cold_tier.put_segment("run/act_0_1/big-mem", memoryview(data), meta={})
    assert cold_tier.read("run/act_0_1/big-mem") == data
    if cold_env.server is not None:
        # S3 marks a multipart object's ETag with "-<number of parts>".
        head = cold_env.client().head_object(Bucket=cold_env.server.bucket, Key=f"{cold_env.prefix}/run/act_0_1/big")
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]
        assert head["ContentLength"] == size
        assert cold_env.multipart_uploads() == []  # completed, nothing dangling


def test_docs_roundtrip(cold_tier: ColdTier) -> None:
    assert cold_tier.get_doc("run1/checkpoints/stage00000/000000000010.json") is None
    doc = {"stage": 0, "iteration": 10, "path": "s3://b/ckpt/0/10", "nested": {"a": [1, 2]}}
    cold_tier.put_doc("run1/checkpoints/stage00000/000000000010.json", doc)
    cold_tier.put_doc("run1/checkpoints/stage00001/000000000010.json", {"stage": 1})
    cold_tier.put_doc("run1/gaps/act_0_1/x.json", {"gap": True})
    assert cold_tier.get_doc("run1/checkpoints/stage00000/000000000010.json") == doc
    assert cold_tier.list_docs("run1/checkpoints/") == [
        "run1/checkpoints/stage00000/000000000010.json",
        "run1/checkpoints/stage00001/000000000010.json",
    ]
    assert len(cold_tier.list_docs()) == 3
    cold_tier.put_doc("run1/gaps/act_0_1/x.json", {"gap": False})  # replace atomically
    assert cold_tier.get_doc("run1/gaps/act_0_1/x.json") == {"gap": False}
    # docs and segments never see each other
    cold_tier.put_segment("run1/checkpoints/seg", b"s", meta={})
    assert [s.name for s in cold_tier.list_segments()] == ["run1/checkpoints/seg"]
    assert "run1/checkpoints/seg" not in cold_tier.list_docs("run1/")
    cold_tier.delete_doc("run1/gaps/act_0_1/x.json")
    cold_tier.delete_doc("run1/gaps/act_0_1/x.json")  # idempotent
    assert cold_tier.get_doc("run1/gaps/act_0_1/x.json") is None
    assert cold_tier.list_docs("run1/gaps/") == []


BAD_NAMES = ["", "/abs/x", "a//b", "../x", "a/../b", "a/./b", "a/", ".hidden", "a/.b", "a b", "a\\b", "ü", "x" * 129]


def test_invalid_names_rejected(cold_env: ColdEnv, cold_tier: ColdTier) -> None:
    for bad in BAD_NAMES:
        for call in (
            lambda bad=bad: cold_tier.put_segment(bad, b"x", meta={}),
            lambda bad=bad: cold_tier.read(bad),
            lambda bad=bad: cold_tier.read_range(bad, 0, 1),
            lambda bad=bad: cold_tier.delete_segment(bad),
            lambda bad=bad: cold_tier.segment_info(bad),
            lambda bad=bad: cold_tier.put_doc(bad, {}),
            lambda bad=bad: cold_tier.get_doc(bad),
            lambda bad=bad: cold_tier.delete_doc(bad),
        ):
            with pytest.raises(InvalidNameError):
                call()
    # nothing was written anywhere
    if cold_env.root is not None:
        assert not cold_env.root.exists() or list(cold_env.root.rglob("*")) == []
    else:
        assert cold_env.client().list_objects_v2(Bucket=cold_env.server.bucket, Prefix=cold_env.prefix)["KeyCount"] == 0


def test_invalid_segment_name_and_prefix(cold_tier: ColdTier) -> None:
    with pytest.raises(InvalidNameError, match="reserved"):
        cold_tier.put_segment("r/seg.commit", b"x", meta={})
    for bad in ("/r", "../", "r/../", "r//", "r/.tmp"):
        with pytest.raises(InvalidNameError):
            cold_tier.list_segments(bad)
        with pytest.raises(InvalidNameError):
            cold_tier.list_docs(bad)
    with pytest.raises(TypeError):
        cold_tier.put_segment("r/s", b"x", meta={"bad": object()})
    with pytest.raises(TypeError):
        cold_tier.put_segment("r/s", 12345, meta={})  # type: ignore[arg-type]
    assert cold_tier.list_segments() == []


@pytest.mark.parametrize(
    "url",
    [
        "file://relative/dir",
        "ftp://host/x",
        "s3://B_ad/x",
        "s3://bucket/../x",
        "s3://bucket/a//b",
        "",
        "s3:/logs/swiftlog",
        "file:/abs/dir",
    ],
)
def test_bad_urls_rejected(url: str) -> None:
    with pytest.raises(ConfigError):
        ColdTier(url)


def test_bad_config_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="part_size"):
        ColdTier(str(tmp_path), part_size=MiB)
    with pytest.raises(ConfigError, match="retries"):
        ColdTier(str(tmp_path), retries=-1)
    tier = ColdTier(str(tmp_path / "plain"))  # plain paths are accepted
    assert tier.url == "file://" + str(tmp_path / "plain")


def test_delete_not_found_ok(cold_tier: ColdTier) -> None:
    cold_tier.delete_segment("never/was/there")
    cold_tier.delete_doc("never/was/there")
    cold_tier.put_segment("r/s", b"1", meta={})
    cold_tier.delete_segment("r/s")
    cold_tier.delete_segment("r/s")
    assert cold_tier.list_segments() == []


def test_missing_raises_record_not_found(cold_tier: ColdTier) -> None:
    for call in (lambda: cold_tier.read("r/missing"), lambda: cold_tier.read_range("r/missing", -64, 64)):
        with pytest.raises(RecordNotFoundError) as ei:
            call()
        assert ei.value.key == "r/missing"
        assert not ei.value.retryable
    with pytest.raises(RecordNotFoundError):
        cold_tier.read_range("r/missing", 0, 0)


def test_listing_reflects_deletes(cold_tier: ColdTier) -> None:
    for i in range(4):
        cold_tier.put_segment(f"run/act_0_1/seg-{i:03d}", bytes([i]) * (i + 1), meta={"i": i})
    assert len(cold_tier.list_segments("run/")) == 4
    cold_tier.delete_segment("run/act_0_1/seg-001")
    cold_tier.delete_segment("run/act_0_1/seg-003")
    assert [s.meta["i"] for s in cold_tier.list_segments("run/")] == [0, 2]
    with pytest.raises(RecordNotFoundError):
        cold_tier.read("run/act_0_1/seg-001")
    # a second tier on the same root (a store reopening after a crash) sees the same state
    assert [s.name for s in cold_tier.list_segments()] == ["run/act_0_1/seg-000", "run/act_0_1/seg-002"]


def test_concurrent_threads(cold_env: ColdEnv, cold_tier: ColdTier) -> None:
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(5):
                cold_tier.put_segment(f"run/t{t}/seg-{i}", f"{t}-{i}".encode() * 100, meta={"t": t})
                cold_tier.list_segments(f"run/t{t}/")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert len(cold_tier.list_segments("run/")) == 20
    other = cold_env.make()  # another client on the same root sees everything
    assert other.read("run/t3/seg-4") == b"3-4" * 100


def test_closed_tier_refuses(cold_env: ColdEnv) -> None:
    tier = cold_env.make()
    tier.close()
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.list_segments()


def _use_in_forked_child(tier: ColdTier, q: multiprocessing.Queue) -> None:
    import gc

    from logstore.cold import _s3

    try:
        tier.put_segment("run/from-child", b"child", meta={})
        q.put(("ok", [s.name for s in tier.list_segments()]))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e)))
    # Finalize everything inherited from the parent, as a child's normal exit may: this must not
    # disturb the parent's connections (they share sockets and the epoll instance).
    _s3._inherited_clients.clear()
    gc.collect()


def test_usable_after_fork_and_parent_unharmed(cold_tier: ColdTier, caplog: pytest.LogCaptureFixture) -> None:
    cold_tier.put_segment("run/from-parent", b"parent", meta={})
    assert len(cold_tier.list_segments()) == 1  # the parent now holds pooled connections
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_use_in_forked_child, args=(cold_tier, q))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert q.get(timeout=5) == ("ok", ["run/from-child", "run/from-parent"])
    with caplog.at_level("DEBUG", logger="logstore.cold"):
        assert [s.name for s in cold_tier.list_segments()] == ["run/from-child", "run/from-parent"]
        assert cold_tier.read("run/from-child") == b"child"
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert not retries, f"the parent's client was disturbed by the child: {retries}"


# ---------------------------------------------------------------------------------------------
# fault (a): an uploader SIGKILLed mid-multipart
# ---------------------------------------------------------------------------------------------
def _doomed_uploader(env: ColdEnv, name: str, path: str, conn: object) -> None:
    """Runs in a forked child (a crash-prone uploader): uploads ``path``, announces each part,
    then waits to be killed."""
    from logstore.cold import _file, _s3

    def hang_after_part(self: object, key: str, number: int) -> None:
        conn.send(f"PART {number}")  # type: ignore[attr-defined]
        time.sleep(300)  # the parent SIGKILLs us here

    _s3.S3Backend._after_part = hang_after_part  # type: ignore[method-assign]
    _file.FileBackend._after_part = hang_after_part  # type: ignore[method-assign]
    tier = env.make()  # a fresh client in this process, same small parts
    tier.put_segment(name, path, meta={"by": "doomed child"})
    conn.send("DONE")  # type: ignore[attr-defined]


def _reupload_in_forked_child(tier: ColdTier, name: str, path: str, q: multiprocessing.Queue) -> None:
    # Uses the parent's tier object: the client must be re-created in this process.
    try:
        info = tier.put_segment(name, path, meta={"by": "second process"})
        q.put(("ok", info.size))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e)))


def test_sigkill_mid_multipart_upload(cold_env: ColdEnv, tmp_path: Path) -> None:
    name = "run/act_0_1/seg-big"
    size = 2 * cold_env.part_size + 4321
    data = os.urandom(size)
    src = tmp_path / "big.seg"
    src.write_bytes(data)
    tier = cold_env.make()
    tier.list_segments()  # the parent has a live client before forking below

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_doomed_uploader, args=(cold_env, name, str(src), theirs))
    child.start()
    try:
        said = ours.recv() if ours.poll(60) else "(nothing within 60 s)"
        assert said == "PART 1", f"uploader said {said!r}"
    finally:
        os.kill(child.pid, signal.SIGKILL)  # mid-upload: one part stored, the rest never sent
        child.join(10)
    assert child.exitcode == -signal.SIGKILL

    # Nothing is visible: no object under the name, no committed segment.
    assert not cold_env.object_exists(name)
    assert tier.list_segments() == []
    assert tier.segment_info(name) is None
    with pytest.raises(RecordNotFoundError):
        tier.read_range(name, -64, 64)
    if cold_env.server is not None:
        dangling = cold_env.multipart_uploads()
        assert [u["Key"] for u in dangling] == [f"{cold_env.prefix}/{name}"]
    # A young upload is not stale yet.
    assert tier.abort_stale_uploads(timedelta(hours=1)) == []

    # A new process (forked from this one, reusing its tier object) uploads the same segment.
    q = ctx.Queue()
    proc = ctx.Process(target=_reupload_in_forked_child, args=(tier, name, str(src), q))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert q.get(timeout=5) == ("ok", size)
    [info] = tier.list_segments()
    assert (info.name, info.size, info.checksum, info.meta) == (name, size, _xxh(data), {"by": "second process"})
    assert tier.read(name, verify=True) == data

    # The dead child's upload is reclaimed; the committed segment is untouched.
    assert tier.abort_stale_uploads(timedelta(0), prefix="run/") == [name]
    if cold_env.server is not None:
        assert cold_env.multipart_uploads() == []
    else:
        assert [p.name for p in cold_env.root.rglob(".*")] == []
    assert tier.abort_stale_uploads(timedelta(0)) == []
    assert tier.read(name, verify=True) == data


# ---------------------------------------------------------------------------------------------
# fault (b): the object store goes down and comes back
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cold_env", ["moto", "seaweedfs"], indirect=True)
def test_object_store_down_then_back(cold_env: ColdEnv) -> None:
    server = cold_env.server
    tier = cold_env.make()  # default retries and timeouts
    before = tier.put_segment("run/seg-before", b"before" * 100, meta={})
    tier.put_doc("run/ckpt.json", {"it": 1})

    server.kill()
    try:
        ops = {  # one of each request kind: HEAD bucket, PUT, ranged GET, LIST
            "health": tier.health,
            "put_segment": lambda: tier.put_segment("run/seg-during", b"during", meta={}),
            "read_range": lambda: tier.read_range("run/seg-before", -64, 64),
            "list_segments": tier.list_segments,
        }
        for what, op in ops.items():
            with pytest.raises(ColdTierUnavailableError) as ei:
                op()
            assert f"failed after {1 + tier.retries} attempt(s)" in str(ei.value), (what, str(ei.value))  # no hang
            assert ei.value.retryable
            assert server.endpoint_url in str(ei.value), str(ei.value)
            assert ei.value.__cause__ is not None
    finally:
        server.restart()

    tier.health()
    during = tier.put_segment("run/seg-during", b"during", meta={})
    assert tier.read("run/seg-during") == b"during"
    names = [s.name for s in tier.list_segments("run/")]
    if cold_env.kind == "seaweedfs":  # persistent: everything from before the outage is still there
        assert names == ["run/seg-before", "run/seg-during"]
        assert tier.read("run/seg-before") == b"before" * 100
        assert tier.list_segments()[0] == before
        assert tier.get_doc("run/ckpt.json") == {"it": 1}
    else:  # moto keeps state in memory: the restart emptied it
        assert names == ["run/seg-during"]
        assert tier.list_segments() == [during]


def test_unreachable_endpoint_fails_fast() -> None:
    port = free_port()  # nobody listens here
    tier = ColdTier(
        "s3://nobody-home/x",
        storage_options={"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}},
    )
    attempts = rf"127.0.0.1:{port}.*failed after {1 + tier.retries} attempt\(s\)"
    for op in (tier.health, tier.list_segments):  # each gives up after its retries: a bounded number of attempts
        with pytest.raises(ColdTierUnavailableError, match=attempts):
            op()
    tier.close()


def test_unresponsive_endpoint_times_out() -> None:
    # Accepts connections (the kernel's backlog does) but never answers: only timeouts end this.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        tier = ColdTier(
            "s3://silent/x",
            storage_options={"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}},
            timeout_s=1.0,
        )
        with pytest.raises(ColdTierUnavailableError, match=r"failed after 1 attempt\(s\): ReadTimeoutError"):
            tier.read("a/b")  # the read timed out at timeout_s, the retry deadline too: no second attempt
        tier.close()


class _FlakyS3(http.server.BaseHTTPRequestHandler):
    """Answers 503 SlowDown to the first ``failures`` requests, then serves every GET with ``body``."""

    failures = 0
    body = b"payload"
    requests: list[str] = []

    def _answer(self) -> None:
        type(self).requests.append(self.command)
        if len(type(self).requests) <= type(self).failures:
            err = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("ETag", '"0"')
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_HEAD = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("failures, expect_ok", [(2, True), (100, False)])
def test_5xx_is_retried_then_unavailable(failures: int, expect_ok: bool) -> None:
    handler = type("Flaky", (_FlakyS3,), {"failures": failures, "requests": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    try:
        endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
        tier = ColdTier(
            "s3://flaky/x",
            storage_options={"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint}},
            retries=3,
        )
        if expect_ok:
            assert tier.read("a/b") == b"payload"
            assert len(handler.requests) == 3  # two 503s, then the answer
        else:
            with pytest.raises(ColdTierUnavailableError, match="SlowDown") as ei:
                tier.read("a/b")
            assert ei.value.retryable
            assert len(handler.requests) == 4  # 1 + retries, then it gives up
        tier.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.s3
def test_wrong_credentials_is_not_retryable(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    server = request.getfixturevalue("seaweedfs_server")  # moto accepts any credentials
    if not server.is_running:
        server.restart()
    opts = dict(server.storage_options, secret="not-the-secret")
    tier = ColdTier(server.url("creds"), storage_options=opts)
    with caplog.at_level("DEBUG", logger="logstore.cold"):
        with pytest.raises(ColdTierError) as ei:
            tier.put_segment("r/s", b"x", meta={})
        assert not isinstance(ei.value, ColdTierUnavailableError) and not ei.value.retryable
        with pytest.raises(ColdTierError):
            tier.health()
    assert not [r for r in caplog.records if "retry" in r.getMessage()]  # refused at once, never retried
    tier.close()


# ---------------------------------------------------------------------------------------------
# two uploaders of one segment name (a fenced zombie stage and its replacement)
# ---------------------------------------------------------------------------------------------
def _pause_before(tier: ColdTier, write: str) -> tuple[threading.Event, threading.Event]:
    """Make ``tier`` stop before it writes a segment's object (``write="object"``) or its commit
    marker (``"marker"``) until released: a seam that forces one interleaving of two real uploads."""
    reached, release = threading.Event(), threading.Event()
    backend = tier._backend
    method = "put_stream" if write == "object" else "put_bytes"
    real = getattr(backend, method)

    def paused(key: str, *args: object, **kwargs: object) -> object:
        if write == "object" or key.endswith(".commit"):
            reached.set()
            assert release.wait(60)
        return real(key, *args, **kwargs)

    setattr(backend, method, paused)
    return reached, release


@pytest.mark.parametrize("write", ["marker", "object"])
def test_two_uploaders_of_one_name_never_both_succeed(cold_env: ColdEnv, write: str) -> None:
    """M6: two uploaders of one name at the same moment (a zombie stage thought dead and its
    replacement) could both succeed, leaving the object with the other's marker: the segment was
    no longer listed, and a writer with hot_max_bytes then evicted its only copy. Markers are
    written conditionally and read back: one upload wins, the other gets SegmentClashError, and a
    success whose object was replaced afterwards is not confirmed (never evicted) until re-put."""
    a, b = cold_env.make(), cold_env.make()  # two processes' tiers
    name = "run/segments/act_0_1/000000000000-000000000003.stage0.0000000001.seg"
    data = {"a": os.urandom(5000), "b": os.urandom(5000)}  # one size: only the checksums tell them apart
    reached, release = _pause_before(a, write)
    out: dict[str, object] = {}

    def upload(who: str, tier: ColdTier) -> None:
        try:
            out[who] = tier.put_segment(name, data[who], meta={"who": who})
        except Exception as e:  # noqa: BLE001 - asserted below
            out[who] = e

    t = threading.Thread(target=upload, args=("a", a))
    t.start()
    assert reached.wait(60)
    upload("b", b)
    release.set()
    t.join(60)
    won = [w for w in out if isinstance(out[w], SegmentInfo)]
    assert len(won) == 1, out
    (winner,) = won
    loser = "a" if winner == "b" else "b"
    assert isinstance(out[loser], SegmentClashError), out[loser]
    listed = {s.name: s for s in b.list_segments("run/")}
    assert name not in listed or listed[name].checksum == _xxh(data[winner])  # never the loser's bytes
    if not b.confirm_segment(name, data[winner]):  # the loser's object landed after the winner's commit
        b.put_segment(name, data[winner], meta={"who": winner})  # a re-put of the committed bytes repairs it
    assert b.confirm_segment(name, data[winner]) and not b.confirm_segment(name, data[loser])
    assert b.read(name, verify=True) == data[winner]
    assert [s.checksum for s in b.list_segments("run/")] == [_xxh(data[winner])]


def test_conditional_writes_are_probed(cold_env: ColdEnv) -> None:
    """M6: some S3-compatible stores ignore If-None-Match; a tier probes whether a second
    conditional write is refused and says so (here every backend fences; a store that ignores
    the condition, not runnable here, is stood in for by dropping it)."""
    tier = cold_env.make()
    assert tier.fenced_writes() is True
    lax = cold_env.make()
    real = lax._backend.put_bytes
    lax._backend.put_bytes = lambda key, data, *, exclusive=False: real(key, data)  # type: ignore[method-assign]
    assert lax.fenced_writes() is False
    assert [s.name for s in lax.list_segments()] == []  # the probe leaves nothing behind
