"""The trainer client in real 4-stage pipelines (one process per stage, gloo, CPU, GPT with dropout).

(a) every logged send equals what the receiver got (and the receiver's digest of it);
(b) an offline replay of each stage from its checkpoint and the logs reproduces its parameters,
    optimizer and scheduler state bit for bit, for GPipe and 1F1B;
(c) GC after a checkpoint leaves no record below the watermark, in either tier;
(d) logging groups log only group boundaries, and a group replays exactly from them;
(e) a dead cold tier, a full disk and a full queue do not stop or change training and are reported.
"""

from __future__ import annotations

import datetime
import json
import os
import re

import pytest
import torch

from logstore import Channel, RecordKey
from logstore.cold import ColdTier
from logstore.hot import HotTier
from logstore.testing import free_port
from replay import replay_stage, replay_stages
from replay.compare import states_equal
from replay.errors import ReplayInputMissingError
from replay.reader import LogReader
from tests._client_mp import (
    ITERS,
    NUM_STAGES,
    SEED,
    run_pipeline,
    stage_from_checkpoint,
    state_differences,
)
from trainer_client import derive_seed
from trainer_client.commit import loopback_store
from trainer_client.digest import digest_from_record, tensor_digest
from trainer_client.examples.gpt import SyntheticTokens, loss_fn
from trainer_client.meta import decode_meta

CKPT = 2  # checkpoints at 0 and 2; GC makes everything below 2 garbage


@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    return run_pipeline(
        tmp_path_factory.mktemp("gpipe"),
        "gpipe-run",
        schedule="gpipe",
        ckpt_at=f"0,{CKPT}",
        extra=["--record-received"],
    )


@pytest.fixture(scope="module")
def f1b_run(tmp_path_factory):
    return run_pipeline(
        tmp_path_factory.mktemp("1f1b"), "1f1b-run", schedule="1f1b", ckpt_at=f"0,{CKPT}", extra=["--record-received"]
    )


