"""The replay engine on logs of real 4-stage pipeline runs (GPipe and 1F1B, dropout on).

Sequential replay of every stage reproduces the live parameters, AdamW state, lr scheduler and
iteration bit for bit and proves it against the receivers' digests; a logging group replays as
one; the cold tier (moto S3), the hot tier and a node server over HTTP feed identical replays;
a corrupt or missing record fails naming it; a perturbed model is caught at its first send.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore import Channel, LogStore, RecordKey
from logstore.errors import CorruptRecordError
from replay import (
    RemoteLogReader,
    ReplayJob,
    ReplayMismatchError,
    SourceSpec,
    jobs_from_plan,
    plan_recovery,
    replay,
    replay_stage,
    replay_stages,
)
from replay._iteration_plan import IterationPlan
from replay._iteration_plan import passes as plan_passes
from replay.core import locate_logs
from replay.errors import ReplayError, ReplayInputMissingError
from replay.reader import LogReader
from replay.stage import ReplayHooks, StageState
from replay.states import build_states, checkpoint_of
from server.testing import ServerProcess
from tests._replay_helpers import (
    CKPT,
    EXAMPLE_MODEL,
    ITERS,
    NUM_STAGES,
    checkpoint_vs_live,
    copy_run_files,
    corrupt_hot_record,
    state_bytes_differ,
)
from trainer_client import load_checkpoint, save_checkpoint
from trainer_client.commit import loopback_store
from trainer_client.examples.factories import gpt_stage
from trainer_client.examples.gpt import loss_fn

pytest_plugins = ["tests._replay_fixtures"]


def _job(run, stage_or_stages, tmp_path: Path, **kw) -> ReplayJob:
    stages = [stage_or_stages] if isinstance(stage_or_stages, int) else list(stage_or_stages)
    kw.setdefault("sources", [run.spec()])
    kw.setdefault("output", str(tmp_path / "out"))
    return ReplayJob(
        run=run.run_id,
        num_stages=NUM_STAGES,
        stages=stages,
        stop_iteration=ITERS,
        checkpoints={k: run.results[k]["checkpoints"][CKPT] for k in stages},
        **{**run.job_fields(), **kw},
    )


@pytest.fixture(params=[pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def any_run(request):
    return request.getfixturevalue("gpipe_s3_run" if request.param == "gpipe" else "f1b_run")


def test_sequential_replay_of_every_stage_is_bit_exact(any_run, tmp_path):
    run = any_run
    n_mb = run.gpt.n_microbatches
    for k in range(NUM_STAGES):
        res = replay(_job(run, k, tmp_path))
        ck = checkpoint_of(res, k)
        assert checkpoint_vs_live(ck, run.results[k]) == [], f"stage {k}"
        assert ck.extra["recovered"]["verified"] is True and ck.extra["recovered"]["from_iteration"] == CKPT
        # the in-memory state is what was written, and the checkpoint it started from was not touched (no aliasing)
        st = res.states[0]
        assert state_bytes_differ(st.module.state_dict(), st.optimizer.state_dict(), ck.model, ck.optimizer) == []
        src = load_checkpoint(run.results[k]["checkpoints"][CKPT], storage_options=run.cold_options or None)
        assert (
            st.checkpoint.iteration == CKPT
            and state_bytes_differ(st.checkpoint.model, st.checkpoint.optimizer, src.model, src.optimizer) == []
        )
        rep = res.report
        sends = (k < NUM_STAGES - 1) + (k > 0)
        assert res.verified and rep.verified and rep.first_mismatch is None
        assert (
            rep.steps_checked == ITERS - CKPT and rep.grad_mismatches == []
        )  # every step's gradients are the live ones
        assert rep.sends_generated == rep.digests_checked == sends * (ITERS - CKPT) * n_mb
        assert rep.micro_batches == (ITERS - CKPT) * n_mb and rep.iterations_done == ITERS - CKPT and rep.warnings == []
        if k == NUM_STAGES - 1:
            live = run.results[k]["losses"][CKPT:]
            assert [sum(v) / len(v) for _, v in sorted(rep.losses.items())] == pytest.approx(live, abs=0, rel=1e-12)
        # the trainer client loads the recovered checkpoint like any other
        mod, opt, sched = gpt_stage(k, NUM_STAGES, ck, **run.gpt.to_dict())
        again = load_checkpoint(res.outputs[k], storage_options=None)
        again.apply(mod, opt, sched)
        assert all(torch.equal(p, run.results[k]["model"][n]) for n, p in mod.state_dict().items())


def test_clipping_to_a_global_norm_replays_bit_for_bit(clip_run, tmp_path):
    """Each stage clipped with the norm over all four stages' gradients; a replay of one stage has
    only its own, so it clips with the logged norm: bit-exact, alone and with two workers."""
    with clip_run.store() as st:
        reader = LogReader(st)
        for it in range(CKPT, ITERS):
            clips = [reader.meta(k, it)["grad_clip"] for k in range(NUM_STAGES)]
            norms = [c[0]["total_norm"] for c in clips]
            assert all(len(c) == 1 and c[0]["max_norm"] == 0.05 and c[0]["params"] is None for c in clips)
            assert min(norms) > 0.05 and max(norms) - min(norms) <= 1e-6 * max(norms)  # active; one global norm
    for stage, workers in ((1, 1), (3, 2)):
        res = replay(_job(clip_run, stage, tmp_path / f"s{stage}", workers=workers))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, stage), clip_run.results[stage]) == [], (
            f"stage {stage}"
        )


def test_a_run_under_autocast_replays_under_it_bit_for_bit(autocast_run, tmp_path):
    with autocast_run.store() as st:
        assert LogReader(st).meta(2, CKPT)["autocast"] == [
            {"device_type": "cpu", "dtype": "bfloat16", "cache_enabled": True}
        ]
    for stage, workers in ((3, 1), (1, 2)):
        res = replay(_job(autocast_run, stage, tmp_path / f"s{stage}", workers=workers))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, stage), autocast_run.results[stage]) == [], (
            f"stage {stage}"
        )


def test_the_report_counts_the_micro_batches_that_ran(f1b_run):
    """``micro_batches`` counts a micro-batch once its backward ran through the replayed stages, not
    the iteration's plan: a replay stopped in the middle of an iteration (here by a hook raising
    after the second backward, as a stop request would) has counted what ran, and a replay that
    ran to the end has counted every micro-batch once."""

    class Stop(Exception):
        pass

    n_mb = f1b_run.gpt.n_microbatches
    seen: list[Any] = []
    ran: list[tuple[int, int]] = []

    def after_backward(it: int, mb: int) -> None:
        ran.append((it, mb))
        if len(ran) == n_mb + 2:
            raise Stop

    ck = load_checkpoint(f1b_run.results[1]["checkpoints"][CKPT])
    state = StageState.from_checkpoint(ck, *gpt_stage(1, NUM_STAGES, ck, **f1b_run.gpt.to_dict()))
    with f1b_run.store() as st, pytest.raises(Stop):
        hooks = ReplayHooks(after_backward=after_backward)
        replay_stages(
            [state],
            st,
            num_stages=NUM_STAGES,
            stop_iteration=ITERS,
            hooks=hooks,
            on_iteration=lambda it, rep: seen.append(rep),
        )
    assert len(seen) == 1 and [it for it, _ in ran] == [CKPT] * n_mb + [CKPT + 1] * 2  # one iteration and two backwards
    assert seen[0].micro_batches == n_mb + 2 and seen[0].iterations_done == 1
    ck = load_checkpoint(f1b_run.results[1]["checkpoints"][CKPT])
    state = StageState.from_checkpoint(ck, *gpt_stage(1, NUM_STAGES, ck, **f1b_run.gpt.to_dict()))
    with f1b_run.store() as st:
        rep = replay_stages([state], st, num_stages=NUM_STAGES, stop_iteration=ITERS)
    assert rep.micro_batches == (ITERS - CKPT) * n_mb and rep.verified


def test_prefetch_does_not_change_the_result_and_progress_is_reported(f1b_run, tmp_path):
    seen = []
    a = replay(_job(f1b_run, 1, tmp_path / "a", prefetch=0))
    b = replay(_job(f1b_run, 1, tmp_path / "b", prefetch=3), on_progress=seen.append)
    assert (
        state_bytes_differ(
            a.states[0].module.state_dict(),
            a.states[0].optimizer.state_dict(),
            b.states[0].module.state_dict(),
            b.states[0].optimizer.state_dict(),
        )
        == []
    )
    assert a.verified and b.verified
    assert [p.done for p in seen] == [1, 2, 3, 4] and {p.total for p in seen} == {ITERS - CKPT}
    assert (
        [p.iteration for p in seen] == list(range(CKPT, ITERS))
        and seen[-1].eta_s == 0
        and all(p.rate > 0 for p in seen)
    )
    assert seen[-1].micro_batches == (ITERS - CKPT) * f1b_run.gpt.n_microbatches
    assert b.report.records_fetched == a.report.records_fetched > 0  # every record read once, ahead or not
    assert b.to_dict()["report"]["verified"] is True


class _ListingCounter:
    """A record source that counts its listings (``keys`` / ``list_records`` calls)."""

    def __init__(self, inner):
        self.inner, self.listings = inner, 0

    def keys(self, *a, **kw):
        self.listings += 1
        return self.inner.keys(*a, **kw)

    def list_records(self, *a, **kw):
        self.listings += 1
        return self.inner.list_records(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_locate_logs_lists_ahead_of_the_replay_and_never_raises(f1b_run, tmp_path):
    with f1b_run.store() as st:
        src = _ListingCounter(st)
        reader = LogReader([src])
        locate_logs(reader, [1], NUM_STAGES, CKPT)
        listed = src.listings
        assert listed > 0 and reader.meta(1, CKPT) is not None
        assert reader.part_keys(Channel.activation(0), CKPT, 0) and reader.part_keys(Channel.gradient(2), CKPT, 1)
        assert src.listings == listed  # the replay's first iteration finds them listed already
    with LogStore.open(tmp_path / "empty", "other-run") as empty:
        locate_logs(LogReader([empty]), [1], NUM_STAGES, CKPT)  # nothing there: left for the replay to report


def test_group_replay_of_two_adjacent_stages(groups_run, f1b_run, tmp_path):
    # a logging group [0, 1] (its inner boundary was not logged) restarts and replays as one
    with groups_run.store() as st:
        plan = plan_recovery(st, [1])
    (job,) = jobs_from_plan(plan, sources=[groups_run.spec()], output=str(tmp_path / "g"), **groups_run.job_fields())
    assert job.stages == [0, 1] and job.stop_iteration == ITERS
    res = replay(job)
    for k in (0, 1):
        assert checkpoint_vs_live(checkpoint_of(res, k), groups_run.results[k]) == [], f"stage {k}"
    assert (
        res.verified and res.report.digests_checked == (ITERS - CKPT) * groups_run.gpt.n_microbatches
    )  # act 1->2 only
    # two adjacent stages of a fully logged run can also replay chained in one process
    res2 = replay(_job(f1b_run, [1, 2], tmp_path / "12"))
    for k in (1, 2):
        assert checkpoint_vs_live(checkpoint_of(res2, k), f1b_run.results[k]) == [], f"stage {k}"
    assert res2.verified and res2.report.digests_checked == 2 * (ITERS - CKPT) * f1b_run.gpt.n_microbatches


@pytest.mark.slow
def test_replay_from_the_cold_tier_equals_replay_from_the_hot_tier(gpipe_s3_run, tmp_path):
    run = gpipe_s3_run
    hot = replay(_job(run, 2, tmp_path / "hot", sources=[run.spec(cold=False)]))
    cold = replay(_job(run, 2, tmp_path / "cold", sources=[run.cold_spec()]))
    assert hot.verified and cold.verified
    a, b = checkpoint_of(hot, 2), checkpoint_of(cold, 2)
    assert state_bytes_differ(a.model, a.optimizer, b.model, b.optimizer) == [] and a.lr_scheduler == b.lr_scheduler
    assert checkpoint_vs_live(b, run.results[2]) == []
    # the cold tier really served it: a cold-only store lists the records and has no hot tier
    with run.cold_store() as st:
        assert st.keys(Channel.activation(1), CKPT, ITERS) and st.stats()["hot"]["records"] == 0


def test_replay_through_a_node_server(f1b_run, tmp_path):
    with ServerProcess(Path(f1b_run.root), cold_url=f1b_run.cold_url) as srv:
        res = replay(_job(f1b_run, 1, tmp_path, sources=[SourceSpec.parse(srv.url)]))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []
        with RemoteLogReader(srv.url, f1b_run.run_id) as reader:
            st = build_states(_job(f1b_run, 2, tmp_path))[0]
            rep = replay_stage(st, reader, num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn, prefetch=1)
            assert rep.verified and rep.records_fetched > 0
            missing = RecordKey(Channel.activation(1), ITERS + 5, 0)
            with pytest.raises(ReplayInputMissingError) as ei:  # the server answers 404 for what it does not have
                reader.get(missing)
            assert ei.value.key == missing and str(missing) in str(ei.value)


@pytest.mark.slow
def test_the_python_api_plans_and_replays_over_a_node_server_and_a_root(f1b_run, tmp_path):
    """README's Python snippet with a node server among the sources: plan_recovery reads it through
    its API, jobs_from_plan turns each source object into its spec, the replay is exact."""
    from replay.remote import HttpRecordSource

    with (
        ServerProcess(Path(f1b_run.root)) as srv,
        HttpRecordSource(srv.url, f1b_run.run_id) as http,
        LogStore.open(f1b_run.root, f1b_run.run_id) as st,
        f1b_run.cold_store() as cold,
    ):
        plan = plan_recovery([http, st, cold], [1])
        # inputs and digests from the server (first, and it holds them hot); the failed stage's own META from
        # the cold tier
        # (its hot copy is on the failed stage's node: read only if nothing else has it)
        assert plan.possible and {(f.purpose, f.source) for f in plan.units[0].fetch} == {
            ("input", 0),
            ("verify", 0),
            ("meta", 2),
        }
        (job,) = jobs_from_plan(plan, sources=[http, st, cold], output=str(tmp_path / "out"), **f1b_run.job_fields())
        assert [(sp.kind, sp.location) for sp in job.sources] == [
            ("http", srv.url),
            ("store", f1b_run.root),
            ("cold", f1b_run.cold_url),
        ]
        res = replay(job)
    assert res.verified and checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []


def test_a_record_on_a_survivors_disk_is_read_there_not_from_the_object_store(f1b_run, tmp_path):
    """Sources in the order cold tier, node root: every record is asked of the node first (its hot
    tier lists it), not of the object store that listed it first (was: all of them from there)."""

    class Counting:  # the run's cold tier, counting what is read from it
        def __init__(self, inner):
            self.inner, self.gets = inner, 0

        def get(self, key):
            self.gets += 1
            return self.inner.get(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with f1b_run.cold_store() as cold, LogStore.open(f1b_run.root, f1b_run.run_id) as node:
        counting = Counting(cold)
        res = replay(_job(f1b_run, 1, tmp_path), sources=[counting, node])
        assert res.verified and res.report.records_fetched > 0 and counting.gets == 0
    assert checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []


def test_a_corrupt_record_fails_the_replay_naming_it(f1b_run, tmp_path):
    root, _ = copy_run_files(f1b_run, tmp_path)
    key = RecordKey(Channel.gradient(3), 4, 2, 0)
    corrupt_hot_record(root, f1b_run.run_id, key)
    src = SourceSpec(kind="store", location=root)  # the node's hot tiers: their copy is the corrupt one
    with pytest.raises(CorruptRecordError) as ei:
        replay(_job(f1b_run, 2, tmp_path, sources=[src], prefetch=2))
    assert str(key) in str(ei.value) and ei.value.key == key
    with LogStore.open(root, f1b_run.run_id) as st:
        plan = plan_recovery(st, [2], check_records=True)
    assert not plan.possible and plan.units[0].missing == [str(key)]


def test_a_missing_record_fails_the_replay_naming_it(f1b_run, tmp_path):
    _, cold = copy_run_files(f1b_run, tmp_path)
    seg_dir = Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "grad_2_1"
    for p in seg_dir.glob("000000000004-*"):
        p.unlink()
    src = SourceSpec(kind="cold", location=cold)
    with pytest.raises(ReplayInputMissingError) as ei:
        replay(_job(f1b_run, 1, tmp_path, sources=[src]))
    assert str(ei.value.key) == "grad_2_1/it4/mb0/p0" and "grad_2_1" in str(ei.value)
    assert not (tmp_path / "out").exists()  # nothing is written when the replay failed


def test_verification_catches_a_perturbed_model(f1b_run, tmp_path):
    job = _job(f1b_run, 2, tmp_path)
    (st,) = build_states(job)
    w = dict(st.module.named_parameters())["blocks.0.fc1.weight"]
    with torch.no_grad():
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))  # one ulp of one weight
    rep = replay_stage(st, LogReader(f1b_run.store()), num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn)
    assert not rep.verified and not rep.ok
    first_mb = 0
    assert rep.first_mismatch == {
        "key": f"act_2_3/it{CKPT}/mb{first_mb}/p0",
        "iteration": CKPT,
        "micro_batch": first_mb,
        "channel": "act_2_3",
        "part": 0,
    }
    with pytest.raises(
        ReplayMismatchError, match=rf"first divergence at iteration {CKPT} micro-batch 0 channel act_2_3"
    ):
        rep.raise_for_mismatch()
    # the same through the engine from a perturbed checkpoint file: the result is not "verified"
    ck = load_checkpoint(job.checkpoints[2])
    bad = copy.deepcopy(ck.model)
    bad["blocks.0.ln2.bias"][3] += 1e-3
    mod, opt, sched = gpt_stage(2, NUM_STAGES, ck, **f1b_run.gpt.to_dict())
    ck.apply(mod, opt, sched)
    mod.load_state_dict(bad)
    uri = save_checkpoint(
        str(tmp_path / "bad.pt"),
        run_id=ck.run_id,
        stage=2,
        num_stages=NUM_STAGES,
        iteration=CKPT,
        seed=ck.seed,
        model=mod,
        optimizer=opt,
        lr_scheduler=sched,
    )
    res = replay(job.replace(checkpoints={2: uri}, output=str(tmp_path / "bad-out")))
    assert not res.verified and res.first_mismatch["iteration"] == CKPT and res.first_mismatch["channel"] == "act_2_3"
    assert (
        res.outputs == {} and not (tmp_path / "bad-out").exists()
    )  # a wrong state is never written as a recovered checkpoint


def test_a_stage_factory_of_the_wrong_shape_is_named(f1b_run, tmp_path):
    """A factory with another signature, or one that returns something else than (module,
    optimizer, scheduler), is a ReplayError naming the factory and the expected form."""
    job = _job(f1b_run, 1, tmp_path)

    def two_args(stage, num_stages, **kw):
        raise AssertionError("never called with two arguments")

    def two_things(stage, num_stages, checkpoint, **kw):
        return gpt_stage(stage, num_stages, checkpoint, **kw)[:2]

    with pytest.raises(
        ReplayError,
        match=r"stage 1: calling the given stage factory failed: TypeError: .*two_args\(\) takes 2 positional "
        r"arguments",
    ) as e:
        build_states(job, factory=two_args)
    assert (
        "fn(stage, num_stages, checkpoint, **model_args) -> (module, optimizer, lr_scheduler or None)" in e.value.hint
    )
    with pytest.raises(
        ReplayError,
        match=r"stage 1: the given stage factory returned a tuple of 2 \(StageModule, AdamW\), not \(module, "
        r"optimizer, lr_scheduler or None\)",
    ):
        build_states(job, factory=two_things)


def test_checkpoints_must_agree(f1b_run, tmp_path):
    job = _job(f1b_run, [1, 2], tmp_path)
    with pytest.raises(ValueError, match="no checkpoint URI"):
        ReplayJob.from_dict({**job.to_dict(), "checkpoints": {"1": job.checkpoints[1]}})
    wrong = job.replace(checkpoints={1: job.checkpoints[2], 2: job.checkpoints[2]})
    with pytest.raises(Exception, match="stage 2, not run"):
        replay(wrong)
    assert ReplayJob.from_dict(job.to_dict()) == job
    states = [
        StageState.from_checkpoint(
            load_checkpoint(job.checkpoints[k]),
            *gpt_stage(k, NUM_STAGES, load_checkpoint(job.checkpoints[k]), **f1b_run.gpt.to_dict()),
        )
        for k in (1, 2)
    ]
    rep = replay_stages(states, f1b_run.store(), num_stages=NUM_STAGES, stop_iteration=CKPT)  # nothing to do is fine
    # and verified: the result is the durable checkpoint (a torchrun restart replays every stage to f, and some
    # are there already)
    assert rep.iterations_done == 0 and rep.micro_batches == 0 and rep.verified
    last = load_checkpoint(
        f1b_run.results[3]["checkpoints"][CKPT]
    )  # the last stage needs no loss function for nothing (it asked for one)
    rep = replay_stages(
        [StageState.from_checkpoint(last, *gpt_stage(3, NUM_STAGES, last, **f1b_run.gpt.to_dict()))],
        f1b_run.store(),
        num_stages=NUM_STAGES,
        stop_iteration=CKPT,
    )
    assert rep.iterations_done == 0 and rep.verified


def _other_model(
    stage: int, num_stages: int, checkpoint: object, **kw: object
) -> tuple[torch.nn.Module, torch.optim.Optimizer, None]:
    m = torch.nn.Linear(3, 3)
    return m, torch.optim.SGD(m.parameters(), lr=0.1), None


def test_a_stage_factory_that_builds_another_model_is_told_what_to_pass(f1b_run, tmp_path):
    """A user who forgets --model gets the example GPT's factory: the checkpoint does not fit it,
    and the error says which keys and what to pass, instead of a traceback from load_state_dict."""
    with pytest.raises(
        ReplayError,
        match=r"(?s)stage 1: checkpoint \S+ of stage 1 \(iteration \d+\) does not fit the model Linear: .*Missing "
        r"key\(s\)",
    ) as e:
        replay(_job(f1b_run, 1, tmp_path), factory=_other_model)
    assert "--model module:function" in (e.value.hint or "")


def test_a_lost_meta_of_the_last_stage_leaves_its_loss_function_to_its_neighbours(f1b_run, tmp_path):
    """The replay of the last stage uses the loss function META names; without the stage's own META
    (an offline replay after its node died), the one the stage before it names, and says so."""
    _, cold = copy_run_files(f1b_run, tmp_path)
    for p in (Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / f"meta_{NUM_STAGES - 1}").glob("*"):
        p.unlink()
    res = replay(_job(f1b_run, NUM_STAGES - 1, tmp_path, sources=[SourceSpec(kind="cold", location=cold)]))
    assert res.job.loss is None and res.report.ok  # every send matched; the last step is not proven (below)
    assert not res.verified and res.report.unknown_steps == list(range(CKPT, ITERS))
    assert checkpoint_vs_live(checkpoint_of(res, NUM_STAGES - 1), f1b_run.results[NUM_STAGES - 1]) == []


def test_an_error_in_the_users_model_names_where_the_replay_was(f1b_run, tmp_path):
    """A stage factory whose module fails on what it receives: a ReplayError naming the stage,
    iteration and micro-batch and what to check (was torch's bare traceback), the cause chained."""
    from replay.user_code import load_object

    job = _job(f1b_run, 1, tmp_path)
    real = load_object(job.model)

    def broken(stage, num_stages, checkpoint, **kw):
        built = real(stage, num_stages, checkpoint, **kw)

        def boom(*a, **k):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)\nmore torch text")

        built[0].forward = boom
        return built

    with pytest.raises(
        ReplayError,
        match=rf"stage 1 iteration {CKPT} micro-batch 0: the stage's forward raised RuntimeError: mat1 and mat2 "
        r"shapes cannot be multiplied \(4x8 and 16x8\) \(hint: ",
    ) as e:
        replay(job, factory=broken)
    assert "--model" in (e.value.hint or "") and isinstance(e.value.__cause__, RuntimeError)


