"""A rank holding several stages: placement, configuration, the client's checks, the rank's commit."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from logstore.errors import ConfigError
from trainer_client import ClientConfig, MultiStageClient, RecoveryConfig, SwiftlogClient, rank_stages
from trainer_client.commit import CommitCoordinator, meta_key
from trainer_client.errors import UnsupportedScheduleError
from trainer_client.mesh import stage_position


@pytest.mark.parametrize("style", ["loop", "v"])
@pytest.mark.parametrize(("ranks", "per_rank"), [(2, 2), (4, 2), (3, 4), (4, 3)])
def test_rank_stages_place_stages_as_torch_schedules_do(style: str, ranks: int, per_rank: int) -> None:
    torch_map = generate_rank_to_stage_mapping(ranks, ranks * per_rank, style)
    for r in range(ranks):
        assert rank_stages(r, ranks, per_rank, style) == tuple(sorted(torch_map[r]))
        for s in rank_stages(r, ranks, per_rank, style):
            assert stage_position(s, ranks, per_rank, style) == r


def test_a_config_with_several_stages_per_rank_names_its_stages_and_views(tmp_path: Path) -> None:
    c = ClientConfig(run_id="r", stage=1, num_stages=2, store_root=tmp_path, stages_per_rank=2, stage_style="v")
    assert c.stages == (1, 2) and c.num_pipeline_stages == 4
    view = c.stage_view(2)
    assert (view.stage, view.num_stages, view.stages_per_rank, view.store_root) == (2, 4, 1, c.store_root)
    with pytest.raises(ConfigError, match="holds stages \\[1, 2\\], not 3"):
        c.stage_view(3)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"stages_per_rank": 0}, "stages_per_rank must be an int >= 1"),
        ({"stages_per_rank": 2, "stage_style": "zigzag"}, "stage_style must be one of"),
        ({"stages_per_rank": 2, "dp_replicate": 2}, "not supported yet"),
        ({"stages_per_rank": 2, "logging_groups": [1, 1]}, "logging_groups with stages_per_rank"),
    ],
)
def test_bad_multi_stage_configs_are_refused_by_name(tmp_path: Path, kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ClientConfig(run_id="r", stage=0, num_stages=2, store_root=tmp_path, **kw)
    if "logging_groups" not in kw:
        with pytest.raises(ConfigError, match=match):
            RecoveryConfig(run_id="r", stage=0, num_stages=2, **kw)


def test_each_client_kind_refuses_the_other_kind_of_rank(tmp_path: Path) -> None:
    multi = ClientConfig(run_id="r", stage=0, num_stages=2, store_root=tmp_path / "a", stages_per_rank=2)
    with pytest.raises(ConfigError, match="needs a MultiStageClient"):
        SwiftlogClient(multi)
    with pytest.raises(ConfigError, match="stages_per_rank >= 2"):
        MultiStageClient(ClientConfig(run_id="r", stage=0, num_stages=2, store_root=tmp_path / "b"))


def test_the_schedule_must_be_a_multi_stage_one_of_the_configured_style(tmp_path: Path) -> None:
    config = ClientConfig(run_id="r", stage=0, num_stages=2, store_root=tmp_path, stages_per_rank=2)
    with MultiStageClient(config) as client:
        assert client.stages == (0, 2) and sorted(client.parts) == [0, 2]
        with pytest.raises(UnsupportedScheduleError, match="'gpipe' is not supported on a rank with several"):
            client.schedule([], "gpipe", n_microbatches=4, loss_fn=lambda o, t: o)
        with pytest.raises(UnsupportedScheduleError, match="'v' style, the config says 'loop'"):
            client.schedule([], "ZBVZeroBubble", n_microbatches=4, loss_fn=lambda o, t: o)
        with pytest.raises(UnsupportedScheduleError, match="needs the stages \\[0, 2\\]"):
            client.schedule([], "interleaved1f1b", n_microbatches=4, loss_fn=lambda o, t: o)
        with pytest.raises(KeyError, match="not 1"):
            client.part(1)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        with pytest.raises(ValueError, match="one SGD for the 2 stages \\[0, 2\\]: give one optimizer per stage"):
            client.track_optimizer(opt)
    with pytest.raises(ConfigError, match="log_data=False is not supported by MultiStageClient"):
        MultiStageClient(ClientConfig(run_id="r", stage=0, num_stages=2, store_root=tmp_path / "b",
                                      stages_per_rank=2, log_data=False))  # fmt: skip


def test_a_rank_reports_all_its_stages_done_in_one_commit() -> None:
    store = dist.HashStore()
    coords = [
        CommitCoordinator(store, stage=s, num_stages=3, prefix="p", timeout=timedelta(seconds=20)) for s in range(3)
    ]
    results: dict[str, object] = {}

    def rank_of_two() -> None:
        results["rank"] = coords[0].commit(5, b"meta0", also=[(coords[2], b"meta2")])

    t = threading.Thread(target=rank_of_two)
    t.start()
    results["other"] = coords[1].commit(5, b"meta1")
    t.join(20)
    assert {k: r.iteration for k, r in results.items()} == {"rank": 5, "other": 5}  # type: ignore[attr-defined]
    assert [store.get(meta_key("p", s, 5)) for s in range(3)] == [b"meta0", b"meta1", b"meta2"]


@pytest.fixture
def world_of_one() -> object:
    """A gloo world of this process alone (a rank holding every stage)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mlp(stage: int) -> torch.nn.Module:
    torch.manual_seed(stage)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())


