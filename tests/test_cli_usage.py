"""The ``swiftlog`` CLI as a new user meets it: options checked before anything runs, one spelling per
concept, JSON errors under ``--json``, and an empty listing that says why it is empty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logstore import LogStore
from server.testing import StoreFixture
from tests._cli_helpers import fails, json_error, ok, swiftlog, swiftlog_all

pytest_plugins = ["server.pytest_fixtures"]

BAD_URL = "s3:/broken"


def test_demo_refuses_a_phase_it_cannot_inject_before_anything_starts(tmp_path: Path) -> None:
    """`swiftlog demo --phase sideways` trained three times (79 s) and then died with a TypeError in
    the launcher. A closed set of values is a choice now: refused at once, exit 2, nothing created.
    `checkpoint` (a kill that fires only at a checkpoint iteration, never in the demo's interval) is
    not offered either; nor is a failure iteration past the end of the run."""
    d = tmp_path / "demo"
    short = ("--dir", d, "--iterations", "4", "--checkpoint-every", "2")
    sideways, checkpoint, as_json, too_late = swiftlog_all(
        ("demo", *short, "--phase", "sideways"),
        ("demo", *short, "--phase", "checkpoint"),
        ("demo", *short, "--phase", "sideways", "--json"),
        ("demo", "--dir", d, "--iterations", "4", "--checkpoint-every", "3"),
    )
    for p in (sideways, checkpoint):
        assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stdout[-1500:], p.stderr[-1500:])
        assert "--phase" in p.stderr and "forward" in p.stderr and "optimizer" in p.stderr, p.stderr
        assert "1/3" not in p.stdout  # no training started
    err = json_error(as_json, 2, "--phase", "sideways")
    assert err["type"] == "usage" and "forward" in err["message"]
    assert too_late.returncode == 2, (too_late.stdout[-1500:], too_late.stderr[-1500:])
    assert "--checkpoint-every 3" in too_late.stderr and "--iterations 4" in too_late.stderr, too_late.stderr
    assert not d.exists()


@pytest.mark.slow
def test_every_command_taking_cold_url_refuses_a_malformed_one_by_name(tmp_path: Path) -> None:
    """`swiftlog ls --root R --cold-url s3:/broken` exited 0 (the URL was never parsed without --run),
    and `serve` started with it. Every command parses it first: exit 2, naming the URL; the env
    variable is checked the same way."""
    root = tmp_path / "root"
    root.mkdir()
    out = tmp_path / "out.pt"
    r = ("--root", root)
    calls = [
        ("ls", *r),
        ("ls", *r, "--run", "run-a"),
        ("stat", *r, "--run", "run-a"),
        ("show", "act_0_1/it0", *r, "--run", "run-a"),
        ("export", "act_0_1/it0", *r, "--run", "run-a", "-o", out),
        ("verify", *r),
        ("gc", *r, "--run", "run-a"),
        ("flush", *r, "--run", "run-a"),
        ("plan", *r, "--run", "run-a", "-s", "1"),
        ("replay", *r, "--run", "run-a", "-s", "1", "--plan-only"),
        ("serve", *r, "--port", "0"),
    ]
    results = swiftlog_all(*[(*c, "--cold-url", BAD_URL) for c in calls], ("ls", *r, {"SWIFTLOG_COLD_URL": BAD_URL}))
    for call, p in zip([*calls, ("ls", "(env)")], results, strict=True):
        assert p.returncode == 2, (call, p.returncode, p.stdout[-1000:], p.stderr[-1000:])
        assert "Traceback" not in p.stderr and f"'{BAD_URL}'" in p.stderr and "--cold-url" in p.stderr, (call, p.stderr)
    assert "SWIFTLOG_COLD_URL" in results[-1].stderr
    err = json_error(swiftlog("ls", *r, "--cold-url", "gs://bucket/x", "--json"), 2, "gs://bucket/x", "--cold-url")
    assert err["type"] == "usage" and "file:// or s3://" in err["message"]
    assert not out.exists()


def test_json_errors_are_one_json_object_with_the_same_exit_codes(written_store: StoreFixture, tmp_path: Path) -> None:
    """Under --json, errors were plain text on stderr: a script reading stdout got nothing to parse.
    Now every kind is one JSON object on stdout with the exit code the command exits with."""
    root, cold = written_store.root, written_store.cold_url
    common = ("--root", root, "--run", "run-a")
    bad_cursor, bad_format, missing_opt, no_run, no_record, no_root, no_planner, stat_text = swiftlog_all(
        ("ls", *common, "--cursor", "zz", "--json"),
        ("export", "act_0_1/it0", *common, "-o", tmp_path / "a.pt", "--format", "npz", "--json"),
        ("gc", "--root", root, "--json"),
        ("stat", "--root", root, "--run", "no-such-run", "--cold-url", cold, "--json"),
        ("show", "act_0_1/it999", *common, "--json"),
        ("verify", "--root", tmp_path / "nowhere", "--json"),
        ("plan", *common, "-s", "1", "--planner", "swiftlog_no_such_planner:plan_recovery", "--json"),
        ("stat", "--root", root, "--run", "no-such-run"),
    )
    assert json_error(bad_cursor, 2, "invalid cursor")["type"] == "bad_request"
    assert json_error(bad_format, 2, "--format 'npz'")["type"] == "bad_input"
    assert json_error(missing_opt, 2, "--run")["type"] == "usage"
    err = json_error(no_run, 3, "run 'no-such-run' not found")
    assert err["type"] == "run_not_found" and err["key"] == "no-such-run" and "swiftlog ls" in err["hint"]
    assert json_error(no_record, 3, "not found")["key"] == "act_0_1/it999/mb0/p0"
    assert json_error(no_root, 3, "does not exist")["type"] == "not_found"
    assert json_error(no_planner, 4, "the recovery planner cannot be loaded")["type"] == "not_available"
    fails(stat_text, 3, "run 'no-such-run' not found")  # without --json: as before
    assert stat_text.stdout == ""


def test_ls_of_a_run_gc_emptied_says_how_many_records_which_checkpoints_collected(store_copy: StoreFixture) -> None:
    """After `make demo`, `swiftlog ls --run demo-run` printed an empty table: nothing said that the
    checkpoint at the last iteration had made every record garbage. It says how many records GC
    deleted, below which stage's checkpoint; `stat` says it too (and `--json` has the counts)."""
    args = ("--root", store_copy.root, "--run", store_copy.run, "--cold-url", store_copy.cold_url)
    logged = json.loads(ok(swiftlog("ls", *args, "--all", "--limit", "1000", "--json")).stdout)["records"]
    with LogStore.open(store_copy.root, store_copy.run, cold_url=store_copy.cold_url) as st:
        for stage in range(store_copy.stages):
            st.register_checkpoint(stage, store_copy.iterations, uri=f"file:///ckpt/{stage}.pt")
    ok(swiftlog("gc", *args, "--confirm"))
    listing, one_channel, summary, summary_json = swiftlog_all(
        ("ls", *args), ("ls", *args, "-c", "act_0_1"), ("stat", *args), ("stat", *args, "--json")
    )
    out = ok(listing).stdout
    assert f"garbage collection deleted {len(logged)} record(s) logged here" in out, out
    it = store_copy.iterations
    for stage in range(store_copy.stages):
        assert f"below stage {stage}'s checkpoint at iteration {it}" in out, out
    assert f"stage 3 @ {it}" in out and "no records of run run-a are left on this node" in out
    assert "match the filters" in ok(one_channel).stdout
    assert f"garbage collection deleted {len(logged)} record(s)" in ok(summary).stdout
    collected = json.loads(ok(summary_json).stdout)["hot"]["collected"]
    assert sum(c["records"] for c in collected) == len(logged) and {c["below"] for c in collected} == {it}
    assert [c["stage"] for c in collected] == list(range(store_copy.stages))