def test_a_job_names_the_device_it_replays_on(f1b_run, tmp_path):
    job = _job(f1b_run, 1, tmp_path, device="cpu")
    res = replay(job)
    assert res.verified and checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []
    assert ReplayJob.from_dict(job.to_dict()).device == "cpu"
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        job.replace(device="gpu0")
    with pytest.raises(ValueError, match="workers=2: parallel replay .* CPU"):
        job.replace(device="cuda", workers=2)


def test_a_lost_meta_record_is_stood_in_for_by_a_neighbours(f1b_run, tmp_path):
    # the failed stage's META lived on its node and never reached the cold tier: the replay still works
    _, cold = copy_run_files(f1b_run, tmp_path)
    for p in (Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "meta_1").glob("*"):
        p.unlink()
    src = SourceSpec(kind="cold", location=cold)
    with src.open(f1b_run.run_id) as st:
        plan = plan_recovery(st, [1])
    assert plan.possible and any("stands in" in w for w in plan.units[0].warnings)
    assert {f.channel for f in plan.units[0].fetch if f.purpose == "meta"} == {"meta_0"}
    res = replay(_job(f1b_run, 1, tmp_path, sources=[src]))
    assert (
        checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []
    )  # this run neither clips nor sets rates by hand
    assert any("using stage 0's" in w for w in res.report.warnings)
    # but a run that did would differ after the last step, which no later send checks: not "verified"
    assert (
        res.report.ok
        and not res.verified
        and f"the last iteration ({ITERS - 1}) was replayed with stage 0's META" in " ".join(res.report.warnings)
    )
    assert not checkpoint_of(res, 1).extra["recovered"]["verified"]