def test_one_rank_logs_each_of_its_stages_with_the_weight_passes_in_meta(tmp_path: Path, world_of_one: object) -> None:
    """ZBV over one rank (stages 0 and 1, the V's tip): each stage's META records its forwards, its
    input-gradient passes and its weight-gradient passes; the commit reports both stages."""
    config = ClientConfig(run_id="r", stage=0, num_stages=1, store_root=tmp_path, stages_per_rank=2, stage_style="v")
    store = dist.HashStore()
    with MultiStageClient(config, commit_store=store) as client:
        io = torch.zeros(2, 8, requires_grad=True)
        stages = [client.pipeline_stage(_mlp(s), "cpu", stage=s, input_args=io, output_args=io) for s in (0, 1)]
        client.schedule(stages, "zbvzerobubble", n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
        g = torch.Generator().manual_seed(0)
        client.step(0, torch.randn(4, 8, generator=g), target=torch.randn(4, 8, generator=g))
        grads = [p.grad.clone() for st in stages for p in st.submod.parameters()]
        total = client.clip_grad_norm_(1e-3)  # the norm of both stages' gradients, each clipped by it
        assert torch.equal(total, torch.nn.utils.get_total_norm(grads))
        after = [p.grad for st in stages for p in st.submod.parameters()]
        assert torch.allclose(torch.nn.utils.get_total_norm(after), torch.tensor(1e-3), rtol=1e-3)
        report = client.commit(0)
        assert report.decision is not None and report.decision.iteration == 0
        client.flush()
        docs = {s: client.part(s)._meta.committed[1] for s in (0, 1)}
    for s, doc in docs.items():
        kinds = [k for k, _ in doc["order"]]
        assert (doc["stage"], doc["num_stages"], doc["schedule"]) == (s, 2, "ScheduleZBVZeroBubble")
        assert doc["split_backward"] and kinds.count("F") == kinds.count("I") == kinds.count("W") == 2
        assert "B" not in kinds  # every backward split: an input half ("I"), then a weight half ("W")
        assert store.check([meta_key(config.commit_prefix, s, 0)])
        (clip,) = doc["grad_clip"]
        assert clip["total_norm"] == float(total) and clip["max_norm"] == 1e-3


def test_a_zero_bubble_schedule_refuses_a_module_with_backward_hooks(tmp_path: Path, world_of_one: object) -> None:
    config = ClientConfig(run_id="r", stage=0, num_stages=1, store_root=tmp_path, stages_per_rank=2, stage_style="v")
    with MultiStageClient(config) as client:
        io = torch.zeros(2, 8, requires_grad=True)
        modules = [_mlp(0), _mlp(1)]
        modules[1][0].register_full_backward_pre_hook(lambda *_: None)
        stages = [
            client.pipeline_stage(m, "cpu", stage=s, input_args=io, output_args=io) for s, m in enumerate(modules)
        ]
        with pytest.raises(UnsupportedScheduleError, match="full backward hook of stage 1's module '0'"):
            client.schedule(stages, "zbvzerobubble", n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
