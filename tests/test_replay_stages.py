"""Building the replayed stages: the stage factory, the checkpoints, the user's code, stages built ahead.

A factory of the wrong shape, checkpoints that do not agree, a factory that builds another model
and an error in the user's model are named in the error; a lost META of the last stage leaves its
loss function to its neighbours; a replacement replays alone when its helper never comes; stages
built ahead are used once and only for their job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replay import (
    ReplayJob,
    SourceSpec,
    replay,
    replay_stages,
)
from replay.errors import ReplayError
from replay.stage import StageState
from replay.states import build_states, checkpoint_of
from tests._replay_helpers import (
    CKPT,
    EXAMPLE_MODEL,
    ITERS,
    NUM_STAGES,
    checkpoint_vs_live,
    copy_run_files,
    job_for,
    state_bytes_differ,
)
from trainer_client import load_checkpoint
from trainer_client.commit import loopback_store
from trainer_client.examples.factories import gpt_stage

pytest_plugins = ["tests._replay_fixtures"]


def test_a_stage_factory_of_the_wrong_shape_is_named(f1b_run, tmp_path):
    """A factory with another signature, or one that returns something else than (module,
    optimizer, scheduler), is a ReplayError naming the factory and the expected form."""
    job = job_for(f1b_run, 1, tmp_path)

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
    job = job_for(f1b_run, [1, 2], tmp_path)
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
        replay(job_for(f1b_run, 1, tmp_path), factory=_other_model)
    assert "--model module:function" in (e.value.hint or "")


def test_a_lost_meta_of_the_last_stage_leaves_its_loss_function_to_its_neighbours(f1b_run, tmp_path):
    """The replay of the last stage uses the loss function META names; without the stage's own META
    (an offline replay after its node died), the one the stage before it names, and says so."""
    _, cold = copy_run_files(f1b_run, tmp_path)
    for p in (Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / f"meta_{NUM_STAGES - 1}").glob("*"):
        p.unlink()
    res = replay(job_for(f1b_run, NUM_STAGES - 1, tmp_path, sources=[SourceSpec(kind="cold", location=cold)]))
    assert res.job.loss is None and res.report.ok  # every send matched; the last step is not proven (below)
    assert not res.verified and res.report.unknown_steps == list(range(CKPT, ITERS))
    assert checkpoint_vs_live(checkpoint_of(res, NUM_STAGES - 1), f1b_run.results[NUM_STAGES - 1]) == []


def test_an_error_in_the_users_model_names_where_the_replay_was(f1b_run, tmp_path):
    """A stage factory whose module fails on what it receives: a ReplayError naming the stage,
    iteration and micro-batch and what to check (was torch's bare traceback), the cause chained."""
    from replay.user_code import load_object

    job = job_for(f1b_run, 1, tmp_path)
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


def test_replacement_replays_alone_when_its_helper_never_comes(f1b_run, tmp_path):
    """recover_stage(helpers=1) publishes the job, waits for the rendezvous, and when no helper
    shows up within the timeout replays alone: still verified and bit-exact."""
    import datetime

    from replay.replacement import recover_stage
    from trainer_client.recovery_keys import RecoveryKeys

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
    assert store.check([keys.rates()])  # what it read, per tier, kept for later plans' estimates
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

    job = job_for(f1b_run, 1, tmp_path, output=None)
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
