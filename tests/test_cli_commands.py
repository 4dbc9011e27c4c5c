"""The ``swiftlog`` CLI, run as a subprocess (``python -m server.cli``) on a store written by real writer processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from logstore import LogStore
from logstore.hot import HotTier
from logstore.keys import Channel, RecordKey
from server.testing import StoreFixture, sample_tensor, subprocess_env
from tests._cli_helpers import fails as _fails
from tests._cli_helpers import ok as _ok
from tests._cli_helpers import swiftlog, swiftlog_all

pytest_plugins = ["server.pytest_fixtures"]


def test_ls_runs_and_records(written_store: StoreFixture) -> None:
    root = written_store.root
    p, pj, pr, pt = swiftlog_all(
        ("ls", "--root", root),
        ("ls", "--json", {"SWIFTLOG_ROOT": str(root)}),  # SWIFTLOG_ROOT instead of --root
        (
            "ls",
            "--root",
            root,
            "--run",
            "run-a",
            "--kind",
            "gradient",
            "--it-lo",
            "6",
            "--mb",
            "1",
            "--cold-url",
            written_store.cold_url,
            "--limit",
            "2",
            "--all",
            "--json",
        ),
        ("ls", "--root", root, "-r", "run-a", "-c", "act_0_1", "-n", "3"),
    )
    assert "run-a" in _ok(p).stdout and "stage0, stage1, stage2, stage3" in p.stdout
    assert json.loads(_ok(pj).stdout) == {
        "runs": [{"run": "run-a", "writers": ["stage0", "stage1", "stage2", "stage3"]}]
    }
    page = json.loads(_ok(pr).stdout)
    want = [
        str(k)
        for k in written_store.keys()
        if k.channel.kind.name == "GRADIENT" and k.iteration >= 6 and k.micro_batch == 1
    ]
    assert [r["key"] for r in page["records"]] == want and page["next_cursor"] is None
    assert {r["tier"] for r in page["records"]} == {"hot", "cold"}  # stage 3's gradients are cold-only
    table = _ok(pt).stdout
    assert "act_0_1/it0/mb0/p0" in table and "act_0_1/it1/mb0/p0" in table and "more: --cursor" in table


def test_ls_lists_the_hot_tier_with_a_warning_while_the_cold_tier_is_unreachable(written_store: StoreFixture) -> None:
    """An operator lists what the node holds when the object store is down (was exit 4): the hot
    records, a warning on stderr saying the cold tier's are missing, and ``cold_error`` in JSON."""
    from logstore.testing import free_port

    dead = {
        "SWIFTLOG_COLD_OPTIONS": json.dumps(
            {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
    }
    pj, pt = swiftlog_all(
        (
            "ls",
            "--root",
            written_store.root,
            "--run",
            "run-a",
            "--cold-url",
            "s3://gone/x",
            "--all",
            "--limit",
            "500",
            "--json",
            dead,
        ),
        ("ls", "--root", written_store.root, "--run", "run-a", "--cold-url", "s3://gone/x", "-c", "act_0_1", dead),
    )
    assert (
        pj.returncode == pt.returncode == 4 and "Traceback" not in pj.stderr + pt.stderr
    )  # printed, but not the whole run
    page = json.loads(pj.stdout)
    # every record here was written on this node: its index knows even those evicted to the cold tier
    assert [r["key"] for r in page["records"]] == [str(k) for k in written_store.keys()]
    assert {r["tier"] for r in page["records"]} == {"hot", "cold"}
    assert "only the hot tier is listed" in page["cold_error"] and "127.0.0.1" in page["cold_error"]
    assert "cold tier:" in pj.stderr and "only the hot tier is listed" in pt.stderr
    assert "act_0_1/it0/mb0/p0" in pt.stdout


def test_verify_with_the_object_store_unreachable_exits_unavailable(written_store: StoreFixture) -> None:
    """A QA check: verify said "problems found" (1) when the only problem was an object store it could not
    list; like ls and stat it exits 4 (unavailable), after checking the hot tier."""
    from logstore.testing import free_port

    dead = {
        "SWIFTLOG_COLD_OPTIONS": json.dumps(
            {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
    }
    (p,) = swiftlog_all(
        ("verify", "--root", written_store.root, "--run", "run-a", "--cold-url", "s3://gone/x", "--json", dead)
    )
    assert p.returncode == 4 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    rep = json.loads(p.stdout)["runs"][0]
    assert rep["hot_checked"] > 0 and [pr["error"][:16] for pr in rep["problems"]] == ["cannot be listed"], rep[
        "problems"
    ]


def test_stat_says_what_it_cannot_know_while_the_cold_tier_is_unreachable(store_copy: StoreFixture) -> None:
    """Checkpoints are registered in the cold tier: without it, stat printed "checkpoints: none
    registered", "gaps: none" and no watermarks, and exited 0. Now it shows what this node
    registered, names what is incomplete, and exits 4."""
    from logstore.testing import free_port

    with LogStore.open(store_copy.root, store_copy.run, writer="stage1", cold_url=store_copy.cold_url) as s:
        s.register_checkpoint(2, 4, uri="file:///ckpt/stage2/4.pt")
    dead = {
        "SWIFTLOG_COLD_OPTIONS": json.dumps(
            {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
    }
    pj, pt = swiftlog_all(
        ("stat", "--root", store_copy.root, "--run", store_copy.run, "--cold-url", "s3://gone/x", "--json", dead),
        ("stat", "--root", store_copy.root, "--run", store_copy.run, "--cold-url", "s3://gone/x", dead),
    )
    assert pj.returncode == pt.returncode == 4 and "Traceback" not in pj.stderr + pt.stderr, (pj.stderr, pt.stderr)
    doc = json.loads(pj.stdout)
    assert doc["incomplete"] == ["checkpoints", "cold", "gaps", "watermarks"] and "127.0.0.1" in doc["cold"]["error"]
    assert [(c["stage"], c["iteration"]) for c in doc["checkpoints"]] == [(2, 4)] and doc["watermarks"] == [
        {"stage": 2, "iteration": 4}
    ]
    assert "incomplete: checkpoints, cold, gaps" in pt.stdout and "stage 2 @ 4" in pt.stdout
    ok = _ok(
        swiftlog(
            "stat", "--root", store_copy.root, "--run", store_copy.run, "--cold-url", store_copy.cold_url, "--json"
        )
    )
    assert json.loads(ok.stdout)["incomplete"] == []


@pytest.mark.s3
def test_a_cold_tier_that_refuses_is_handled_as_one_that_is_down(written_store: StoreFixture, moto_server) -> None:
    """A missing bucket (or wrong credentials): ls / stat printed nothing from the hot tier and
    exited 4 with the refusal only; now they list what the node holds, as for an outage."""
    env = {"SWIFTLOG_COLD_OPTIONS": json.dumps(moto_server.storage_options)}
    pj, sj = swiftlog_all(
        (
            "ls",
            "--root",
            written_store.root,
            "--run",
            "run-a",
            "--cold-url",
            "s3://no-such-bucket-here/x",
            "-c",
            "act_0_1",
            "--json",
            env,
        ),
        (
            "stat",
            "--root",
            written_store.root,
            "--run",
            "run-a",
            "--cold-url",
            "s3://no-such-bucket-here/x",
            "--json",
            env,
        ),
    )
    assert pj.returncode == sj.returncode == 4, (pj.stderr, sj.stderr)
    page, summary = json.loads(pj.stdout), json.loads(sj.stdout)
    assert page["records"] and "NoSuchBucket" in page["cold_error"]
    assert summary["incomplete"] == ["checkpoints", "cold", "gaps", "watermarks"] and summary["hot"]["records"] > 0


def test_stat_and_show(written_store: StoreFixture) -> None:
    root, cold = written_store.root, written_store.cold_url
    key = RecordKey(Channel.gradient(2), 4, 1)
    sj, st, dj, dt = swiftlog_all(
        ("stat", "--root", root, "--run", "run-a", "--cold-url", cold, "--json"),
        ("stat", "--root", root, "--run", "run-a"),
        ("show", str(key), "--root", root, "--run", "run-a", "--json"),
        ("show", "grad_3_2/it7/mb1", "--root", root, "--run", "run-a", "--cold-url", cold),
    )
    s = json.loads(_ok(sj).stdout)
    assert s["stages"] == [0, 1, 2, 3] and s["cold"]["segments"] > 0 and len(s["gaps"]) == 1
    table = _ok(st).stdout
    assert "grad_2_1" in table and "not configured (--cold-url)" in table and "test: queue overflow" in table
    d = json.loads(_ok(dj).stdout)
    want = sample_tensor(key.channel, 4, 1).to(torch.float64)
    assert d["shape"] == [2, 8, 16] and d["dtype"] == "float32" and d["tier"] == "hot"
    assert d["stats"]["norm"] == pytest.approx(float(want.norm())) and d["stats"]["mean"] == pytest.approx(
        float(want.mean())
    )
    out = _ok(dt).stdout
    assert "cold / stage3" in out and "min / max" in out


def test_export_pt_and_npy(written_store: StoreFixture, tmp_path: Path) -> None:
    key = RecordKey(Channel.activation(1), 2, 0)  # bfloat16: numpy has no such dtype
    want = sample_tensor(key.channel, 2, 0)
    pt, npy = tmp_path / "a.pt", tmp_path / "a.npy"
    common = ("--root", written_store.root, "--run", "run-a")
    p_pt, p_npy, p_fmt = swiftlog_all(
        ("export", str(key), *common, "-o", pt),
        ("export", str(key), *common, "-o", npy, "--json"),
        ("export", str(key), *common, "-o", tmp_path / "a.txt"),
    )
    _ok(p_pt)
    assert torch.equal(torch.load(pt), want) and torch.load(pt).dtype == torch.bfloat16
    meta = json.loads(_ok(p_npy).stdout)
    assert meta["format"] == "npy" and "float32" in meta["note"]
    assert np.array_equal(np.load(npy), want.float().numpy())
    _fails(p_fmt, 2, "*.pt or *.npy")
    _fails(swiftlog("export", str(key), *common, "-o", npy), 2, "exists", "--force")
    # QA checks: a directory that does not exist gave a FileNotFoundError traceback; a bad --format blamed the file name
    no_dir, bad_fmt = swiftlog_all(
        ("export", str(key), *common, "-o", tmp_path / "no" / "such" / "a.pt"),
        ("export", str(key), *common, "-o", tmp_path / "b.pt", "--format", "npz"),
    )
    _fails(no_dir, 2, "cannot write", "directory exists")
    _fails(bad_fmt, 2, "--format 'npz' is not pt or npy")


def test_verify_reports_a_flipped_byte(store_copy: StoreFixture) -> None:
    args = ("--root", store_copy.root, "--run", "run-a", "--cold-url", store_copy.cold_url)
    p = _ok(swiftlog("verify", *args))
    assert "run-a: ok" in p.stdout
    key = RecordKey(Channel.activation(0), 1, 1)
    hot = HotTier(store_copy.root / "run-a" / "stage0", owner=False)
    loc = hot.lookup(key)
    seg = hot.seg_path(loc.segment.id)
    hot.close()
    assert seg.parent.name == "segments" and seg.suffix == ".seg"
    with open(seg, "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    show_args = ("show", str(key), "--root", store_copy.root, "--run", "run-a")
    p, pj, show = swiftlog_all(("verify", *args), ("verify", *args, "--json"), show_args)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "1 problem(s)" in p.stdout and str(key) in p.stdout and "Traceback" not in p.stderr
    rep = json.loads(pj.stdout)
    assert pj.returncode == 1 and rep["ok"] is False and [pr["key"] for pr in rep["runs"][0]["problems"]] == [str(key)]
    # reading it fails loudly, naming the key, and never prints wrong numbers
    _fails(show, 1, str(key), "corrupt")


def test_gc_dry_run_then_confirm(store_copy: StoreFixture) -> None:
    st = LogStore.open(store_copy.root, "run-a", cold_url=store_copy.cold_url)
    st.register_checkpoint(1, 5, uri="file:///ckpt/1/5")
    st.close()
    garbage = [k for k in store_copy.keys() if k.channel.owner == 1 and k.iteration < 5]
    args = ("--root", store_copy.root, "--run", "run-a", "--cold-url", store_copy.cold_url)
    p_dry, p_out = swiftlog_all(("gc", *args, "--json"), ("gc", *args))
    dry = json.loads(_ok(p_dry).stdout)
    assert dry["dry_run"] and sorted(dry["keys"]) == sorted(map(str, garbage))
    out = _ok(p_out).stdout
    assert "would delete" in out and "pass --confirm to delete" in out
    done = json.loads(_ok(swiftlog("gc", *args, "--confirm", "--json")).stdout)
    assert not done["dry_run"] and sorted(done["keys"]) == sorted(map(str, garbage))
    left = json.loads(_ok(swiftlog("ls", *args, "--all", "--json")).stdout)["records"]
    assert len(left) == len(store_copy.keys()) - len(garbage)


def test_flush(store_copy: StoreFixture) -> None:
    _fails(swiftlog("flush", "--root", store_copy.root, "--run", "run-a"), 2, "no cold tier configured", "--cold-url")
    rep = json.loads(
        _ok(
            swiftlog(
                "flush",
                "--root",
                store_copy.root,
                "--run",
                "run-a",
                "--json",
                env={"SWIFTLOG_COLD_URL": store_copy.cold_url},
            )
        ).stdout
    )
    assert rep["uploaded_segments"] > 0 and rep["open_segments"] == []
    out = _ok(swiftlog("flush", "--root", store_copy.root, "--run", "run-a", "--cold-url", store_copy.cold_url)).stdout
    assert "uploaded 0 segment(s)" in out
    # a writer whose index is left out (here truncated) ships nothing: flush says so and exits 1
    # (a QA check: it exited 0)
    data = store_copy.root / "run-a" / "stage0" / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    p = swiftlog("flush", "--root", store_copy.root, "--run", "run-a", "--cold-url", store_copy.cold_url, "--json")
    assert p.returncode == 1 and list(json.loads(p.stdout)["skipped_writers"]) == ["stage0"], (
        p.returncode,
        p.stdout,
        p.stderr[-1000:],
    )


def test_flush_of_an_earlier_incarnations_segments_is_refused_by_name(tmp_path: Path) -> None:
    """`swiftlog flush` on a root whose writer a later incarnation replaced (its uploads hold the
    names): a 409-class refusal (exit 1, "writer_fenced"), not an object-store outage (exit 4)."""
    import torch

    from logstore import Channel, LogStore, RecordKey

    act, cold = Channel.activation(1), f"file://{tmp_path / 'cold'}"
    (tmp_path / "cold").mkdir()
    for root, value in (("zombie", 1.0), ("replacement", 2.0)):
        w = LogStore.open(tmp_path / root, "r1", writer="stage1", cold_url=cold, segment_iters=1, upload=False)
        w.put_many([(RecordKey(act, it, 0), torch.full((4,), value)) for it in range(2)])
        w.close()
    _ok(swiftlog("flush", "--root", tmp_path / "replacement", "--run", "r1", "--cold-url", cold))
    _fails(
        swiftlog("flush", "--root", tmp_path / "zombie", "--run", "r1", "--cold-url", cold),
        1,
        "later incarnation of this writer",
    )


ERRORS = [
    (("ls", "--root", "/nonexistent/swiftlog-root"), 3, "does not exist"),
    (
        ("ls", "--run", "run-a", "--cold-url", "file:///nonexistent/cold"),
        3,
        "cold tier directory '/nonexistent/cold' does not exist",
    ),
    (("stat", "--run", "no-such-run"), 3, "run 'no-such-run' not found"),
    (("stat", "--run", "../etc"), 2, "invalid run id"),
    (("show", "act_0_1/it999", "--run", "run-a"), 3, "not found"),
    (("show", "act_0_9/it1", "--run", "run-a"), 2, "activation channel must go"),
    (("ls", "--run", "run-a", "--cursor", "zz"), 2, "invalid cursor"),
    (("plan", "--run", "run-a", "--stage", "9"), 2, "outside the pipeline"),
    (("plan", "--run", "run-a", "-s", "1", "--root", "/a", "--root", "/b"), 2, "reads one node's store root, got 2"),
    # the planner is pluggable; a missing one says so and exits 4 (unavailable)
    (
        ("plan", "--run", "run-a", "-s", "1", "--planner", "swiftlog_no_such_planner:plan_recovery"),
        4,
        "the recovery planner cannot be loaded",
    ),
]


@pytest.mark.slow
def test_errors_say_what_to_do_and_exit_codes_mean_something(written_store: StoreFixture) -> None:
    env = {"SWIFTLOG_ROOT": str(written_store.root)}
    help_code = "import sys; from server.cli import main; sys.argv = ['swiftlog', '--help']; main()"
    results = swiftlog_all(
        *[(*args, env) for args, _, _ in ERRORS], ("show", "--root", written_store.root), ("--help",)
    )
    for (_args, code, needle), p in zip(ERRORS, results, strict=False):
        _fails(p, code, needle)
    usage, help_ = results[-2:]
    assert usage.returncode == 2 and "Missing" in usage.stderr and "Traceback" not in usage.stderr
    p = subprocess.run(
        [sys.executable, "-c", help_code],
        env=subprocess_env({"COLUMNS": "200"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and help_.returncode == 0 and "Usage: swiftlog" in p.stdout
    for cmd in ("ls", "stat", "show", "export", "verify", "gc", "flush", "plan", "serve", "demo"):
        assert f" {cmd} " in p.stdout and f" {cmd} " in help_.stdout


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    """The recovery demo (short): a stage killed mid-interval is recovered in place, bit-exact. It ends
    with where its stores are and what to try next, with the real paths; the first two suggestions
    (stat, ls) run as printed, and ls says what collected the records (it printed an empty table)."""
    import shlex

    args = ("--dir", tmp_path / "demo", "--iterations", "8", "--checkpoint-every", "4", "-w", "1")
    p = _ok(swiftlog("demo", *args, timeout=240))
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["ok"] is True and report["verification"]["verified"] and report["final_state"]["bit_exact"]
    assert report["plan"]["checkpoint_iteration"] == 4 and report["plan"]["resume_iteration"] == 6
    assert report["global_rollback"]["bit_exact"] and report["global_rollback"]["resumed_s"] > 0
    for f in ("report.json", "report.md", "progress.png"):
        assert (tmp_path / "demo" / f).stat().st_size > 0
    stores = report["stores"]
    swift = tmp_path.resolve() / "demo" / "swift"
    assert stores["cold_url"] == f"file://{swift / 'cold'}" and stores["checkpoints"] == f"file://{swift / 'ckpt'}"
    # every stage's node root, the replacement's too
    assert set(stores["node_roots"]) == {"stage0-g0", "stage1-g0", "stage2-g0", "stage3-g0", "stage2-g1"}
    assert all(Path(r, "demo-run").is_dir() for r in stores["node_roots"].values())
    text = " ".join(p.stdout.split())
    assert "Stores of the SWIFT run" in text and stores["node_roots"]["stage2-g1"] in text
    assert stores["cold_url"] in text
    assert len(report["try"]) == 4 and all(cmd in p.stdout for cmd in report["try"]), p.stdout[-3000:]
    stat, ls = swiftlog_all(*[tuple(shlex.split(cmd)[1:]) for cmd in report["try"][:2]])
    assert "checkpoints" in _ok(stat).stdout and "stage 2 @ 8" in stat.stdout
    assert "garbage collection deleted" in _ok(ls).stdout and "checkpoint at iteration 8" in ls.stdout, ls.stdout


@pytest.mark.slow
def test_demo_with_replicas(tmp_path: Path) -> None:
    """``swiftlog demo --dp 2``: the pipeline as two replicas; a replica lost is copied from the
    other (no replay), every replica of the stage lost is replayed from the logs, both bit-exact,
    side by side in the report and the plot."""
    args = ("--dir", tmp_path / "demo", "--iterations", "8", "--checkpoint-every", "4", "--dp", "2")
    p = _ok(swiftlog("demo", *args, timeout=400))
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["ok"] is True and report["dp_replicate"] == 2 and report["final_state"]["bit_exact"]
    rr = report["replica_recovery"]
    assert (rr["path"], rr["donor"], rr["failed_ranks"], rr["bit_exact"]) == ("replica", 4, [5], True)
    assert rr["state_bytes"] > 0 and rr["gb_per_s"] > 0
    assert report["plan"]["failed_stages"] == [4, 5] and "every replica of stage 2 was lost" in report["plan"]["why"]
    assert set(report["progress"]) == {
        "failure-free",
        "SWIFT: a replica lost, copied",
        "SWIFT: every replica lost, replayed from the logs",
        "global rollback",
    }
    assert "Replica lost" in p.stdout and (tmp_path / "demo" / "progress.png").stat().st_size > 0
