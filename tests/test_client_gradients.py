"""Gradients a replay must reproduce: ``clip_grad_norm_`` and ``all_reduce_grads_`` logged and
repeated, and gradients changed outside the client (after or before the commit, by a GradScaler,
without version counters, not zeroed, buffers a backward changes) caught and named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from logstore import Channel, LogStore, RecordKey
from replay import LogReader, ReplayReport, StageState, replay_stage
from replay.errors import ReplayError, ReplayMismatchError
from tests._client_helpers import (
    Masked,
    mse,
    plain_step,
    replay_with_scheduler,
    run_with_scheduler,
    same_state,
    single_rank_run,
    train_one_stage,
)
from trainer_client import (
    ClientConfig,
    SwiftlogClient,
    load_checkpoint,
)
from trainer_client.meta import decode_meta


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _torch_clip(
    grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What ``torch.nn.utils.clip_grad_norm_`` makes of copies of ``grads``: (total norm, clipped copies)."""
    refs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for r, g in zip(refs, grads, strict=True):
        r.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(refs, max_norm, norm_type)
    return total, [r.grad for r in refs]


def test_clip_grad_norm_clips_as_torch_does_and_the_replay_repeats_it(tmp_path, single_rank_group):
    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        # before the first step, or after a commit (META is gone)
        with pytest.raises(RuntimeError, match="between client.step"):
            client.clip_grad_norm_(mod.parameters(), 1.0)
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        want_norm, want = _torch_clip([p.grad for p in mod.parameters()], 0.05)
        got_norm = client.clip_grad_norm_(mod.parameters(), 0.05)
        assert torch.equal(got_norm, want_norm) and want_norm > 0.05  # clipping is active
        assert all(torch.equal(p.grad, w) for p, w in zip(mod.parameters(), want, strict=True))
        if it == 2:  # a second call, on a subset and with the inf norm: both replayed, in order
            client.clip_grad_norm_([mod.lin.weight], 0.001, norm_type=float("inf"))
            with pytest.raises(ValueError, match=r"parameters \[0\] .* are not parameters of the stage's module"):
                client.clip_grad_norm_([torch.nn.Parameter(torch.zeros(1))], 1.0)

    mod, opt, logs, fresh, fopt, rep = single_rank_run(
        tmp_path, "clip", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), step, schedule="gpipe"
    )
    clips = decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))["grad_clip"]
    assert (
        [c["params"] for c in clips] == [None, [0]] and clips[1]["max_norm"] == 0.001 and clips[0]["dtype"] == "float32"
    )
    assert rep.ok and rep.micro_batches == 6 and same_state(fresh, mod)
    assert all(
        torch.equal(fopt.state_dict()["state"][i]["exp_avg_sq"], opt.state_dict()["state"][i]["exp_avg_sq"])
        for i in opt.state_dict()["state"]
    )


def test_gradients_changed_outside_the_client_stop_the_replay_at_that_step(tmp_path, single_rank_group):
    """torch's own clip_grad_norm_ (instead of the client's) in the last iteration: nothing later
    shows it (no later send depends on that step), and the replay said "verified" with another
    state. The client compares the gradients' version counters after the schedule's step with
    those at the optimizer step, amends META, and the replay stops there naming the parameters.
    The client's own clip is no such change."""

    def clip(it: int, opt: torch.optim.Optimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        if it == 3:
            torch.nn.utils.clip_grad_norm_(params, 1e-3)

    client, report, uri, _ = run_with_scheduler(tmp_path, "torchclip", None, clip)
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert (
        len(faults) == 1
        and "lin.weight, lin.bias" in faults[0].message
        and "client.clip_grad_norm_" in faults[0].message
    ), report.logging_faults
    amended = decode_meta(LogStore.open(tmp_path / "store", "torchclip").get(RecordKey(Channel.meta(0), 3, 1)))
    assert amended["grads_changed"] == ["lin.weight", "lin.bias"]
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop changed gradients after the schedule's backward .*lin\.weight",
    ):
        replay_with_scheduler(tmp_path, "torchclip", uri, 4)
    assert replay_with_scheduler(tmp_path, "torchclip", uri, 3)[0].ok