def test_meta_documents_from_the_commit_store_stand_for_the_lost_ones(f1b_run, tmp_path):
    """What a replacement does when the failed stage's META is gone from the logs: the copies the
    commit step kept in the decision store come as a "metas" source (plain values: a job carries
    them to helper processes), and the replay uses the stage's own META, not a neighbour's."""
    _, cold = copy_run_files(f1b_run, tmp_path)
    for p in (Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "meta_1").glob("*"):
        p.unlink()
    with f1b_run.spec().open(f1b_run.run_id) as st:
        docs = {
            f"1/{it}": st.get(RecordKey(Channel.meta(1), it, 0)).numpy().tobytes().decode() for it in range(CKPT, ITERS)
        }
    metas = SourceSpec(kind="metas", location="the commit store", docs=docs)
    job = _job(f1b_run, 1, tmp_path, sources=[metas, SourceSpec(kind="cold", location=cold)])
    assert ReplayJob.from_dict(job.to_dict()).sources[0] == metas
    res = replay(job)
    assert res.verified and checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []
    assert not any("META" in w for w in res.report.warnings), res.report.warnings
    src = metas.open(f1b_run.run_id)  # META records only, never another channel's
    assert [k.iteration for k in src.keys(Channel.meta(1))] == list(range(CKPT, ITERS)) and src.keys(
        Channel.activation(0)
    ) == []
    with pytest.raises(KeyError, match="no META document"):
        src.get(RecordKey(Channel.activation(0), CKPT, 0))
    with pytest.raises(ValueError, match="carries docs"):
        SourceSpec(kind="metas", location="the commit store")


