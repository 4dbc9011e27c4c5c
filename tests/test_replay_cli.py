"""``swiftlog replay`` (server/cli/replay.py) and ``swiftlog plan`` over the replay planner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from server.cli import app
from tests._replay_helpers import CKPT, EXAMPLE_MODEL, ITERS, checkpoint_vs_live
from trainer_client import load_checkpoint
from trainer_client.commit import loopback_store

pytest_plugins = ["tests._replay_fixtures"]

runner = CliRunner()


def _args(run, *extra: str) -> list[str]:
    return [
        "replay",
        "--run",
        run.run_id,
        "--root",
        run.root,
        "--cold-url",
        run.cold_url,
        "--model",
        EXAMPLE_MODEL,
        *extra,
    ]


def test_plan_only_then_replay_writes_a_verified_checkpoint(f1b_run, tmp_path):
    r = runner.invoke(app, _args(f1b_run, "-s", "1", "--plan-only", "--json"))
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["possible"] and plan["units"][0]["checkpoint_iteration"] == CKPT and plan["target_iteration"] == ITERS
    text = runner.invoke(app, _args(f1b_run, "-s", "1", "--plan-only"))
    assert text.exit_code == 0 and "replay [2, 6)" in text.stdout and "act_0_1" in text.stdout
    r = runner.invoke(app, _args(f1b_run, "-s", "1", "-o", str(tmp_path / "out"), "--model-arg", "dropout=0.1"))
    assert r.exit_code == 0, r.output
    assert "verified (32/32 sends checked)" in r.stdout and "stage 1: file://" in r.stdout
    uri = r.stdout.split("stage 1: ")[1].split()[0]
    assert checkpoint_vs_live(load_checkpoint(uri), f1b_run.results[1]) == []


def test_parallel_replay_from_the_cli_json(f1b_run, tmp_path):
    r = runner.invoke(app, _args(f1b_run, "-s", "2", "-o", str(tmp_path), "-w", "2", "--json", "--no-shared-memory"))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] and doc["results"][0]["workers"] == 2 and doc["results"][0]["exact"]
    assert doc["results"][0]["chain"] == "gloo"  # as asked (the default forms the sums in shared memory)


def test_impossible_plans_and_bad_input_exit_nonzero(f1b_run, gap_run, tmp_path):
    r = runner.invoke(
        app,
        [
            "replay",
            "--run",
            gap_run.run_id,
            "--root",
            gap_run.root,
            "--cold-url",
            gap_run.cold_url,
            "-s",
            "1",
            "-t",
            str(ITERS),
            "-o",
            str(tmp_path),
            "--model",
            EXAMPLE_MODEL,
        ],
    )
    assert (
        r.exit_code == 1
        and "IMPOSSIBLE" in r.stdout
        and "gap was recorded" in r.stdout
        and "fallback: restart every stage" in r.stdout
    )
    assert not any(tmp_path.iterdir())
    r = runner.invoke(app, _args(f1b_run, "-s", "1"))
    assert r.exit_code == 2 and "--output is required" in r.output
    # no silent default: the stage factory is named, or the replay does not start
    no_model = ["replay", "--run", f1b_run.run_id, "--root", f1b_run.root, "-s", "1", "-o", str(tmp_path)]
    r = runner.invoke(app, no_model)
    assert r.exit_code == 2 and "--model is required" in r.output, r.output
    r = runner.invoke(app, _args(f1b_run, "-s", "9", "--plan-only"))
    assert r.exit_code == 2 and "outside the pipeline" in r.output
    r = runner.invoke(
        app, ["replay", "--run", "x", "-s", "1", "--plan-only"], env={"SWIFTLOG_ROOT": "", "SWIFTLOG_COLD_URL": ""}
    )
    assert r.exit_code == 2 and "no log source" in r.output
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = runner.invoke(
        app, _args(f1b_run, "-s", "1", "-o", str(blocker / "out"))
    )  # refused before the replay, not when writing
    assert r.exit_code == 2 and "--output" in r.output and "is not a directory swiftlog can write in" in r.output, (
        r.output
    )
    r = runner.invoke(
        app, _args(f1b_run, "-s", "1", "-o", str(tmp_path / "o"), "--loss", "tests._replay_helpers:no_such_loss")
    )
    assert r.exit_code == 2 and "--loss" in r.output and "no_such_loss" in r.output, (
        r.output
    )  # stage 1 needs no loss: named all the same
    blocker.unlink()
    r = runner.invoke(app, _args(f1b_run, "-s", "1", "-o", str(tmp_path), "--device", "gpu0"))
    assert r.exit_code == 2 and "'gpu0' is not a torch device" in r.output
    r = runner.invoke(app, _args(f1b_run, "-s", "1", "-o", str(tmp_path), "--device", "cuda", "-w", "2"))
    assert r.exit_code == 2 and "parallel replay exchanges gradients over gloo" in r.output
    assert not any(tmp_path.iterdir())


def test_swiftlog_plan_uses_the_replay_planner(f1b_run):
    args = ["plan", "--root", f1b_run.root, "--run", f1b_run.run_id, "--cold-url", f1b_run.cold_url, "-s", "2"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (
        doc["planner"] == "replay.plan:plan_recovery"
        and doc["plan"]["possible"]
        and doc["plan"]["units"][0]["stages"] == [2]
    )
    text = runner.invoke(app, args)
    assert text.exit_code == 0 and "stages [2]: replay [2, 6)" in text.stdout and "{" not in text.stdout, (
        text.output
    )  # text, as replay --plan-only


def test_plan_and_replay_spell_each_option_alike_and_plans_old_spelling_still_works(f1b_run):
    """`plan --failed/-f` and `replay --stage/-s` named one thing twice, and -t and -w existed on replay
    only. Both take --stage/-s, --target-iteration/-t and --workers/-w now; plan's --failed/-f still
    works (hidden from --help) and says it is deprecated."""
    base = ["--root", f1b_run.root, "--run", f1b_run.run_id, "--cold-url", f1b_run.cold_url]
    plan = runner.invoke(app, ["plan", *base, "-s", "1", "-t", str(ITERS), "-w", "2", "--json"])
    assert plan.exit_code == 0, plan.output
    replay = runner.invoke(app, ["replay", *base, "-s", "1", "-t", str(ITERS), "-w", "2", "--plan-only", "--json"])
    assert replay.exit_code == 0, replay.output
    p, r = json.loads(plan.stdout)["plan"], json.loads(replay.stdout)
    assert p["failed_stages"] == r["failed_stages"] == [1] and p["target_iteration"] == r["target_iteration"] == ITERS
    assert p["units"][0]["estimate"]["workers"] == r["units"][0]["estimate"]["workers"] == 2
    old = runner.invoke(
        app, ["plan", *base, "--failed", "1", "--target-iteration", str(ITERS), "--workers", "2", "--json"]
    )
    assert old.exit_code == 0, old.output
    timeless = lambda d: {k: v for k, v in d.items() if k != "planned_at"}  # noqa: E731
    assert timeless(json.loads(old.stdout)["plan"]) == timeless(p)
    assert "--failed/-f is deprecated; use --stage/-s" in old.stderr and "deprecated" not in plan.stderr
    short = runner.invoke(app, ["plan", *base, "-f", "1"])
    assert short.exit_code == 0 and "stages [1]: replay" in short.stdout and "deprecated" in short.stderr, short.output
    both = runner.invoke(app, ["plan", *base, "-f", "1", "-s", "1"])
    assert both.exit_code == 2 and "--failed/-f and --stage/-s name the same thing" in both.stderr, both.output
    missing = runner.invoke(app, ["plan", *base])
    assert missing.exit_code == 2 and "missing option '--stage'" in missing.stderr, missing.output
    plan_help, demo_help = runner.invoke(app, ["plan", "--help"]), runner.invoke(app, ["demo", "--help"])
    for flag in ("--stage", "-s", "--target-iteration", "-t", "--workers", "-w"):
        assert flag in plan_help.stdout, flag
    assert "--failed" not in plan_help.stdout
    assert "--workers" in demo_help.stdout and "--replay-workers" not in demo_help.stdout


def test_replay_takes_the_failed_stages_meta_from_the_commit_store(f1b_run, tmp_path):
    """The failed stage's META never reached the cold tier (its node died first); the job's commit
    store still holds it (the commit step put it there): ``--commit-store`` hands it to the replay,
    which then uses the stage's own META instead of standing in a neighbour's."""
    import datetime
    from pathlib import Path

    from logstore import Channel, RecordKey
    from logstore.testing import free_port
    from tests._replay_helpers import copy_run_files
    from trainer_client.commit import meta_key

    _, cold = copy_run_files(f1b_run, tmp_path)
    for p in (Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "meta_1").glob("*"):
        p.unlink()
    host = loopback_store(datetime.timedelta(seconds=30))
    with f1b_run.spec().open(f1b_run.run_id) as st:
        for it in range(CKPT, ITERS):
            host.set(
                meta_key(f"swiftlog/{f1b_run.run_id}", 1, it),
                st.get(RecordKey(Channel.meta(1), it, 0)).numpy().tobytes(),
            )
    args = ["replay", "--run", f1b_run.run_id, "--cold-url", cold, "-s", "1", "--model", EXAMPLE_MODEL]
    alone = runner.invoke(app, [*args, "-o", str(tmp_path / "a")])
    # alone: a neighbour's META stands in; every send matches, but the last step is unproven: NOT verified, exit 1
    assert (
        alone.exit_code == 1
        and "using stage 0's" in alone.stdout
        and "NOT verified (32/32 sends checked)" in alone.stdout
    ), alone.output
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "b"), "--commit-store", f"127.0.0.1:{host.port}"])
    assert r.exit_code == 0 and "verified" in r.stdout and "warning" not in r.stdout, r.output
    assert checkpoint_vs_live(load_checkpoint(r.stdout.split("stage 1: ")[1].split()[0]), f1b_run.results[1]) == []
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "c"), "--commit-store", f"127.0.0.1:{free_port()}"])
    assert r.exit_code == 4 and "cannot reach the commit store" in r.output and "frame #" not in r.output
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "c"), "--commit-store", "nowhere"])
    assert r.exit_code == 2 and "is not HOST:PORT" in r.output


def test_without_the_cold_tier_the_failed_stages_checkpoint_is_unknown_and_the_plan_says_where_it_is(f1b_run, tmp_path):
    """The failed node's store is gone and the cold tier not given: the survivors' stores register
    only their own checkpoints. The plan is impossible and says where the failed stage's checkpoint
    is registered (not "restart the run from scratch": other stages' checkpoints are there)."""
    import shutil

    from tests._replay_helpers import copy_run_files

    root, cold = copy_run_files(f1b_run, tmp_path)
    shutil.rmtree(f"{root}/{f1b_run.run_id}/stage1")  # the failed node's hot tier
    r = runner.invoke(app, ["replay", "--run", f1b_run.run_id, "--root", root, "-s", "1", "--plan-only"])
    assert r.exit_code == 1, r.output
    assert "no registered checkpoint of stage(s) [1] in the given stores" in r.stdout and "--cold-url" in r.stdout
    assert "the given stores register no checkpoint of stage(s) [1]" in r.stdout and "if none was ever made" in r.stdout
    r = runner.invoke(
        app, ["replay", "--run", f1b_run.run_id, "--root", root, "--cold-url", cold, "-s", "1", "--plan-only"]
    )
    assert r.exit_code == 0 and "replay [2, 6)" in r.stdout, r.output


def test_a_diverged_replay_writes_nothing(f1b_run, tmp_path):
    """A wrong factory argument (dropout) makes the regenerated sends differ: exit 1, the first
    diverging send named, and no checkpoint written (a wrong state must not be loadable as a
    recovered one, nor overwrite one)."""
    out = tmp_path / "out"
    r = runner.invoke(app, _args(f1b_run, "-s", "1", "-o", str(out), "--model-arg", "dropout=0.3"))
    assert r.exit_code == 1, r.output
    assert "DIVERGED: " in r.stdout and '"channel": "act_1_2"' in r.stdout and f"nothing written to {out}" in r.stdout
    assert not out.exists()


def test_show_prints_a_meta_records_document(f1b_run):
    """``swiftlog show`` of a META record shows its JSON document (which loss, order, seeds...), not byte statistics."""
    from logstore import Channel, RecordKey

    key = str(RecordKey(Channel.meta(3), 3, 0))
    r = runner.invoke(
        app, ["show", key, "--root", f1b_run.root, "--run", f1b_run.run_id, "--cold-url", f1b_run.cold_url, "--json"]
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (
        d["meta"]["stage"] == 3
        and d["meta"]["iteration"] == 3
        and d["meta"]["loss"] == "trainer_client.examples.gpt:loss_fn"
        and d["stats"] is None
    )
    text = runner.invoke(
        app, ["show", key, "--root", f1b_run.root, "--run", f1b_run.run_id, "--cold-url", f1b_run.cold_url]
    )
    assert text.exit_code == 0 and '"schedule": "Schedule1F1B"' in text.stdout and "min / max" not in text.stdout, (
        text.output
    )


def test_an_object_store_outage_plans_and_replays_from_the_hot_tiers(f1b_run, tmp_path):
    """With --cold-url given and the object store down, plan and replay used to exit 4 although
    the node's disk held everything: they now use the hot tiers, say so, and are exact."""
    from logstore.testing import free_port

    dead = {
        "SWIFTLOG_COLD_OPTIONS": json.dumps(
            {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
    }
    args = ["replay", "--run", f1b_run.run_id, "--root", f1b_run.root, "--cold-url", "s3://gone/x", "-s", "1"]
    args += ["--model", EXAMPLE_MODEL]
    r = runner.invoke(app, [*args, "--plan-only", "--json"], env=dead)
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["possible"] and plan["units"][0]["checkpoint_iteration"] == CKPT
    assert any("cannot be read" in w and "planned from that root's hot tiers only" in w for w in plan["warnings"]), (
        plan["warnings"]
    )
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "out"), "--model-arg", "dropout=0.1"], env=dead)
    assert r.exit_code == 0, r.output
    assert "verified (32/32 sends checked)" in r.stdout
    uri = r.stdout.split("stage 1: ")[1].split()[0]
    assert checkpoint_vs_live(load_checkpoint(uri), f1b_run.results[1]) == []
    plan_args = ["plan", "--root", f1b_run.root, "--run", f1b_run.run_id, "--cold-url", "s3://gone/x", "-s", "2"]
    p = runner.invoke(app, plan_args, env=dead)
    assert p.exit_code == 0 and "stages [2]: replay [2, 6)" in p.stdout and "hot tiers only" in p.stdout, p.output


def test_replay_through_node_servers_plans_from_what_the_servers_hold(f1b_run, tmp_path):
    """`--server URL --cold-url C`: the plan used to read only the cold tier (or only the first
    server's planner), so what a survivor had not shipped yet was "missing": replay [2, 2), NOT
    verified. The servers are planned over too, through their API."""
    import shutil
    from pathlib import Path

    from server.testing import ServerProcess
    from tests._replay_helpers import copy_run_files

    root, cold = copy_run_files(f1b_run, tmp_path)
    shutil.rmtree(Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "act_0_1")  # only on the node's disk
    with ServerProcess(Path(root)) as srv:
        args = ["replay", "--run", f1b_run.run_id, "--server", srv.url, "--cold-url", cold, "-s", "1"]
        args += ["--model", EXAMPLE_MODEL]
        p = runner.invoke(app, [*args, "--plan-only", "--json"])
        assert p.exit_code == 0, p.output
        unit = json.loads(p.stdout)["units"][0]
        assert (unit["checkpoint_iteration"], unit["stop_iteration"]) == (CKPT, ITERS)
        assert {(f["channel"], f["tier"]) for f in unit["fetch"] if f["channel"] == "act_0_1"} == {("act_0_1", "hot")}
        r = runner.invoke(app, [*args, "-o", str(tmp_path / "out"), "--model-arg", "dropout=0.1"])
        assert r.exit_code == 0 and "verified (32/32 sends checked)" in r.stdout, r.output
        assert checkpoint_vs_live(load_checkpoint(r.stdout.split("stage 1: ")[1].split()[0]), f1b_run.results[1]) == []
        alone = runner.invoke(
            app, ["replay", "--run", f1b_run.run_id, "--server", srv.url, "-s", "1", "-t", str(ITERS), "--plan-only"]
        )
        assert alone.exit_code == 0 and f"replay [{CKPT}, {ITERS})" in alone.stdout, (
            alone.output
        )  # a target with servers alone


def test_json_errors_of_an_unreachable_commit_store_and_a_corrupt_record(f1b_run, tmp_path):
    """Under --json, errors were plain text: here unavailable (4) from `replay` and problems (1) from a
    record that fails its checksum, each one JSON object on stdout (see also tests/test_cli_usage.py)."""
    from logstore import Channel, RecordKey
    from logstore.hot import HotTier
    from logstore.testing import free_port
    from tests._cli_helpers import json_error, swiftlog_all
    from tests._replay_helpers import copy_run_files

    root, cold = copy_run_files(f1b_run, tmp_path)
    key = RecordKey(Channel.activation(0), 3, 1)
    hot = HotTier(Path(root) / f1b_run.run_id / "stage0", owner=False)
    loc = hot.lookup(key)
    seg = hot.seg_path(loc.segment.id)
    hot.close()
    with open(seg, "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    store, corrupt = swiftlog_all(
        (
            "replay",
            "--run",
            f1b_run.run_id,
            "--cold-url",
            cold,
            "-s",
            "1",
            "-o",
            tmp_path / "o",
            "--commit-store",
            f"127.0.0.1:{free_port()}",
            "--model",
            EXAMPLE_MODEL,
            "--json",
        ),
        ("show", str(key), "--root", root, "--run", f1b_run.run_id, "--json"),
    )
    assert json_error(store, 4, "cannot reach the commit store")["type"] == "unavailable"
    err = json_error(corrupt, 1, str(key))
    assert err["type"] == "corrupt_record" and err["key"] == str(key)


def test_swiftlog_replay_starts_from_a_dcp_checkpoint(dcp_run, tmp_path):
    """A run checkpointed with dcp.async_save: the plan's checkpoint is the DCP pointer the
    registration names, the replay loads it with dcp.load and ends verified and bit-exact."""
    r = runner.invoke(app, _args(dcp_run, "-s", "1", "--plan-only", "--json"))
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["units"][0]["checkpoints"]["1"].endswith(f"/stage00001/it{CKPT:012d}.dcp.json"), plan["units"][0]
    r = runner.invoke(app, _args(dcp_run, "-s", "1", "-o", str(tmp_path / "out"), "--model-arg", "dropout=0.1"))
    assert r.exit_code == 0, r.output
    assert "verified (32/32 sends checked)" in r.stdout
    uri = r.stdout.split("stage 1: ")[1].split()[0]
    assert checkpoint_vs_live(load_checkpoint(uri), dcp_run.results[1]) == []