def test_a_grad_scaler_step_is_seen_although_its_unscale_leaves_the_version_counters(tmp_path, single_rank_group):
    """torch.amp.GradScaler's unscale kernel changes every gradient without bumping their version
    counters (torch 2.13, CPU): a recovery said "verified" with another state (a QA check). The
    client recognises a step that comes from a GradScaler and amends META; the replay stops there."""
    client = SwiftlogClient(
        ClientConfig(run_id="amp", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # its scale exists from the first scale() on (a loss_fn would scale the loss)
    uri = train_one_stage(client, mod, opt, iters=3, apply=lambda it: (scaler.step(opt), scaler.update()))
    report = client.close()
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert faults and "a GradScaler unscaled them" in faults[0].message, report.logging_faults
    fresh = Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with pytest.raises(ReplayError, match=r"stage 0 iteration 1: the live loop changed gradients .*GradScaler"):
        replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(LogStore.open(tmp_path / "store", "amp")),
            num_stages=1,
            stop_iteration=3,
            loss_fn=mse,
        )


def test_gradients_changed_without_their_version_counters_after_the_commit_stop_the_replay(tmp_path, single_rank_group):
    """A collective on the gradients (an all_reduce of tied weights) or a write through ``.data``
    between ``commit`` and the optimizer step leaves the version counters alone, and the last
    iteration's step was replayed without it and said "verified". META now holds the digests of the
    gradients at the commit (``grad_digests``); the step's pre-hook compares them, amends META and
    reports it, and the replay stops at that step naming the parameters."""

    def halve_through_data(it: int, opt: torch.optim.Optimizer) -> None:
        if it == 3:
            for p in opt.param_groups[0]["params"]:
                p.grad.data.mul_(0.5)  # what a gloo all_reduce does to the version counter: nothing

    client, report, uri, _ = run_with_scheduler(tmp_path, "dataw", None, halve_through_data)
    faults = [f for f in report.logging_faults if f.kind == "step_after_commit"]
    assert (
        len(faults) == 1 and faults[0].iteration == 3 and "without touching their version counters" in faults[0].message
    ), report.logging_faults
    logs = LogStore.open(tmp_path / "store", "dataw")
    committed = decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 0)))
    assert len(committed["grad_digests"]) == 2 and all(
        isinstance(d, str) and len(d) == 16 for d in committed["grad_digests"]
    )
    assert decode_meta(logs.get(RecordKey(Channel.meta(0), 3, 1)))["grads_changed"] == [
        "lin.weight",
        "lin.bias",
    ]
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop changed gradients .*without touching their version counters",
    ):
        replay_with_scheduler(tmp_path, "dataw", uri, 4)
    rep, _ = replay_with_scheduler(tmp_path, "dataw", uri, 3)
    assert rep.ok and rep.steps_checked == 2 and rep.grad_mismatches == []  # (one stage: no send to verify)