def test_an_unreachable_node_server_falls_through_to_the_next_source(f1b_run, tmp_path):
    from logstore.testing import free_port
    from replay.plan import cold_only_store

    dead = f"http://127.0.0.1:{free_port()}"
    with (
        cold_only_store(f1b_run.cold_url, f1b_run.run_id) as cold,
        RemoteLogReader(dead, f1b_run.run_id, fallback=[cold], retries=1) as reader,
    ):
        st = build_states(_job(f1b_run, 1, tmp_path))[0]
        rep = replay_stage(st, reader, num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn)
    assert rep.verified
    from replay.errors import NodeUnavailableError
    from replay.remote import HttpRecordSource

    with HttpRecordSource(dead, f1b_run.run_id, retries=1) as src, pytest.raises(NodeUnavailableError) as ei:
        src.get(RecordKey(Channel.activation(0), CKPT, 0))
    assert ei.value.retryable and "unavailable" in str(ei.value)
    # every source unlistable: no plan of zero iterations "verified" (a QA check: a node server answering 500),
    # but why not
    with (
        HttpRecordSource(dead, f1b_run.run_id, retries=1) as src,
        pytest.raises(ValueError, match=r"no source could be read: listing channels of"),
    ):
        plan_recovery([src], [1])
    with HttpRecordSource(dead, f1b_run.run_id, retries=1) as src:  # the checkpoints known, the logs not
        plan = plan_recovery([src], [1], num_stages=NUM_STAGES)
    assert not plan.possible and plan.units[0].reasons[0].startswith(
        "no source could list the run's logs: listing channels of"
    ), plan.reasons


