"""The trainer client's configuration: ClientConfig and its nested configs, validated up front,
and built the same way by both example scripts."""

from __future__ import annotations

import os

import pytest

from logstore.errors import ConfigError
from trainer_client import (
    ClientConfig,
)
from trainer_client.config import CheckpointConfig, CommitConfig, WriterConfig, group_starts


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stage": 4}, "stage"),
        ({"num_stages": 0}, "num_stages"),
        ({"logging_groups": [2, 1]}, "logging_groups"),
        ({"logging_groups": [4, 0]}, "logging_groups"),
        ({"writer": lambda: WriterConfig(overflow="drop")}, "WriterConfig.overflow"),
        ({"writer": lambda: WriterConfig(codec="lz4")}, "WriterConfig.codec"),
        ({"writer": lambda: WriterConfig(max_queue_bytes=0)}, "WriterConfig.max_queue_bytes"),
        ({"writer": lambda: WriterConfig(encode_threads=-1)}, "WriterConfig.encode_threads"),
        ({"seed": -1}, "seed"),
        ({"commit": lambda: CommitConfig(timeout=5)}, "CommitConfig.timeout"),
        ({"checkpoints": lambda: CheckpointConfig(keep=1)}, "CheckpointConfig.keep"),
        ({"writer": "fast"}, "writer must be a WriterConfig"),
        ({"run_id": "../x"}, "run id"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(tmp_path, kwargs, field):
    base = {"run_id": "r", "stage": 0, "num_stages": 4, "store_root": str(tmp_path)}
    with pytest.raises(ConfigError) as ei:
        ClientConfig(**{**base, **{k: v() if callable(v) else v for k, v in kwargs.items()}})
    assert field in str(ei.value)


def test_config_defaults_and_boundaries(tmp_path):
    c = ClientConfig(run_id="r", stage=2, num_stages=4, store_root=str(tmp_path))
    assert (
        c.writer_name == "stage2"
        and c.commit_prefix == "swiftlog/r"
        and c.logs_forward_send()
        and c.logs_backward_send()
    )
    assert c.resolved_checkpoint_url() == os.path.join(str(tmp_path), "r", "checkpoint-files")
    assert group_starts([2, 2], 4) == {0, 2} and group_starts(None, 3) == {0, 1, 2}
    g = [
        ClientConfig(run_id="r", stage=k, num_stages=4, store_root=str(tmp_path), logging_groups=[2, 2])
        for k in range(4)
    ]
    assert [x.logs_forward_send() for x in g] == [False, True, False, False]
    assert [x.logs_backward_send() for x in g] == [False, False, True, False]
    assert [x.group_of() for x in g] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    cold = ClientConfig(run_id="r", stage=0, num_stages=1, store_root=str(tmp_path), cold_url="s3://b/p")
    assert cold.resolved_checkpoint_url() == "s3://b/p/r/checkpoint-files"
    assert c.writer.encode_threads is None  # chosen by the writer at the first record


def test_a_torchrun_restart_commits_under_its_own_prefix(tmp_path, monkeypatch):
    """torchrun --max-restarts restarts every worker while its agent's store (the commit store)
    lives on: the redone iterations must not find the first attempt's decisions."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path)).commit_prefix == "swiftlog/r"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert (
        ClientConfig(run_id="r", stage=0, num_stages=2, store_root=str(tmp_path)).commit_prefix == "swiftlog/r/restart2"
    )
    assert (
        ClientConfig(
            run_id="r", stage=0, num_stages=2, store_root=str(tmp_path), commit=CommitConfig(prefix="mine")
        ).commit_prefix
        == "mine"
    )


def test_both_example_scripts_build_the_client_config_from_the_same_arguments():
    from trainer_client.examples import train_pipeline, train_resilient

    argv = [
        "--stage",
        "1",
        "--num-stages",
        "4",
        "--store-port",
        "1",
        "--out",
        "o",
        "--run-id",
        "r",
        "--store-root",
        "/tmp/x",
        "--cold-url",
        "s3://b/p",
        "--cold-endpoint",
        "http://127.0.0.1:9",
        "--max-queue-bytes",
        "1000",
        "--overflow",
        "gap",
        "--max-backlog-bytes",
        "5000",
        "--encode-threads",
        "2",
        "--groups",
        "2,2",
    ]
    for mod in (train_pipeline, train_resilient):
        cfg = train_pipeline.config_from_args(mod.build_parser().parse_args(argv))
        w, st = cfg.writer, cfg.storage
        assert (cfg.stage, w.max_queue_bytes, w.overflow, st.max_backlog_bytes, w.encode_threads) == (
            1,
            1000,
            "gap",
            5000,
            2,
        )
        assert cfg.storage.cold_options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9" and list(
            cfg.logging_groups
        ) == [2, 2]


def test_logging_groups_take_the_group_planners_output_as_it_comes(tmp_path):
    from replay.group_planner import plan_groups
    from replay.profile import JobProfile

    p = JobProfile(
        run_id="r",
        num_stages=4,
        activation_bytes=[1e6, 1e5, 1e6],
        gradient_bytes=[1e6, 1e5, 1e6],
        replay_s=[0.1] * 4,
        step_s=[0.2] * 4,
        iteration_s=0.2,
        checkpoint_interval=10,
        fetch_mbps=100.0,
        n_microbatches=4,
        domains=[0, 1, 2, 3],
        replicated=[False] * 4,
    )
    plan = plan_groups(p, budget_fraction=0.1)
    for given in (plan, plan.to_dict()):  # the object, or the --json / REST document
        cfg = ClientConfig(run_id="r", stage=0, num_stages=4, store_root=str(tmp_path), logging_groups=given)
        assert cfg.logging_groups == plan.sizes == (2, 2)
    with pytest.raises(ConfigError, match="needs 'sizes'"):
        ClientConfig(run_id="r", stage=0, num_stages=4, store_root=str(tmp_path), logging_groups={"groups": [[0]]})
    with pytest.raises(ConfigError, match="group sizes or a group plan"):
        ClientConfig(run_id="r", stage=0, num_stages=4, store_root=str(tmp_path), logging_groups="2,2")


def test_group_of_names_a_stages_logging_group():
    from trainer_client.config import group_of

    assert group_of([2, 2], 1, 4) == [0, 1] and group_of([2, 2], 2, 4) == [2, 3]
    assert group_of([1, 3], 2, 4) == [1, 2, 3] and group_of(None, 2, 4) == [2]