def test_gradients_changed_before_the_commit_outside_the_replay_make_it_unverified(tmp_path, single_rank_group):
    """Gradients changed between the schedule's step and the commit by what a replay does not
    repeat (a data-parallel or tied-weight all_reduce, a hook, a ``.data`` write): the commit's
    digests are of the changed gradients, and the replay's own differ at that very step, the last
    one included, where no later send could show it. The report names the iteration and the
    parameters, is not verified, and ``raise_for_mismatch`` says why."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        plain_step(client, mod, opt, it, g)
        if it == 3:
            mod.lin.bias.grad.data.add_(1e-3)

    client = SwiftlogClient(
        ClientConfig(run_id="before", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = train_one_stage(client, mod, opt, step=step)
    assert client.close().ok  # nothing the live stage could see
    logs = LogStore.open(tmp_path / "store", "before")
    fresh = Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    rep = replay_stage(
        StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
        LogReader(logs),
        num_stages=1,
        stop_iteration=4,
        loss_fn=mse,
    )
    assert rep.first_mismatch is None and rep.steps_checked == 3
    assert rep.grad_mismatches == [{"stage": 0, "iteration": 3, "params": ["lin.bias"]}] and not rep.ok
    assert (
        "stage 0 iteration 3: the gradients the optimizer step used differ from the live step's (lin.bias)"
        in rep.unverified_reason
    )
    with pytest.raises(
        ReplayMismatchError, match=r"iteration 3: the gradients the optimizer step used differ .*a collective"
    ):
        rep.raise_for_mismatch()
    again = ReplayReport.from_dict(rep.to_dict())
    assert again.grad_mismatches == rep.grad_mismatches and again.steps_checked == 3 and not again.verified


def test_all_reduce_grads_is_logged_ordered_with_clips_and_replayed(tmp_path, single_rank_group):
    """``client.all_reduce_grads_`` between the schedule's step and the commit: META lists the call
    (its place among the clips, the parameters, the digests before it), the reduced gradients are
    a record per call, and the replay checks its own gradients against those digests, puts the
    logged ones in their place and clips after it as the live loop did. Misuse is named."""

    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        plain_step(client, mod, opt, it, g)
        client.clip_grad_norm_(mod.parameters(), 10.0)
        if it == 3:
            mod.lin.bias.grad.data.add_(1e-3)  # before the reduction: in its digests, not in a replay's gradients
        client.all_reduce_grads_([mod.lin.bias, mod.lin.weight], average=True)  # a world of one: the values stay
        client.clip_grad_norm_(mod.parameters(), 0.01)
        with pytest.raises(ValueError, match=r"parameters \[0\] .*are not parameters of the stage's module"):
            client.all_reduce_grads_([torch.nn.Parameter(torch.zeros(2))])
        with pytest.raises(ValueError, match="no parameters given"):
            client.all_reduce_grads_([])

    client = SwiftlogClient(
        ClientConfig(run_id="reduce", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    with pytest.raises(
        RuntimeError, match=r"all_reduce_grads_ belongs between client.step\(it\) and client.commit\(it\)"
    ):
        client.all_reduce_grads_([torch.nn.Parameter(torch.zeros(2))])
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    uri = train_one_stage(client, mod, opt, step=step)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "reduce")
    meta = decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    (call,) = meta["grad_reduce"]
    assert (
        [c["seq"] for c in meta["grad_clip"]] == [0, 2]
        and call["seq"] == 1
        and call["params"] == [1, 0]
        and call["world"] == 1
    )
    assert call["average"] is True and len(call["pre"]) == 2
    bias, weight = logs.get(RecordKey(Channel.reduced(0), 2, 0, 0)), logs.get(RecordKey(Channel.reduced(0), 2, 0, 1))
    assert bias.shape == mod.lin.bias.shape and weight.shape == mod.lin.weight.shape

    def again(stop: int) -> tuple[Any, torch.nn.Module]:
        fresh = Masked()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        return replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(logs),
            num_stages=1,
            stop_iteration=stop,
            loss_fn=mse,
        ), fresh

    rep, fresh = again(3)
    assert rep.ok and rep.steps_checked == 2
    # the logged sum replaces the replay's own gradients: the state is the live one, but the inputs to the call differed
    rep, fresh = again(4)
    assert same_state(fresh, mod) and rep.steps_checked == 3
    assert (
        rep.grad_mismatches
        == [{"stage": 0, "iteration": 3, "params": ["lin.bias"], "at": "before all_reduce_grads_ call 0"}]
        and rep.diverged
    )
    assert (
        "stage 0 iteration 3: the gradients before all_reduce_grads_ call 0 differ from the live ones (lin.bias)"
        in rep.unverified_reason
    )


def test_gradients_not_zeroed_after_a_step_are_reported_and_stop_the_replay(tmp_path, single_rank_group):
    """A loop that forgot ``optimizer.zero_grad()`` after a step: the next backward adds to the
    gradients the step used, which a replay (starting each iteration from none) cannot repeat; the
    replay said only that gradients differed "by a collective or a .data write". The client sees
    the stepped gradients untouched at the next schedule step (a ``grads_not_zeroed`` fault, META
    ``grads_carried``), and the plan and the replay stop there naming it. Zeroing in place counts."""
    client = SwiftlogClient(
        ClientConfig(run_id="nozero", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    stage = client.pipeline_stage(
        mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=mse)
    uri = ""
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt)
        plain_step(client, mod, opt, it, torch.Generator().manual_seed(it))
        client.commit(it)
        opt.step()
        if it != 2:  # forgotten once
            opt.zero_grad(set_to_none=it != 1)  # in place after iteration 1
    assert client.close().drained  # not "ok": a fault was reported (by commit(3))
    faults = [f for f in client.writer.recent_faults() if f.kind == "grads_not_zeroed"]
    assert (
        len(faults) == 1
        and "lin.weight, lin.bias" in faults[0].message
        and "optimizer.zero_grad()" in faults[0].message
    ), client.writer.recent_faults()
    logs = LogStore.open(tmp_path / "store", "nozero")
    metas = {it: decode_meta(logs.get(RecordKey(Channel.meta(0), it, 0))) for it in (2, 3)}
    assert metas[2]["grads_carried"] == [] and metas[3]["grads_carried"] == ["lin.weight", "lin.bias"]
    from replay import plan_recovery

    plan = plan_recovery(logs, [0])
    assert not plan.possible and any(
        "stage 0 iteration 3: the live loop did not zero the gradients" in r for r in plan.reasons
    ), plan.reasons

    def again(stop: int) -> Any:
        fresh = Masked()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        return replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(logs),
            num_stages=1,
            stop_iteration=stop,
            loss_fn=mse,
        )

    assert again(3).ok
    with pytest.raises(
        ReplayError,
        match=r"stage 0 iteration 3: the live loop did not zero the gradients after the previous optimizer step",
    ):
        again(4)


def test_reductions_and_clips_name_parameters_by_their_place_in_the_stage_module(tmp_path, single_rank_group):
    """A QA check: ``all_reduce_grads_(..., module=model.head)`` recorded positions in the
    submodule, which the replay looked up in the whole stage (the sum went to another parameter,
    or the shapes clashed); and with ``average=True`` a rank outside the group (torch's all_reduce
    does nothing there) divided by its "size", -1, negating its gradients."""
    client = SwiftlogClient(
        ClientConfig(run_id="pos", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 5))
    client.pipeline_stage(mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True))
    client.begin_iteration(0)
    mod[1].bias.grad = torch.ones(5)
    with pytest.raises(ValueError, match=r"this rank \(0\) is not a member of the group given"):
        client.all_reduce_grads_([mod[1].bias], group=dist.GroupMember.NON_GROUP_MEMBER, average=True)
    assert torch.equal(mod[1].bias.grad, torch.ones(5))
    client.all_reduce_grads_([mod[1].bias], module=mod[1], average=True)
    client.clip_grad_norm_([mod[1].bias], 1.0, module=mod[1])
    assert client._grad_ops.reduces[-1]["params"] == [3] and client._grad_ops.clips[-1]["params"] == [3]
    client.close()


class _FunctionalBatchNormInRecompute(torch.nn.Module):
    """Running statistics updated by ``F.batch_norm`` on the module's own buffers (the kernel leaves
    their version counters alone), inside activation recomputation: updated in the backward too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)
        self.register_buffer("rm", torch.zeros(5))
        self.register_buffer("rv", torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(h: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.batch_norm(self.lin(h), self.rm, self.rv, training=True, momentum=0.1)

        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


def test_buffers_a_backward_changes_without_a_version_bump_are_caught_outside_the_live_order(
    tmp_path, single_rank_group
):
    """A replay that cannot follow the live order (a parallel share, a group with other orders:
    here a ``select`` hook, as parallel replay uses) compared only the buffers' version counters
    around each backward; F.batch_norm updates a module's statistics without touching them, and
    the replay said "verified" with other statistics. In its first iteration it now compares the
    bytes too and stops with ReplayOrderError. Alone, the live order (GPipe: F0 F1 B0 B1) is exact."""
    from replay import ReplayHooks, ReplayOrderError

    client = SwiftlogClient(
        ClientConfig(run_id="fbn", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    mod = _FunctionalBatchNormInRecompute()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    uri = train_one_stage(client, mod, opt, iters=3, schedule="gpipe")
    assert client.close().ok

    def replay_it(**kw: Any) -> tuple[Any, torch.nn.Module]:
        fresh = _FunctionalBatchNormInRecompute()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        rep = replay_stage(
            StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
            LogReader(LogStore.open(tmp_path / "store", "fbn")),
            num_stages=1,
            stop_iteration=3,
            loss_fn=mse,
            **kw,
        )
        return rep, fresh

    rep, fresh = replay_it()
    assert rep.ok and torch.equal(fresh.rm, mod.rm) and torch.equal(fresh.rv, mod.rv) and same_state(fresh, mod)
    with pytest.raises(
        ReplayOrderError,
        match=r"iteration 1 micro-batch 0: the backward changed module buffers \(stage 0 rm, stage 0 rv\)",
    ):
        replay_it(hooks=ReplayHooks(select=lambda it, order: order))
