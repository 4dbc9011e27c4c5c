"""The ``swiftlog`` CLI as a new user meets it: an empty listing says why it is empty."""

from __future__ import annotations

import json

from logstore import LogStore
from server.testing import StoreFixture
from tests._cli_helpers import ok, swiftlog, swiftlog_all

pytest_plugins = ["server.pytest_fixtures"]

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
