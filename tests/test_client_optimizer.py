"""The optimizer and lr-scheduler steps a replay repeats: learning rates and hyperparameters set
outside the scheduler or after the commit, schedulers stepped per epoch or of another kind,
composite schedulers, and iterations without exactly one optimizer step."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from logstore import Channel, LogStore, RecordKey
from replay import LogReader, StageState, replay_stage
from replay.errors import ReplayError
from tests._client_helpers import (
    Masked,
    mse,
    replay_with_scheduler,
    run_with_scheduler,
    same_state,
    single_rank_run,
    train_one_stage,
)
from trainer_client import (
    Checkpoint,
    CheckpointError,
    ClientConfig,
    FlushReport,
    SwiftlogClient,
    load_checkpoint,
)
from trainer_client.commit import loopback_store, stored_metas
from trainer_client.meta import decode_meta, encode_meta


@pytest.fixture
def tcp_store():
    master = loopback_store(datetime.timedelta(seconds=30))
    yield master


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_learning_rate_set_outside_the_scheduler_stops_the_replay_naming_it(tmp_path, single_rank_group):
    """META records the learning rates each step used (the optimizer given to checkpoint); a loop that
    sets them in a way the replay does not repeat (here by hand, in iteration 2) stops the replay at
    that step, naming both, instead of replaying on to a state that differs."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        if it == 2:
            for group in opt.param_groups:
                group["lr"] = 0.01

    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 2: the live optimizer step and the replay's differ: "
        r"lr of param group 0: 0\.01 -> 0\.05 \(live -> replay\) \(hint",
    ):
        single_rank_run(tmp_path, "lr", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), step)
    meta = decode_meta(LogStore.open(tmp_path / "store", "lr").get(RecordKey(Channel.meta(0), 1, 0)))
    assert meta["lrs"] == [0.05]


def test_another_hyperparameter_set_by_hand_stops_the_replay_naming_it(tmp_path, single_rank_group):
    """META also records each param group's other hyperparameters (``hparams``): a weight decay set by
    hand (here before the commit of iteration 2) stops the replay at that step, naming it."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        if it == 2:
            opt.param_groups[0]["weight_decay"] = 0.5

    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 2: .*differ: weight_decay of param group 0: 0\.5 -> 0\.01 \(live -> replay\) \(hint",
    ):
        single_rank_run(tmp_path, "wd", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01), step)


def test_a_learning_rate_set_after_the_commit_amends_meta_and_stops_the_replay_at_that_step(
    tmp_path, single_rank_group, tcp_store
):
    """Set between ``client.commit`` and ``optimizer.step()`` (here in the last iteration, which no
    later META reveals), a learning rate was invisible: META holds the values at the commit, and the
    replay said "verified" with another state. The client sees the step (a pre-hook on the tracked
    optimizer), amends the iteration's META in the log (micro-batch 1) and in the commit store (the
    copy a replacement reads), reports it, and the replay stops at that step naming the change.
    The scheduler's own changes (OneCycleLR also cycles the betas) are no such change."""
    store = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=datetime.timedelta(seconds=30))

    def halve_in_last(it: int, opt: torch.optim.Optimizer) -> None:
        if it == 3:
            opt.param_groups[0]["lr"] *= 0.5

    client, report, uri, _ = run_with_scheduler(tmp_path, "after", store, halve_in_last)
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert (
        len(faults) == 1
        and faults[0].iteration == 3
        and "the optimizer step is not what its META says" in faults[0].message
    ), report.logging_faults
    logs = LogStore.open(tmp_path / "store", "after")
    committed = decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))
    amended = decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 1)))
    assert amended["lrs"] == [committed["lrs"][0] * 0.5] and amended["changed_after_commit"] == [
        f"lr of param group 0: {committed['lrs'][0]} -> {committed['lrs'][0] * 0.5}"
    ]
    assert (
        committed["hparams"][0]["betas"]
        == amended["hparams"][0]["betas"]
        != decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))["hparams"][0]["betas"]
    )
    in_store = {it: json.loads(b) for it, b in stored_metas(store, client.coordinator.prefix, 0, range(1, 4)).items()}
    assert (
        in_store[3]["lrs"] == amended["lrs"]
        and in_store[3]["changed_after_commit"]
        and "changed_after_commit" not in in_store[2]
    )
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: .*lr of param group 0: .* \(live -> replay\) "
        r"\(the live step differed from its META as committed: lr of param group 0: ",
    ):
        replay_with_scheduler(tmp_path, "after", uri, 4)
    rep, _ = replay_with_scheduler(tmp_path, "after", uri, 3)  # the steps before it are what they were
    assert rep.ok
    from replay import plan_recovery  # the plan says so up front (it said "verifiable" and exit 0)

    plan = plan_recovery(LogStore.open(tmp_path / "store", "after"), [0])
    assert not plan.possible and any(
        "stage 0 iteration 3: the live optimizer step was not what its META says (lr of param group 0" in r
        for r in plan.reasons
    ), plan.reasons


