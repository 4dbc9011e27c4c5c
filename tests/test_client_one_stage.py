"""A one-stage pipeline in this process, logged and replayed exactly: schedules, shipping the
stage's own data, data sources and keyword inputs, autocast, declared tensors, module buffers, and
the loss function META names."""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from logstore import Channel, LogStore, RecordKey
from logstore.errors import ConfigError
from replay import LogReader, ReplayReport, StageState, replay_stage
from replay.errors import ReplayError, ReplayMismatchError
from tests._client_helpers import (
    Masked,
    mse,
    plain_step,
    same_state,
    single_rank_run,
)
from trainer_client import (
    ClientConfig,
    SwiftlogClient,
    UnsupportedScheduleError,
    load_checkpoint,
)
from trainer_client.config import CheckpointConfig, CommitConfig, StorageConfig
from trainer_client.meta import decode_meta, importable_name


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_schedules_and_a_one_stage_pipeline_replay_exactly(tmp_path, single_rank_group):
    from trainer_client.examples.gpt import (
        GPTConfig,
        SyntheticTokens,
        build_stage_module,
        example_io,
        loss_fn,
        make_lr_scheduler,
        make_optimizer,
    )

    cfg = GPTConfig(n_microbatches=3)
    config = ClientConfig(
        run_id="one",
        stage=0,
        num_stages=1,
        store_root=str(tmp_path / "store"),
        seed=5,
        cold_url=f"file://{tmp_path}/cold",
    )
    client = SwiftlogClient(config)
    mod = build_stage_module(cfg, 0, 1, seed=5)
    opt, data = make_optimizer(mod), SyntheticTokens(cfg, seed=5)
    sched = make_lr_scheduler(opt)
    inp, out = example_io(cfg, 0, 1)
    stage = client.pipeline_stage(mod, "cpu", input_args=inp, output_args=out)
    with pytest.raises(UnsupportedScheduleError) as ei:
        client.schedule(stage, "interleaved1f1b", n_microbatches=3, loss_fn=loss_fn)
    assert "gpipe" in str(ei.value) and "1f1b" in str(ei.value) and "MultiStageClient" in str(ei.value)
    with pytest.raises(UnsupportedScheduleError):
        client.schedule(stage, "gpipe", n_microbatches=3, loss_fn=None)
    client.schedule(stage, "gpipe", n_microbatches=3, loss_fn=loss_fn)
    with pytest.raises(ValueError):
        client.commit(0)  # no iteration begun
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt, sched)
        x, y = data(it)
        client.step(it, x, target=y)
        assert client.commit(it).logging_faults == []
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    report = client.close()
    assert report.ok and report.uploaded_segments >= 0
    assert uri.startswith("file://") and "checkpoint-files/stage00000/it000000000001.pt" in uri
    st = LogStore.open(tmp_path / "store", "one", cold_url=f"file://{tmp_path}/cold")
    assert st.watermarks() == {0: 1}
    fresh = build_stage_module(cfg, 0, 1, seed=5)
    fopt = make_optimizer(fresh)
    state = StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt, make_lr_scheduler(fopt))
    rep = replay_stage(state, LogReader(st), num_stages=1, stop_iteration=4, loss_fn=loss_fn)
    assert rep.ok and rep.digests_checked == 0 and rep.micro_batches == 9
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), mod.parameters(), strict=True))
    assert all(
        torch.equal(fopt.state_dict()["state"][i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"])
        for i in opt.state_dict()["state"]
    )


@pytest.mark.s3
@pytest.mark.slow
def test_a_dead_object_store_times_the_data_wait_out_once_then_commits_only_check(
    tmp_path, single_rank_group, moto_server, caplog
):
    """A first / last stage's commit waits for its logged inputs / targets to reach the cold tier.
    With the object store down that wait ends at ``ship_wait`` once, as a "ship_timeout" fault
    naming what is missing; later commits only check, so training goes on at its own pace, and
    say every ``ship_lag_report`` that the data is still behind ("ship_lag"); once the store is
    back and the backlog is up, commits wait (and succeed) again."""
    client = SwiftlogClient(
        ClientConfig(
            run_id="dead",
            stage=0,
            num_stages=1,
            store_root=str(tmp_path / "store"),
            seed=9,
            cold_url=moto_server.url(f"dead-{os.getpid()}"),
            storage=StorageConfig(cold_options=moto_server.storage_options),
            checkpoints=CheckpointConfig(url=str(tmp_path / "ckpt")),
            commit=CommitConfig(ship_wait=datetime.timedelta(seconds=3), ship_lag_report=datetime.timedelta(seconds=1)),
        )
    )
    stage = client.pipeline_stage(
        Masked(), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=mse)

    seen: list[Any] = []

    def iteration(it: int) -> list[Any]:
        g = torch.Generator().manual_seed(it)
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        faults = client.commit(it).logging_faults
        seen.extend(faults)
        return faults

    # the store is up: the commit waited, and it was there
    assert [f for f in iteration(0) if f.kind == "ship_timeout"] == []
    waited = client.stats()["commit"]["ship_wait_s"]
    moto_server.kill()
    try:
        faults = [f for it in range(1, 5) for f in iteration(it)]
        ship = [f for f in faults if f.kind == "ship_timeout"]
        assert (
            len(ship) == 1
            and ship[0].iteration == 1
            and "input_0/target_0 not in the cold tier after 3 s" in ship[0].message
        ), faults
        assert client.stats()["commit"]["ship_wait_s"] - waited >= 3.0  # one full wait; the others only checked
        time.sleep(1.1)
        lag = [f for f in iteration(5) if f.kind == "ship_lag"]  # still behind, a report interval later: said again
        assert (
            len(lag) == 1 and "input_0/target_0 are still not all in the cold tier since iteration 1" in lag[0].message
        ), lag
    finally:
        moto_server.restart()
    assert client.store.wait_shipped([Channel.input(0), Channel.target(0)], 5, 300)  # the backlog goes up
    it = 6
    with caplog.at_level(logging.INFO, logger="trainer_client._shipping"):
        assert [f for f in iteration(it) if f.kind == "ship_timeout"] == []  # caught up: waited, in time
    assert f"caught up by iteration {it}" in caplog.text
    it += 1
    assert [f for f in iteration(it) if f.kind in ("ship_timeout", "ship_lag")] == []  # waits again, and ships in time
    assert client.store.wait_shipped([Channel.input(0), Channel.target(0)], it, 0.0)
    rep = client.close()  # everything went up; the faults are still on the record
    assert (
        rep.drained
        and rep.error is None
        and rep.faults_total == len(seen) == 1 + len([f for f in seen if f.kind == "ship_lag"])
    ), seen


def test_inputs_and_targets_ship_as_soon_as_the_last_micro_batch_logged_them(tmp_path, single_rank_group):
    """The data wait of the commit overlaps the iteration: once the schedule step logged every
    micro-batch's inputs and targets, they are sealed and shipped without waiting for the commit."""
    client = SwiftlogClient(
        ClientConfig(
            run_id="early",
            stage=0,
            num_stages=1,
            store_root=str(tmp_path / "store"),
            seed=9,
            cold_url=f"file://{tmp_path}/cold",
            checkpoints=CheckpointConfig(url=str(tmp_path / "ckpt")),
        )
    )
    stage = client.pipeline_stage(
        Masked(), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=mse)
    g = torch.Generator().manual_seed(0)
    client.step(0, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
    deadline, shipped = time.monotonic() + 30, []
    while len(shipped) < 4 and time.monotonic() < deadline:  # no commit yet: what another machine sees
        with LogStore.open(tmp_path / "elsewhere", "early", cold_url=f"file://{tmp_path}/cold") as other:
            shipped = other.keys(Channel.input(0)) + other.keys(Channel.target(0))
        time.sleep(0.05)
    assert sorted(str(k) for k in shipped) == [
        "input_0/it0/mb0/p0",
        "input_0/it0/mb1/p0",
        "target_0/it0/mb0/p0",
        "target_0/it0/mb1/p0",
    ]
    assert client.commit(0).logging_faults == []
    client.close()


def test_a_data_source_may_give_keyword_inputs(tmp_path, single_rank_group):
    """A data source's batch may carry keyword inputs (a dict last): the step passes them to stage 0
    by name, nothing is logged (log_data=False), and a replay given the same source passes them again."""

    def source(it: int) -> tuple[Any, torch.Tensor]:
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        return (
            x,
            {"mask": (torch.rand(4, 5, generator=g) > 0.5).float(), "scale": torch.rand(4, 1, generator=g) + 0.5},
        ), y

    client = SwiftlogClient(
        ClientConfig(run_id="src", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9, log_data=False),
        data_source=source,
    )
    mod = Masked()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    stage = client.pipeline_stage(
        mod, "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=mse)
    for it in range(4):
        if it == 1:
            uri = client.checkpoint(1, mod, opt)
        client.step(it)
        client.commit(it)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert client.close().ok
    logs = LogStore.open(tmp_path / "store", "src")
    assert logs.keys(Channel.input(0)) == []
    fresh = Masked()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    rep = replay_stage(
        StageState.from_checkpoint(load_checkpoint(uri), fresh, fopt),
        LogReader(logs),
        num_stages=1,
        stop_iteration=4,
        loss_fn=mse,
        data_source=source,
    )
    assert rep.ok and same_state(mod, fresh)


def test_keyword_inputs_of_the_first_stage_are_logged_and_replayed(tmp_path, single_rank_group):
    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        mask, scale = (torch.rand(4, 5, generator=g) > 0.5).float(), torch.rand(4, 1, generator=g) + 0.5
        client.step(it, x, target=y, mask=mask, scale=scale)

    mod, opt, logs, fresh, fopt, rep = single_rank_run(
        tmp_path, "kw", lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), step
    )
    meta = decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    # iterations 1-3 (0 is garbage), 2 micro-batches, x + 2 keywords
    assert meta["input_kwargs"] == ["mask", "scale"] and len(logs.keys(Channel.input(0))) == 3 * 2 * 3
    assert rep.ok and rep.micro_batches == 6 and same_state(fresh, mod)
    assert torch.equal(
        fopt.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )


def test_a_divergence_after_a_matching_first_iteration_points_at_the_update():
    """A replay whose first iteration matched but a later one did not: the hint names what changes an
    update behind the client's back (torch's clip_grad_norm_ called directly); a divergence in the first
    iteration points at determinism instead."""
    key = lambda it: str(RecordKey(Channel.activation(1), it, 0))  # noqa: E731
    for it, words in ((3, "client.clip_grad_norm_"), (2, "trainer_client.determinism")):
        rep = ReplayReport([1], 2, 5)
        rep.digest_mismatches.append(key(it))
        with pytest.raises(ReplayMismatchError) as ei:
            rep.raise_for_mismatch()
        assert words in (ei.value.hint or "") and f"iteration {it} " in str(ei.value)


def test_example_args_that_cannot_carry_gradients_are_refused_up_front(tmp_path):
    """torch's schedules fail in backward ("grad can be implicitly created only for scalar
    outputs") when a stage's floating output_args (or a later stage's input_args) do not require
    grad: pipeline_stage says so before anything runs (two new users hit it)."""
    mod = torch.nn.Linear(4, 4)
    for stage, kw, needle in (
        (0, {"input_args": torch.zeros(2, 4), "output_args": torch.zeros(2, 4)}, "output_args requires grad"),
        (1, {"input_args": torch.zeros(2, 4), "output_args": torch.zeros(2, 4)}, "input_args requires grad"),
    ):
        client = SwiftlogClient(
            ClientConfig(run_id="args", stage=stage, num_stages=2, store_root=str(tmp_path / f"s{stage}"))
        )
        with pytest.raises(ConfigError, match=needle) as ei:
            client.pipeline_stage(mod, "cpu", **kw)
        assert "requires_grad=True" in (ei.value.hint or "")
        client.close()


def test_a_step_under_autocast_is_recorded_and_replayed_under_it(tmp_path, single_rank_group):
    def step(
        client: SwiftlogClient, mod: torch.nn.Module, opt: torch.optim.Optimizer, it: int, g: torch.Generator
    ) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))

    mod, _, logs, fresh, _, rep = single_rank_run(
        tmp_path, "amp", lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), step, out_dtype=torch.bfloat16
    )
    meta = decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    assert (
        meta["autocast"] == [{"device_type": "cpu", "dtype": "bfloat16", "cache_enabled": True}]
        and not meta["autocast_varies"]
    )
    assert rep.ok and rep.micro_batches == 6 and same_state(fresh, mod)