@pytest.fixture(params=[pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def logged_run(request):
    return request.getfixturevalue("gpipe_run" if request.param == "gpipe" else "f1b_run")


def _split(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(t, n))


# ------------------------------------------------------------------------------ (a)
def test_every_logged_send_equals_what_the_receiver_got(logged_run):
    run = logged_run
    store = run.store()
    n_mb = run.gpt.n_microbatches
    checked = 0
    for k in range(NUM_STAGES):
        received = run.results[k]["received"]
        for (it, mb, what), tensors in received.items():
            if it < CKPT:  # garbage-collected after the checkpoint at CKPT
                continue
            src = k - 1 if what == "act" else k + 1
            data_ch = Channel.activation(src) if what == "act" else Channel.gradient(src)
            keys = store.keys(data_ch, it, it + 1)
            assert [key.part for key in keys if key.micro_batch == mb] == list(range(len(tensors)))
            for part, got in enumerate(tensors):
                logged = store.get(RecordKey(data_ch, it, mb, part))
                assert logged.dtype == got.dtype and logged.shape == got.shape
                assert torch.equal(logged, got), f"{data_ch.name} it{it} mb{mb} p{part}"
                digest = digest_from_record(store.get(RecordKey(Channel.digest(src, k), it, mb, part)))
                assert digest == tensor_digest(got)
                checked += 1
    # every boundary of 4 stages, both directions, every micro-batch of every iteration kept
    assert checked == 2 * (NUM_STAGES - 1) * (ITERS - CKPT) * n_mb
    data = SyntheticTokens(run.gpt, seed=SEED)
    for it in range(CKPT, ITERS):
        x, y = data(it)
        for mb, (xm, ym) in enumerate(zip(_split(x, n_mb), _split(y, n_mb), strict=True)):
            assert torch.equal(store.get(RecordKey(Channel.input(0), it, mb)), xm)
            assert torch.equal(store.get(RecordKey(Channel.target(NUM_STAGES - 1), it, mb)), ym)
        for k in range(NUM_STAGES):
            meta = decode_meta(store.get(RecordKey(Channel.meta(k), it, 0)))
            assert meta["schedule"] == ("ScheduleGPipe" if "gpipe" in run.run_id else "Schedule1F1B")
            assert meta["n_microbatches"] == n_mb and meta["grad_scale_factor"] == n_mb
            assert sorted(mb for kind, mb in meta["order"] if kind == "F") == list(range(n_mb))
            assert [mb for kind, mb in meta["order"] if kind == "B"] == list(range(n_mb))
            assert meta["seeds"] == [derive_seed(SEED, k, it, mb) for mb in range(n_mb)]
            assert meta["env"]["num_threads"] == 1
    if "1f1b" in run.run_id:  # 1F1B interleaves: stage 0 does F0..F3 before B0, the last stage F0 B0 F1 B1 ...
        last = decode_meta(store.get(RecordKey(Channel.meta(NUM_STAGES - 1), CKPT, 0)))["order"]
        assert last[:4] == [["F", 0], ["B", 0], ["F", 1], ["B", 1]]
    for k in range(NUM_STAGES):
        w = run.results[k]["stats"]["writer"]
        assert w["faults"] == 0 and w["records_dropped"] == 0 and w["queue_bytes"] == 0
        assert run.results[k]["close"]["ok"], run.results[k]["close"]


# ------------------------------------------------------------------------------ (b)
def test_replay_of_each_stage_is_bit_exact(logged_run):
    run = logged_run
    reader = LogReader(run.store())
    n_mb = run.gpt.n_microbatches
    for k in range(NUM_STAGES):
        state = stage_from_checkpoint(run, k, CKPT)
        report = replay_stage(
            state, reader, num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn, compare_logged=True
        )
        assert state_differences(state, run.results[k]) == [], f"stage {k}"
        sends = (k < NUM_STAGES - 1) + (k > 0)
        assert report.ok, (report.digest_mismatches, report.digests_missing, report.record_mismatches)
        assert report.digests_checked == sends * (ITERS - CKPT) * n_mb
        assert report.records_checked == report.digests_checked
        assert report.micro_batches == (ITERS - CKPT) * n_mb and not report.warnings
        if k == NUM_STAGES - 1:
            live = run.results[k]["losses"][CKPT:]
            assert [sum(v) / len(v) for _, v in sorted(report.losses.items())] == pytest.approx(live, abs=0, rel=1e-12)


# ------------------------------------------------------------------------------ (c)
def test_gc_after_checkpoint_leaves_nothing_below_watermark(logged_run):
    run = logged_run
    store = run.store()
    assert store.watermarks() == {k: CKPT for k in range(NUM_STAGES)}
    for k in range(NUM_STAGES):
        cps = run.results[k]["stats"]["checkpoints"]
        assert [tuple(x[:2]) for x in cps["registered"]] == [(k, 0), (k, CKPT)] and cps["gc_runs"] >= 2
    wm = store.watermarks()
    below, kept = [], 0
    base = os.path.join(run.root, run.run_id)
    for writer in sorted(os.listdir(base)):
        hot = HotTier(os.path.join(base, writer), owner=False)
        try:
            for key, _ in hot.keys():  # noqa: SIM118 - HotTier.keys() lists (key, location) pairs
                kept += 1
                if key.iteration < wm[key.channel.owner]:
                    below.append(str(key))
        finally:
            hot.close()
    assert below == [] and kept > 0
    cold = ColdTier(run.cold_url)
    segs = cold.list_segments(f"{run.run_id}/segments/")
    assert segs, "inputs/targets/meta are shipped to the cold tier every iteration"
    for seg in segs:
        channel = Channel.parse(seg.name.split("/")[-2])
        hi = int(re.match(r"\d+-(\d+)\.", seg.name.split("/")[-1]).group(1))
        assert hi >= wm[channel.owner], f"cold segment {seg.name} is entirely below the watermark"
    # the logs a replay from the older checkpoint would need are gone, and the replay says so
    state = stage_from_checkpoint(run, 1, 0)
    with pytest.raises(ReplayInputMissingError) as ei:
        replay_stage(state, LogReader(store), num_stages=NUM_STAGES, stop_iteration=CKPT, loss_fn=loss_fn)
    assert str(ei.value.key) == "meta_1/it0/mb0/p0"
    with pytest.raises(ReplayInputMissingError) as ei:  # without META the first missing input is named
        replay_stage(
            state,
            LogReader(store),
            num_stages=NUM_STAGES,
            stop_iteration=CKPT,
            loss_fn=loss_fn,
            n_microbatches=run.gpt.n_microbatches,
        )
    assert str(ei.value.key) == "act_0_1/it0/mb0/p0" and "act_0_1" in str(ei.value)


# ------------------------------------------------------------------------------ (d)
def test_logging_groups_log_only_boundaries_and_replay_per_group(tmp_path, f1b_run):
    run = run_pipeline(
        tmp_path, "groups-run", schedule="1f1b", ckpt_at=f"{CKPT}", extra=["--groups", "2,2", "--data-source"]
    )
    store = run.store()
    names = {c.name for c in store.channels()}
    assert names == {"act_1_2", "grad_2_1", "digest_1_2", "digest_2_1", "meta_0", "meta_1", "meta_2", "meta_3"}, names
    sel = {k: run.results[k]["stats"]["selective"] for k in range(NUM_STAGES)}
    act_bytes = run.gpt.micro_batch_size * run.gpt.seq * run.gpt.hidden * 4 * run.gpt.n_microbatches * ITERS
    assert sel[0] == {
        "logging_groups": [2, 2],
        "logged_send_bytes": 0,
        "skipped_send_bytes": act_bytes,
        "skipped_send_records": ITERS * 4,
    }
    assert sel[1]["logged_send_bytes"] == act_bytes and sel[1]["skipped_send_bytes"] == act_bytes  # logs 1->2, not 1->0
    assert sel[2]["logged_send_bytes"] == act_bytes and sel[2]["skipped_send_bytes"] == act_bytes  # logs 2->1, not 2->3
    assert sel[3]["logged_send_bytes"] == 0 and sel[3]["skipped_send_bytes"] == act_bytes
    # the logging configuration never changes what training computes
    for k in range(NUM_STAGES):
        assert states_equal(run.results[k], f1b_run.results[k]) == [], f"stage {k} differs from the fully logged run"
    # each group replays as a unit from the boundary logs, the data source and its checkpoints
    data = SyntheticTokens(run.gpt, seed=SEED)
    reader = LogReader(store)
    for group in ([0, 1], [2, 3]):
        states = [stage_from_checkpoint(run, k, CKPT) for k in group]
        report = replay_stages(
            states, reader, num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn, data_source=data
        )
        for st in states:
            assert state_differences(st, run.results[st.stage]) == [], f"stage {st.stage} of group {group}"
        assert report.ok and report.digests_checked == (ITERS - CKPT) * run.gpt.n_microbatches


# ------------------------------------------------------------------------------ (e)
@pytest.mark.slow
def test_faults_do_not_stop_or_change_training_and_are_reported(tmp_path, gpipe_run):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the object store is down
    per_stage = {
        0: ["--max-queue-bytes", "1024", "--overflow", "wait"],
        1: ["--cold-url", "s3://swiftlog-dead/logs", "--cold-endpoint", dead],
        2: ["--max-queue-bytes", "1024", "--overflow", "gap"],
        3: ["--file-size-limit", "4096"],  # below one activation record: every data write fails
    }
    run = run_pipeline(tmp_path, "faults-run", schedule="gpipe", cold=False, per_stage=per_stage)
    for k in range(NUM_STAGES):  # same numbers as the fault-free run: logging never touches training
        assert states_equal(run.results[k], gpipe_run.results[k]) == [], f"stage {k}"
    w = {k: run.results[k]["stats"]["writer"] for k in range(NUM_STAGES)}
    close = {k: run.results[k]["close"] for k in range(NUM_STAGES)}
    # stage 0: queue bound with "wait": the training thread waited, nothing was lost
    assert (
        w[0]["overflow_waits"] > 0
        and w[0]["records_dropped"] == 0
        and w[0]["queue_peak_bytes"] <= 8192
        and close[0]["ok"]
    )
    # stage 1: object store down: records stay in the hot tier, flush/close report the upload error
    assert w[1]["records_dropped"] == 0 and w[1]["faults_by_kind"] == {"flush": 1}
    assert not close[1]["ok"] and "ColdTierUnavailableError" in close[1]["error"]
    # stage 2: queue bound with "gap": records dropped, each drop is a recorded gap
    assert w[2]["overflow_drops"] > 0 and w[2]["gaps_recorded"] == w[2]["records_dropped"] > 0
    assert w[2]["faults_by_kind"] == {"overflow": w[2]["overflow_drops"]}
    # stage 3: disk full (files capped by RLIMIT_FSIZE): writes fail, counted, training goes on
    assert w[3]["faults_by_kind"].get("store_full", 0) > 0 and w[3]["records_dropped"] > 0 and not close[3]["ok"]
    store = run.store(cold=False)
    gaps = store.gaps()
    assert all(g["reason"] for g in gaps)
    overflow_gaps = [g for g in gaps if g["reason"].startswith("overflow")]
    assert len(overflow_gaps) == w[2]["gaps_recorded"]
    assert {g["channel"] for g in overflow_gaps} <= {"act_2_3", "grad_2_1", "meta_2"}
    json.dumps(run.results[1]["stats"])  # stats stay plain data


def _mismatch_rank(rank: int, port: int, root: str, out: str) -> None:
    """Rank ``rank`` of a two-stage pipeline whose stage 0 runs under bf16 autocast but declares a
    float32 output (a user mistake torch's pipelining does not catch outside its debug mode)."""
    import torch.distributed as dist

    from trainer_client import ClientConfig, SwiftlogClient

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    client = SwiftlogClient(ClientConfig(run_id="mis", stage=rank, num_stages=2, store_root=root))
    mod = torch.nn.Linear(8, 8)
    inp = torch.zeros(2, 8) if rank == 0 else torch.zeros(2, 8, requires_grad=True)
    stage = client.pipeline_stage(mod, "cpu", input_args=inp, output_args=torch.zeros(2, 8, requires_grad=True))
    client.schedule(stage, "gpipe", n_microbatches=2, loss_fn=lambda o, y: ((o.float() - y) ** 2).mean())
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            client.step(0, torch.randn(4, 8), target=torch.randn(4, 8))
        outcome = "stepped"
    except Exception as e:  # rank 0: the client's error; rank 1: its peer went away
        outcome = f"{type(e).__name__}: {e}"
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"outcome": outcome, "faults": [[x.kind, x.message] for x in client.writer.recent_faults()]}, f)
    os._exit(0)  # rank 0 leaves its peer blocked in a receive: closing the sockets ends it