def _epoch_run(
    tmp_path: Path, run_id: str, iters: int, *, count_last: bool = True
) -> tuple[FlushReport, str, torch.nn.Module, Any]:
    """``Masked`` under SGD with momentum and a StepLR stepped per "epoch" of two iterations (after
    even ones), ``iters`` iterations, checkpoint at 1. ``count_last=False``: close as if the stage
    had died before counting the last iteration's steps. Returns the close report, the checkpoint,
    the module and the scheduler."""
    client = SwiftlogClient(
        ClientConfig(run_id=run_id, stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    uri = train_one_stage(client, mod, opt, iters=iters, sched=sched, sched_after=lambda it: it % 2 == 0)
    if not count_last:
        client._meta.committed = None  # what close would count: nothing, as after a death in the optimizer step
    return client.close(), uri, mod, sched


def _replay_epochs(tmp_path: Path, run_id: str, uri: str, stop: int) -> tuple[Any, torch.nn.Module, Any]:
    fresh = Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fsched = torch.optim.lr_scheduler.StepLR(fopt, step_size=1, gamma=0.5)
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt, fsched)
    rep = replay_stage(
        state, LogReader(LogStore.open(tmp_path / "store", run_id)), num_stages=1, stop_iteration=stop, loss_fn=mse
    )
    return rep, fresh, fsched


@pytest.mark.parametrize("iters", [2, 5])
def test_a_scheduler_stepped_per_epoch_is_replayed_as_it_ran(tmp_path, single_rank_group, iters):
    """A QA check: a StepLR stepped every other iteration; the replay of one iteration stepped it
    after its optimizer step, said "verified", and every later state differed (nothing checked the
    rate it carried on with). The client counts the scheduler's steps (given to ``checkpoint``):
    META records its ``last_epoch`` at each commit, and once a count other than one is seen, every
    iteration's META is amended with the steps made after it (counted at the next step, checkpoint
    or close); the replay makes them, so it ends bit-identical, one iteration or several."""
    report, uri, live, live_sched = _epoch_run(tmp_path, "epoch", iters)
    assert report.ok and report.logging_faults == [], report.logging_faults
    logs = LogStore.open(tmp_path / "store", "epoch")
    assert decode_meta(logs.get(RecordKey(Channel.meta(0), 1, 1)))["apply"] == {
        "optimizer_steps": 1,
        "scheduler_steps": 0,
    }
    rep, fresh, fsched = _replay_epochs(tmp_path, "epoch", uri, iters)
    assert rep.ok and same_state(live, fresh) and fsched.state_dict() == live_sched.state_dict()
    momenta = [
        [st["momentum_buffer"] for st in s.optimizer.state_dict()["state"].values()] for s in (live_sched, fsched)
    ]
    assert len(momenta[0]) == 2 and all(torch.equal(a, b) for a, b in zip(*momenta, strict=True))


def test_a_stage_lost_before_its_scheduler_count_reached_meta_is_not_replayed_to_a_guess(tmp_path, single_rank_group):
    """The count after an iteration is taken when the next one begins: a stage that died before
    that (in its optimizer step), in a run seen stepping its scheduler irregularly, leaves the count
    unknown. The plan says so and the replay stops there instead of guessing one step; the
    iterations before it replay."""
    _, uri, _, _ = _epoch_run(tmp_path, "lost", 4, count_last=False)
    logs = LogStore.open(tmp_path / "store", "lost")
    assert decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))["apply_irregular"] == 1
    assert [k.micro_batch for k in logs.keys(Channel.meta(0), 3, 4)] == [0]
    from replay import plan_recovery

    plan = plan_recovery(logs, [0])
    assert not plan.possible and any(
        "stage 0 iteration 3: the live loop did not step its optimizer and lr scheduler once per iteration" in r
        for r in plan.reasons
    ), plan.reasons
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop did not make exactly one optimizer and one lr-scheduler step",
    ):
        _replay_epochs(tmp_path, "lost", uri, 4)
    assert _replay_epochs(tmp_path, "lost", uri, 3)[0].ok


