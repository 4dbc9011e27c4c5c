"""The replay loop on logs of real 4-stage pipeline runs (GPipe and 1F1B, dropout on).

Sequential replay of every stage reproduces the live parameters, AdamW state, lr scheduler and
iteration bit for bit and proves it against the receivers' digests (also with clipping to a global
norm, under autocast, with weights tied across stages); a logging group replays as one; a perturbed
model is caught at its first send; a lost META is stood in for; the passes keep the live orders.
Where the records come from: ``tests/test_replay_sources.py``; building the stages:
``tests/test_replay_stages.py``.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore import Channel, LogStore, RecordKey
from replay import (
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
from replay.errors import ReplayInputMissingError
from replay.reader import LogReader
from replay.stage import ReplayHooks, StageState
from replay.states import build_states, checkpoint_of
from server.testing import ServerProcess
from tests._replay_helpers import (
    CKPT,
    ITERS,
    NUM_STAGES,
    checkpoint_vs_live,
    copy_run_files,
    job_for,
    state_bytes_differ,
)
from trainer_client import load_checkpoint, save_checkpoint
from trainer_client.examples.factories import gpt_stage
from trainer_client.examples.gpt import loss_fn

pytest_plugins = ["tests._replay_fixtures"]


@pytest.fixture(params=[pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def any_run(request):
    return request.getfixturevalue("gpipe_s3_run" if request.param == "gpipe" else "f1b_run")


def test_sequential_replay_of_every_stage_is_bit_exact(any_run, tmp_path):
    run = any_run
    n_mb = run.gpt.n_microbatches
    for k in range(NUM_STAGES):
        res = replay(job_for(run, k, tmp_path))
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
        res = replay(job_for(clip_run, stage, tmp_path / f"s{stage}", workers=workers))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, stage), clip_run.results[stage]) == [], (
            f"stage {stage}"
        )


def test_a_run_under_autocast_replays_under_it_bit_for_bit(autocast_run, tmp_path):
    with autocast_run.store() as st:
        assert LogReader(st).meta(2, CKPT)["autocast"] == [
            {"device_type": "cpu", "dtype": "bfloat16", "cache_enabled": True}
        ]
    for stage, workers in ((3, 1), (1, 2)):
        res = replay(job_for(autocast_run, stage, tmp_path / f"s{stage}", workers=workers))
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
    a = replay(job_for(f1b_run, 1, tmp_path / "a", prefetch=0))
    b = replay(job_for(f1b_run, 1, tmp_path / "b", prefetch=3), on_progress=seen.append)
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
    res2 = replay(job_for(f1b_run, [1, 2], tmp_path / "12"))
    for k in (1, 2):
        assert checkpoint_vs_live(checkpoint_of(res2, k), f1b_run.results[k]) == [], f"stage {k}"
    assert res2.verified and res2.report.digests_checked == 2 * (ITERS - CKPT) * f1b_run.gpt.n_microbatches


def test_verification_catches_a_perturbed_model(f1b_run, tmp_path):
    job = job_for(f1b_run, 2, tmp_path)
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


def test_a_job_names_the_device_it_replays_on(f1b_run, tmp_path):
    job = job_for(f1b_run, 1, tmp_path, device="cpu")
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
    res = replay(job_for(f1b_run, 1, tmp_path, sources=[src]))
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
    job = job_for(f1b_run, 1, tmp_path, sources=[metas, SourceSpec(kind="cold", location=cold)])
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
        res = replay(job_for(tied_run, k, tmp_path / f"s{k}"))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, k), tied_run.results[k]) == [], f"stage {k}"
        assert res.report.steps_checked == n_reduced and res.report.grad_mismatches == []
    par = replay(job_for(tied_run, 0, tmp_path / "par", workers=2))
    assert par.verified and checkpoint_vs_live(checkpoint_of(par, 0), tied_run.results[0]) == []
    with ServerProcess(
        Path(tied_run.root), cold_url=tied_run.cold_url
    ) as srv:  # the node server lists and serves reduced_* too
        with urllib.request.urlopen(
            urllib.request.Request(f"{srv.url}/v1/runs/{tied_run.run_id}", headers=srv.headers())
        ) as resp:
            assert "reduced_0" in {c["name"] for c in json.load(resp)["channels"]}
        res = replay(job_for(tied_run, 0, tmp_path / "srv", sources=[SourceSpec.parse(srv.url)]))
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
        replay(job_for(tied_run, 0, tmp_path / "missing", sources=[src]))
    assert str(ei.value.key) == f"reduced_0/it{CKPT}/mb0/p0"


def test_a_plain_all_reduce_of_tied_weights_makes_the_replay_unverified(raw_tied_run, tmp_path):
    """The same tie summed by ``dist.all_reduce`` outside the client: nothing the replay can repeat.
    The gradient digests in META show it at the first replayed step (the last one too, where no
    later send could): not verified, naming the stage, iteration and parameter; never written."""
    k = NUM_STAGES - 1
    res = replay(job_for(raw_tied_run, k, tmp_path))
    assert not res.verified and res.outputs == {}
    assert res.report.grad_mismatches[0] == {"stage": k, "iteration": CKPT, "params": ["head.weight"]}
    assert (
        f"stage {k} iteration {CKPT}: the gradients the optimizer step used differ from the live step's (head.weight)"
        in res.report.unverified_reason
    )
    job = job_for(raw_tied_run, k, tmp_path / "last")
    last = replay(job.replace(stop_iteration=CKPT + 1))
    assert (
        not last.verified
        and [g["iteration"] for g in last.report.grad_mismatches] == [CKPT]
        and last.report.first_mismatch is None
    )
    assert (
        last.outputs == {} and not (tmp_path / "last" / "out").exists()
    )  # its sends all matched, but its state is wrong