def test_replacement_replays_alone_when_its_helper_never_comes(f1b_run, tmp_path):
    """recover_stage(helpers=1) publishes the job, waits for the rendezvous, and when no helper
    shows up within the timeout replays alone: still verified and bit-exact."""
    import datetime
    import json

    from replay.replacement import recover_stage
    from trainer_client.survivor import RecoveryKeys

    store = loopback_store(datetime.timedelta(seconds=30))
    keys = RecoveryKeys(f1b_run.run_id)
    store.set(keys.failed_stages(0), json.dumps([1]))
    for k in (0, 2, 3):  # the survivors' reports: where they stand and where their logs are
        store.set(
            keys.survivor(0, k), json.dumps({"resume": ITERS, "store_root": f1b_run.root, "cold_url": f1b_run.cold_url})
        )
    ck_base = f1b_run.results[1]["checkpoints"][CKPT].rsplit("/stage", 1)[0]
    rec = recover_stage(
        store,
        run_id=f1b_run.run_id,
        stage=1,
        num_stages=NUM_STAGES,
        generation=0,
        checkpoint_url=ck_base,
        sources=None,
        model=EXAMPLE_MODEL,
        model_args=f1b_run.gpt.to_dict(),
        n_microbatches=f1b_run.gpt.n_microbatches,
        threads=1,
        helpers=1,
        timeout=datetime.timedelta(seconds=3),
    )
    assert rec.verified and rec.resume == ITERS and rec.checkpoint_iteration == CKPT
    assert rec.timings["workers"] == 1  # replayed alone after the helper did not come
    assert json.loads(store.get(keys.replay_job(0, 1)))["world"] == 2  # the job was published for it
    live = f1b_run.results[1]
    assert (
        state_bytes_differ(rec.module.state_dict(), rec.optimizer.state_dict(), live["model"], live["optimizer"]) == []
    )