def test_a_send_that_differs_from_the_declared_output_is_refused(tmp_path):
    """torch's pipelining receives into buffers of the declared type without converting: a bf16 output
    declared float32 (autocast) corrupts what arrives, so the client raises before the send, naming it
    (and notes the fault)."""
    from types import SimpleNamespace

    client = SwiftlogClient(ClientConfig(run_id="decl", stage=0, num_stages=2, store_root=str(tmp_path / "store")))
    declared = [SimpleNamespace(dtype=torch.float32, shape=torch.Size([4, 32]))]
    client.recorder.check_declared_sends([torch.zeros(4, 32)], declared)
    client.recorder.check_declared_sends([torch.zeros(4, 32)], None)  # nothing declared: nothing to compare
    assert client.writer.take_faults() == []
    with pytest.raises(
        ConfigError, match=r"stage 0 sends output 0 as bfloat16 \[4, 32\] but declared float32 \[4, 32\]"
    ):
        client.recorder.check_declared_sends([torch.zeros(4, 32, dtype=torch.bfloat16)], declared)
    (fault,) = client.writer.take_faults()
    assert fault.kind == "send_mismatch" and "bfloat16 [4, 32] but declared float32 [4, 32]" in fault.message
    client.close()


def test_a_buffer_snapshot_sees_changes_by_content_and_puts_them_back():
    from trainer_client.buffers import BufferSnapshot, named_buffers

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    m.register_buffer("zero", torch.zeros(2))
    snap = BufferSnapshot()
    snap.take(named_buffers({"": m}))
    versions = m[1].running_mean._version
    m(torch.randn(8, 4))  # BatchNorm's kernel moves its statistics without bumping their version counters
    assert m[1].running_mean._version == versions
    assert snap.changed(named_buffers({"": m})) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    m.zero.neg_()  # -0.0: equal as numbers, different bits
    m.register_buffer("grown", torch.ones(3))
    assert snap.changed(named_buffers({"": m})) == [
        "1.num_batches_tracked",
        "1.running_mean",
        "1.running_var",
        "grown",
        "zero",
    ]
    m[1].running_var = torch.ones(7)  # replaced by a tensor of another shape
    snap.restore(m)
    assert (
        torch.equal(m[1].running_mean, torch.zeros(4))
        and torch.equal(m[1].running_var, torch.ones(4))
        and int(m[1].num_batches_tracked) == 0
    )
    assert not torch.signbit(m.zero).any()
    assert m.grown is None and "grown" not in m.state_dict()  # appeared during the discarded iteration: gone again
    assert snap.changed(named_buffers({"": m})) == []