def test_an_optimizer_step_before_the_commit_is_counted_too(tmp_path, single_rank_group):
    """The optimizer stepped between the schedule step and the commit (not the documented order, but
    replayable): counted as the iteration's step, no fault, and the replay equals the live run."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        opt.step()

    client = SwiftlogClient(
        ClientConfig(run_id="early", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = train_one_stage(client, mod, opt, step=step, apply=lambda it: None)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "early")
    assert all(k.micro_batch == 0 for k in logs.keys(Channel.meta(0))), "nothing amended"
    fresh = Masked()
    state = StageState.from_checkpoint(
        load_checkpoint(uri), fresh, torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    )
    assert replay_stage(state, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=mse).ok and same_state(
        fresh, mod
    )


def test_an_iteration_without_an_optimizer_step_stops_the_replay_there(tmp_path, single_rank_group):
    """Accumulating over iterations (an optimizer step every other commit) cannot be replayed: the
    client counts the steps, reports the iteration without one (``no_optimizer_step``), amends its
    META, and the plan and the replay stop there."""
    client = SwiftlogClient(
        ClientConfig(run_id="accum", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    uri = train_one_stage(client, mod, opt, iters=4, apply=lambda it: opt.step() if it % 2 == 1 else None)
    assert client.close().drained  # not "ok": a fault was reported
    faults = [f for f in client.writer.recent_faults() if f.kind == "no_optimizer_step"]  # reported by commit(3)
    assert [f.iteration for f in faults] == [2] and "gradients accumulated over iterations" in faults[0].message, (
        client.writer.recent_faults()
    )
    from replay import plan_recovery

    logs = LogStore.open(tmp_path / "store", "accum")
    plan = plan_recovery(logs, [0])
    assert not plan.possible and any(
        "stage 0 iteration 2: the live loop made no optimizer step after it" in r for r in plan.reasons
    ), plan.reasons
    fresh = Masked()
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, torch.optim.SGD(fresh.parameters(), lr=0.05))
    with pytest.raises(
        ReplayError, match=r"stage 0 iteration 2: the live loop made no optimizer step after this iteration"
    ):
        replay_stage(state, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=mse)


def test_a_replacement_scheduler_of_another_kind_or_schedule_is_refused(tmp_path, single_rank_group):
    """A stage factory that builds another lr scheduler than the training's (a StepLR for a
    LambdaLR) took the checkpoint's state without a word (torch loads any state dict) and a replay
    of one iteration said "verified": every stage diverged after it (a QA check). The checkpoint
    names its classes and the load refuses another class, or (older checkpoints) a state with
    other fields; the same class computing other rates (another lambda) is caught after the last
    replayed step wherever the next iteration's META is in the logs."""
    client = SwiftlogClient(
        ClientConfig(run_id="sched", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = train_one_stage(client, mod, opt, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e)))
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "sched")

    def state(make_sched: Callable[[torch.optim.Optimizer], Any], ck: Any = None) -> StageState:
        fresh = Masked()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        return StageState.from_checkpoint(ck or load_checkpoint(uri), fresh, fopt, make_sched(fopt))

    assert load_checkpoint(uri).classes == {"optimizer": "SGD", "lr_scheduler": "LambdaLR"}
    with pytest.raises(
        CheckpointError, match=r"was saved from a LambdaLR lr scheduler, not the StepLR it is loaded into"
    ):
        state(lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    with pytest.raises(CheckpointError, match=r"was saved from a SGD optimizer, not the AdamW"):
        StageState.from_checkpoint(load_checkpoint(uri), (m := Masked()), torch.optim.AdamW(m.parameters()))
    older = load_checkpoint(uri)
    older.classes = {}
    with pytest.raises(
        CheckpointError,
        match=r"its lr scheduler state does not fit the lr scheduler StepLR: fields \['lr_lambdas'\] only in",
    ):
        state(lambda o: torch.optim.lr_scheduler.StepLR(o, 1), older)
    unchecked = load_checkpoint(uri)
    unchecked.sched_next = None  # an older checkpoint: the replay's first step shows it
    other_lambda = state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5), unchecked)
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 1: after the step, the lr scheduler LambdaLR "
        r"set the learning rates \[0.025\] where the live",
    ):
        replay_stage(other_lambda, LogReader(logs), num_stages=1, stop_iteration=2, loss_fn=mse)
    # nothing to replay (a stage lost in its checkpoint's iteration): the load itself compares the next step's rates
    with pytest.raises(
        CheckpointError, match=r"would set the learning rates \[0.025\] at its next step, the training's set \[0.0166"
    ):
        state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5))
    resumed = Masked()  # a user resuming with another schedule on purpose
    ropt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    load_checkpoint(uri).apply(resumed, ropt, torch.optim.lr_scheduler.StepLR(ropt, 1), strict=False)
    # the same lambda until the last replayed step (whose next META no stage wrote): caught by the formula META carries
    late = state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e) if e < 4 else 0.5))
    with pytest.raises(ReplayError, match=r"stage 0 iteration 3: after the step, the lr scheduler LambdaLR set"):
        replay_stage(late, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=mse)
    meta = decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))
    assert meta["sched_next"] == [0.05 * (1.0 / (1 + 4))]  # base_lr * lambda(epoch), as the scheduler computes it
    # where the next META is logged and the formula is not (an older record), the rates are compared with it
    plain = state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5), unchecked)
    metas = {
        RecordKey(Channel.meta(0), it, 0): decode_meta(logs.get(RecordKey(Channel.meta(0), it, 0)))
        for it in range(1, 4)
    }

    class _OlderMeta:  # the logs, with META documents as an older client wrote them (no sched_next)
        def get(self, key: RecordKey) -> torch.Tensor:
            if key in metas:
                return encode_meta({k: v for k, v in metas[key].items() if k != "sched_next"})
            return logs.get(key)

        def keys(self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None) -> list[RecordKey]:
            return logs.keys(channel, it_lo, it_hi)

        def gaps(self) -> list[dict[str, Any]]:
            return logs.gaps()

    with pytest.raises(
        ReplayError,
        match=r"stage 0: after the replay's last step, its optimizer has other values "
        r"than the live one had for iteration 2: lr of",
    ):
        replay_stage(plain, LogReader(_OlderMeta()), num_stages=1, stop_iteration=2, loss_fn=mse)
    assert replay_stage(
        state(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))),
        LogReader(logs),
        num_stages=1,
        stop_iteration=2,
        loss_fn=mse,
    ).ok