def test_stages_built_ahead_are_used_once_and_only_for_their_job(f1b_run, tmp_path, caplog):
    """PreparedStates (a replacement builds from its newest checkpoint while it waits for the
    survivors): a matching job uses the objects built ahead, once; a different job, a second
    replay or a failed guess builds its own; the replay stays bit-exact either way."""
    from replay.replacement import prepare_states
    from replay.states import PreparedStates

    builds = []

    def counting(*a, **kw):
        builds.append(a[0])
        return gpt_stage(*a, **kw)

    job = _job(f1b_run, 1, tmp_path, output=None)
    ahead = PreparedStates(
        run=job.run,
        num_stages=NUM_STAGES,
        stages=[1],
        checkpoints=job.checkpoints,
        model=job.model,
        model_args=job.model_args,
        factory=counting,
    )
    assert not ahead.matches(job.replace(model_args={**job.model_args, "dropout": 0.0}))
    assert ahead.take(job.replace(checkpoints={1: job.checkpoints[1] + ".other"})) is None and builds == [1]
    live = f1b_run.results[1]
    first = replay(job, factory=counting, prepared=ahead)
    assert builds == [1], "the objects built ahead were not used"
    second = replay(job, factory=counting, prepared=ahead)  # taken already: built anew
    assert builds == [1, 1] and second.states[0].module is not first.states[0].module
    for res in (first, second):
        st = res.states[0]
        assert (
            res.verified
            and state_bytes_differ(st.module.state_dict(), st.optimizer.state_dict(), live["model"], live["optimizer"])
            == []
        )
    # the replacement's guess: the newest common checkpoint under the checkpoint URL
    ck_base = f1b_run.results[1]["checkpoints"][CKPT].rsplit("/stage", 1)[0]
    assert prepare_states(
        ck_base, run_id=job.run, stages=[1], num_stages=NUM_STAGES, model=job.model, model_args=job.model_args
    ).matches(job)
    # nothing to guess from, or a guess that fails: nothing is handed out and nothing raises
    with caplog.at_level("INFO", logger="replay.states"):
        assert (
            prepare_states(str(tmp_path / "no-checkpoints"), run_id=job.run, stages=[1], num_stages=NUM_STAGES).take(
                job
            )
            is None
        )
        broken = PreparedStates(
            run=job.run, num_stages=NUM_STAGES, stages=[1], checkpoints={1: str(tmp_path / "missing.pt")}
        )
        assert broken.take(job) is None
    assert "building stages [1] ahead failed" in caplog.text