def test_a_second_schedule_step_of_one_iteration_is_refused(tmp_path, single_rank_group):
    """Gradient accumulation over two ``client.step`` calls per optimizer step was accepted, and a
    recovery said "verified" with another state (a QA check): a replay repeats one schedule step
    per iteration. A second step of one iteration before its commit is refused, naming the way out."""
    client = SwiftlogClient(
        ClientConfig(run_id="twice", stage=0, num_stages=1, store_root=str(tmp_path / "store"), seed=9)
    )
    stage = client.pipeline_stage(
        Masked(), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=mse)
    x, y = torch.randn(4, 8), torch.randn(4, 5)
    client.step(0, x, target=y)
    with pytest.raises(RuntimeError, match=r"client\.step\(0\) again before client\.commit\(0\).*n_microbatches"):
        client.step(0, x, target=y)
    client.commit(0)
    client.step(1, x, target=y)  # the next iteration is fine
    client.abort(1)
    client.step(1, x, target=y)  # and so is an aborted iteration run again
    assert client.close().ok


class _Huber(torch.nn.Module):
    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.huber_loss(out, target)


def test_importable_name_names_only_what_another_process_can_import():
    """META names the schedule's loss function only when the name imports back to the same object."""
    assert importable_name(mse) == f"{mse.__module__}:mse"
    assert importable_name(torch.nn.functional.mse_loss) == "torch.nn.functional:mse_loss"
    assert importable_name(_Huber.forward) == f"{_Huber.__module__}:_Huber.forward"
    for unnamed in (
        lambda o, t: mse(o, t),
        _Huber(),
        __import__("functools").partial(mse),
        _Huber().forward,
        print.__self__,
    ):
        assert importable_name(unnamed) is None, unnamed