def test_composite_schedulers_are_checked_part_by_part_and_never_changed_by_the_client(tmp_path, single_rank_group):
    """A QA check: a SequentialLR (LinearLR then CosineAnnealingLR) loaded into a factory's
    SequentialLR of LinearLR then ExponentialLR took the state and recovered "verified" with a wrong
    state; a ChainedScheduler with its parts swapped raised a bare KeyError from torch. Checkpoints
    name a composite's parts and a load compares each; the rates a torch scheduler's next step sets
    (found by stepping it and putting it back) go into META, and stepping it so changes nothing."""
    sched_mod = torch.optim.lr_scheduler

    def seq(o: torch.optim.Optimizer, second: Callable[[torch.optim.Optimizer], Any]) -> Any:
        return sched_mod.SequentialLR(
            o, [sched_mod.LinearLR(o, start_factor=0.5, total_iters=2), second(o)], milestones=[2]
        )

    client = SwiftlogClient(
        ClientConfig(run_id="seq", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = train_one_stage(client, mod, opt, sched=seq(opt, lambda o: sched_mod.LambdaLR(o, lambda e: 1.0 / (1 + e))))
    assert client.close().ok
    ck = load_checkpoint(uri)
    assert ck.classes["lr_scheduler"] == "SequentialLR[LinearLR,LambdaLR]"
    fresh = Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(
        CheckpointError,
        match=r"saved from a SequentialLR\[LinearLR,LambdaLR\] lr scheduler, "
        r"not the SequentialLR\[LinearLR,ExponentialLR\]",
    ):
        StageState.from_checkpoint(ck, fresh, fopt, seq(fopt, lambda o: sched_mod.ExponentialLR(o, 0.9)))
    ck.classes = {}  # an older checkpoint: the parts' fields are compared
    with pytest.raises(
        CheckpointError,
        match=r"fields \['lr_lambdas'\] only in the checkpoint, \['gamma'\] only in the scheduler \(its scheduler 1\)",
    ):
        StageState.from_checkpoint(ck, fresh, fopt, seq(fopt, lambda o: sched_mod.ExponentialLR(o, 0.9)))
    # the parts' classes agree but the inner lambda does not: the step's rates differ from those META carries
    logs = LogStore.open(tmp_path / "store", "seq")
    fresh = Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(
        CheckpointError,
        match=r"the lr scheduler SequentialLR\[LinearLR,LambdaLR\] loaded with its state would set the learning rates",
    ):
        StageState.from_checkpoint(
            load_checkpoint(uri), fresh, fopt, seq(fopt, lambda o: sched_mod.LambdaLR(o, lambda e: 0.5))
        )
    older = load_checkpoint(uri)
    older.sched_next = None  # an older checkpoint: a replayed step shows it
    st = StageState.from_checkpoint(older, fresh, fopt, seq(fopt, lambda o: sched_mod.LambdaLR(o, lambda e: 0.5)))
    with pytest.raises(
        ReplayError, match=r"stage 0 iteration \d: after the step, the lr scheduler SequentialLR set the learning rates"
    ):
        replay_stage(st, LogReader(logs), num_stages=1, stop_iteration=4, loss_fn=mse)
    # stepping a scheduler for META and putting it back leaves it as it was, OneCycleLR's momentum included
    for make in (
        lambda o: seq(o, lambda o2: sched_mod.CosineAnnealingLR(o2, 5)),
        lambda o: sched_mod.OneCycleLR(o, max_lr=0.1, total_steps=10),
        lambda o: sched_mod.ChainedScheduler(
            [sched_mod.ExponentialLR(o, 0.9), sched_mod.LambdaLR(o, lambda e: 0.9**e)]
        ),
    ):
        a_opt, b_opt = (torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.05, momentum=0.9) for _ in range(2))
        a, b = make(a_opt), make(b_opt)
        probe = SwiftlogClient(
            ClientConfig(
                run_id="probe", stage=0, num_stages=1, store_root=str(tmp_path / "probe"), seed=9, enabled=False
            )
        )
        probe.track_lr_scheduler(a)
        for _ in range(4):
            nxt = probe._watch.sched_next()
            a_opt.step(), b_opt.step()
            a.step(), b.step()
            assert nxt == [g["lr"] for g in a_opt.param_groups] == [g["lr"] for g in b_opt.param_groups]
            assert [g["momentum"] for g in a_opt.param_groups] == [g["momentum"] for g in b_opt.param_groups]
            assert repr(a.state_dict()) == repr(b.state_dict())
        probe.close()
    # parts swapped: torch's own load fails; named, not a KeyError
    c_opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.05)
    chained = sched_mod.ChainedScheduler(
        [sched_mod.ExponentialLR(c_opt, 0.9), sched_mod.LambdaLR(c_opt, lambda e: 1.0)]
    )
    swapped = sched_mod.ChainedScheduler(
        [sched_mod.LambdaLR(c_opt, lambda e: 1.0), sched_mod.ExponentialLR(c_opt, 0.9)]
    )
    bad = Checkpoint("r", 0, 1, 0, 1, torch.nn.Linear(2, 2).state_dict(), lr_scheduler=chained.state_dict())
    with pytest.raises(CheckpointError, match=r"lr scheduler"):
        bad.apply(torch.nn.Linear(2, 2), None, swapped)


def test_a_scheduler_that_cycles_other_hyperparameters_replays_exactly(tmp_path, single_rank_group):
    _, report, uri, live = run_with_scheduler(tmp_path, "cycle", None, lambda it, opt: None)
    assert report.ok and report.logging_faults == []
    rep, fresh = replay_with_scheduler(tmp_path, "cycle", uri, 4)
    assert rep.ok and same_state(fresh, live)