@st.composite
def _orders(draw):
    n = draw(st.integers(1, 9))
    fwd = draw(st.permutations(range(n)))
    bwd = draw(st.permutations(range(n)))
    mine = draw(st.lists(st.sampled_from(range(n)), unique=True, min_size=1))
    return list(fwd), list(bwd), [mb for mb in bwd if mb in set(mine)]


@settings(max_examples=300, deadline=None)
@given(_orders())
def test_passes_keep_the_live_orders_and_run_each_backward_as_early_as_they_allow(orders):
    fwd, bwd, mine = orders
    passes = plan_passes(IterationPlan(len(fwd), fwd, bwd, 1, None, mine))
    assert [mb for k, mb in passes if k == "F"] == [mb for mb in fwd if mb in mine]  # live forward order: buffers
    assert [mb for k, mb in passes if k == "B"] == mine  # live backward order: gradient sums
    seen = 0
    for i, (k, mb) in enumerate(passes):
        if k == "F":
            seen += 1
            continue
        done = {m for kk, m in passes[:i] if kk == "F"}
        assert mb in done
        # no forward ran early: the last forward before this backward was needed by it or an earlier one
        needed = max(fwd.index(m) for m in mine[: mine.index(mb) + 1])
        assert seen == sum(1 for m in fwd[: needed + 1] if m in mine)
    if fwd == bwd:  # GPipe and 1F1B replayed alone: one micro-batch alive at a time
        assert passes == [p for mb in mine for p in (("F", mb), ("B", mb))]


class _SlowListing:
    """A real store whose key listings take 50 ms and are counted (to make two readers overlap)."""

    def __init__(self, inner: LogStore) -> None:
        self.inner, self.listings = inner, 0

    def get(self, key):
        return self.inner.get(key)

    def keys(self, channel=None, it_lo=0, it_hi=None):
        self.listings += 1
        time.sleep(0.05)
        return self.inner.keys(channel, it_lo, it_hi)

    def gaps(self):
        return self.inner.gaps()


def test_concurrent_listings_of_one_window_share_one_call_per_source(f1b_run):
    with f1b_run.store() as st:
        src = _SlowListing(st)
        reader = LogReader([src])
        ch = Channel.activation(0)
        with ThreadPoolExecutor(4) as pool:  # the compute and the prefetch thread start on the same iteration
            got = list(pool.map(lambda mb: reader.part_keys(ch, CKPT, mb % 2), range(4)))
        assert src.listings == 1
        assert got[0] == got[2] == st.keys(ch, CKPT, CKPT + 1)[: len(got[0])] and got[0] and got[1] and got[0] != got[1]
        assert reader.part_keys(ch, CKPT + 1, 0) and src.listings == 1  # the window was listed at once


class _CountingGets:
    def __init__(self, inner: LogStore) -> None:
        self.inner, self.gets = inner, 0

    def get(self, key):
        self.gets += 1
        return self.inner.get(key)

    def keys(self, channel=None, it_lo=0, it_hi=None):
        return self.inner.keys(channel, it_lo, it_hi)

    def gaps(self):
        return self.inner.gaps()


def test_a_key_is_asked_first_of_the_source_that_listed_it(f1b_run, tmp_path):
    with LogStore.open(str(tmp_path / "empty"), f1b_run.run_id) as empty, f1b_run.store() as full:
        a, b = _CountingGets(empty), _CountingGets(full)
        reader = LogReader([a, b])
        ch = Channel.activation(1)
        parts = reader.require_parts(ch, CKPT, 1)
        assert parts and a.gets == 0 and b.gets == len(parts)
        assert all(torch.equal(p, full.get(k)) for p, k in zip(parts, reader.part_keys(ch, CKPT, 1), strict=True))
        with pytest.raises(ReplayInputMissingError):  # a key nobody listed is still looked for everywhere
            reader.get(RecordKey(ch, ITERS + 5, 0))
        assert a.gets == 1 and b.gets == len(parts) + 1