def test_a_replay_of_the_last_stage_imports_the_loss_function_meta_names(tmp_path, single_rank_group):
    """No loss function given: the replay uses the live schedule's, by the name META recorded."""
    mod, _, logs, fresh, _, rep = single_rank_run(
        tmp_path, "named", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), plain_step, replay_loss=None
    )
    meta = decode_meta(logs.get(RecordKey(Channel.meta(0), 2, 0)))
    assert meta["loss"] == f"{mse.__module__}:mse"
    assert rep.ok and same_state(mod, fresh)  # (one stage: no sends to verify; the state is the check)


def test_a_loss_function_meta_cannot_name_must_be_passed_to_the_replay(tmp_path, single_rank_group):
    """A callable instance has no importable name: META says what it was, and the replay asks for it
    instead of replaying with some other loss."""
    with pytest.raises(
        ReplayError,
        match=r"replaying the last stage \(0\) needs its loss function: "
        r"the live schedule's loss_fn \(_Huber\(\)\) has no importable name",
    ) as e:
        single_rank_run(
            tmp_path,
            "unnamed",
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            plain_step,
            loss_fn=_Huber(),
            replay_loss=None,
        )
    assert "--loss module:attr" in (e.value.hint or "")
    meta = decode_meta(LogStore.open(tmp_path / "store", "unnamed").get(RecordKey(Channel.meta(0), 2, 0)))
    assert meta["loss"] is None and meta["loss_repr"] == "_Huber()"