@pytest.mark.slow
def test_a_stage_sending_other_than_it_declared_is_stopped_by_the_client(tmp_path):
    """A bf16 send declared float32 arrived as garbage and training went on (the client only noted a
    fault); the client now raises ConfigError before the send, naming it."""
    import torch.multiprocessing as mp

    host = loopback_store()
    mp.start_processes(
        _mismatch_rank, args=(host.port, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert res[0]["outcome"].startswith(
        "ConfigError: stage 0 sends output 0 as bfloat16 [2, 8] but declared float32 [2, 8]"
    ), res[0]
    assert [k for k, _ in res[0]["faults"]] == ["send_mismatch"]
    assert res[1]["outcome"] != "stepped" and res[1]["faults"] == []


class _Gated(torch.nn.Module):
    """A stage whose forward takes, besides its activations, a keyword mask (a tensor) and a
    keyword constant, as many models take an attention mask on every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        h = self.drop(self.lin(x)) / temperature
        return h if mask is None else h * mask


def _mse(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((o - y) ** 2).mean()


def _kwargs_rank(rank: int, port: int, base: str) -> None:
    """Rank ``rank`` of a two-stage pipeline whose step passes a mask and a temperature to every stage
    (torch's schedules hand a step's keyword inputs to each stage's forward)."""
    import torch.distributed as dist

    from trainer_client import ClientConfig, SwiftlogClient

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    client = SwiftlogClient(
        ClientConfig(
            run_id="kw", stage=rank, num_stages=2, seed=3, store_root=f"{base}/n{rank}", cold_url=f"file://{base}/cold"
        ),
        commit_store=store,
    )
    torch.manual_seed(rank)
    mod = _Gated()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
    inp = torch.zeros(2, 8) if rank == 0 else torch.zeros(2, 8, requires_grad=True)
    stage = client.pipeline_stage(mod, "cpu", input_args=inp, output_args=torch.zeros(2, 8, requires_grad=True))
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=_mse)
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt)
        g = torch.Generator().manual_seed(100 + it)
        x, y, mask = (
            torch.randn(4, 8, generator=g),
            torch.randn(4, 8, generator=g),
            (torch.rand(4, 8, generator=g) > 0.3).float(),
        )
        client.step(it, x, target=y, mask=mask, temperature=0.5)  # the same call on every stage
        client.commit(it)
        opt.step()
        opt.zero_grad(set_to_none=True)
    client.close()
    torch.save({"model": mod.state_dict(), "uri": uri}, f"{base}/final{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_keyword_inputs_that_reach_every_stage_are_logged_and_replayed(tmp_path):
    """A step's keyword inputs reach every stage's forward. Tensors among them are logged by each
    stage (``input_k``, names in META) and JSON constants go into META, so a replay of any stage
    passes them again: both stages replay bit-exact and verified."""
    import torch.multiprocessing as mp

    from logstore import LogStore
    from replay.stage import StageState
    from trainer_client import load_checkpoint

    host = loopback_store()
    mp.start_processes(_kwargs_rank, args=(host.port, str(tmp_path)), nprocs=2, start_method="spawn")
    stores = [LogStore.open(tmp_path / f"n{k}", "kw", cold_url=f"file://{tmp_path}/cold") for k in (0, 1)]
    meta1 = decode_meta(stores[1].get(RecordKey(Channel.meta(1), 2, 0)))
    assert meta1["input_kwargs"] == ["mask"] and meta1["input_consts"] == {"temperature": 0.5}
    from replay import plan_recovery

    plan = plan_recovery(stores, [1], target_iteration=4)  # the planner fetches them too
    assert plan.possible and ("input_1", "input") in {(f.channel, f.purpose) for f in plan.units[0].fetch}
    for k in (0, 1):
        final = torch.load(tmp_path / f"final{k}.pt", weights_only=False)
        mod = _Gated()
        opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
        rep = replay_stage(
            StageState.from_checkpoint(load_checkpoint(final["uri"]), mod, opt),
            LogReader(stores),
            num_stages=2,
            stop_iteration=4,
            loss_fn=_mse,
        )
        assert rep.ok and rep.digests_checked == rep.sends_generated > 0, (k, rep.to_dict())
        assert all(torch.equal(v, final["model"][n]) for n, v in mod.state_dict().items()), k
    for s in stores:
        s.close()