def test_a_replacement_says_in_words_why_its_replay_is_not_verified():
    """A QA check: a replacement's fallback read "first mismatch None, missing digests []; not every
    send could be checked, or the last step is unproven", which did not say which. Now it names the
    one reason that applies."""
    from replay.report import ReplayReport

    def _unverified(r: ReplayReport) -> str:
        return r.unverified_reason

    def rep(**kw: Any) -> ReplayReport:
        return ReplayReport(stages=[1], start_iteration=4, stop_iteration=6, **kw)

    assert "act_1_2/it5/mb0/p0 differs from the log" in _unverified(
        rep(sends_generated=4, digests_checked=4, digest_mismatches=["act_1_2/it5/mb0/p0"])
    )
    assert "made no boundary send" in _unverified(rep())
    missing = _unverified(
        rep(sends_generated=4, digests_checked=2, digests_missing=["grad_1_0/it4/mb0/p0", "grad_1_0/it4/mb1/p0"])
    )
    assert "2 of its 4 sends have no digest in the logs to check them against (first: grad_1_0/it4/mb0/p0)" in missing
    assert "its last iteration (5) was replayed with another stage's META" in _unverified(
        rep(sends_generated=4, digests_checked=4, unknown_steps=[5])
    )


@pytest.mark.slow
def test_weights_tied_across_stages_replay_bit_for_bit_from_their_logged_reduction(tied_run, tmp_path):
    """The first stage's embedding and the last stage's head are one weight: each iteration their
    gradients are summed over the two stages (``client.all_reduce_grads_``) and then clipped to the
    global norm. A replay of either has only its own half; it checks that half against the digests
    taken before the reduction, puts the logged sum in its place, clips as logged: bit-exact and
    verified, alone and over two workers. The plan fetches the reduced records; without them it
    says what is missing and the replay names the record."""
    n_reduced = ITERS - CKPT
    for k in (0, NUM_STAGES - 1):
        res = replay(_job(tied_run, k, tmp_path / f"s{k}"))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, k), tied_run.results[k]) == [], f"stage {k}"
        assert res.report.steps_checked == n_reduced and res.report.grad_mismatches == []
    par = replay(_job(tied_run, 0, tmp_path / "par", workers=2))
    assert par.verified and checkpoint_vs_live(checkpoint_of(par, 0), tied_run.results[0]) == []
    with ServerProcess(
        Path(tied_run.root), cold_url=tied_run.cold_url
    ) as srv:  # the node server lists and serves reduced_* too
        with urllib.request.urlopen(
            urllib.request.Request(f"{srv.url}/v1/runs/{tied_run.run_id}", headers=srv.headers())
        ) as resp:
            assert "reduced_0" in {c["name"] for c in json.load(resp)["channels"]}
        res = replay(_job(tied_run, 0, tmp_path / "srv", sources=[SourceSpec.parse(srv.url)]))
        assert (
            res.verified
            and res.report.iterations_done == ITERS - CKPT
            and checkpoint_vs_live(checkpoint_of(res, 0), tied_run.results[0]) == []
        )
    with tied_run.store() as st:
        assert (
            len(st.keys(Channel.reduced(0))) == ITERS - CKPT
        )  # one call per iteration, one part (the embedding); older ones GC-ed
        plan = plan_recovery(st, [0])
    assert plan.possible and any(f.channel == "reduced_0" and f.purpose == "input" for f in plan.units[0].fetch), (
        plan.units[0].fetch
    )
    _, cold = copy_run_files(tied_run, tmp_path / "copy")
    for p in (Path(cold[len("file://") :]) / tied_run.run_id / "segments" / "reduced_0").glob("*"):
        p.unlink()
    src = SourceSpec(kind="cold", location=cold)
    with LogStore.open(tmp_path / "empty-root", tied_run.run_id, cold_url=cold) as st:
        plan = plan_recovery(st, [0])
    assert not plan.possible and plan.units[0].missing[0] == f"reduced_0/it{CKPT}/mb0/p0", plan.units[0].missing
    assert any("all_reduce_grads_" in r for r in plan.reasons), plan.reasons
    with pytest.raises(ReplayInputMissingError) as ei:
        replay(_job(tied_run, 0, tmp_path / "missing", sources=[src]))
    assert str(ei.value.key) == f"reduced_0/it{CKPT}/mb0/p0"


def test_a_plain_all_reduce_of_tied_weights_makes_the_replay_unverified(raw_tied_run, tmp_path):
    """The same tie summed by ``dist.all_reduce`` outside the client: nothing the replay can repeat.
    The gradient digests in META show it at the first replayed step (the last one too, where no
    later send could): not verified, naming the stage, iteration and parameter; never written."""
    k = NUM_STAGES - 1
    res = replay(_job(raw_tied_run, k, tmp_path))
    assert not res.verified and res.outputs == {}
    assert res.report.grad_mismatches[0] == {"stage": k, "iteration": CKPT, "params": ["head.weight"]}
    assert (
        f"stage {k} iteration {CKPT}: the gradients the optimizer step used differ from the live step's (head.weight)"
        in res.report.unverified_reason
    )
    job = _job(raw_tied_run, k, tmp_path / "last")
    last = replay(job.replace(stop_iteration=CKPT + 1))
    assert (
        not last.verified
        and [g["iteration"] for g in last.report.grad_mismatches] == [CKPT]
        and last.report.first_mismatch is None
    )
    assert (
        last.outputs == {} and not (tmp_path / "last" / "out").exists()
    )  # its sends all matched, but its state is wrong
