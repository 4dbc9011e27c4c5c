"""Session-scoped real pipeline runs shared by the replay tests (``pytest_plugins = ["tests._replay_fixtures"]``).

See :mod:`tests._replay_helpers` for what each run is and the helpers that go with them.
"""

from __future__ import annotations

import uuid

import pytest

from logstore.testing.s3servers import MotoServer
from tests._client_mp import run_pipeline
from tests._replay_helpers import CKPT, ITERS, Run, file_run

__all__ = [
    "gpipe_s3_run",
    "f1b_run",
    "dcp_run",
    "groups_run",
    "groups_gpipe_run",
    "gap_run",
    "batchnorm_run",
    "clip_run",
    "autocast_run",
    "recompute_bn_run",
    "recompute_bn_gpipe_run",
    "tied_run",
    "raw_tied_run",
]


@pytest.fixture(scope="session")
def gpipe_s3_run(tmp_path_factory: pytest.TempPathFactory, moto_server: MotoServer) -> Run:
    """GPipe with its cold tier and checkpoints on the session's moto server (tests/conftest.py)."""
    base = tmp_path_factory.mktemp("gpipe-s3")
    if not moto_server.is_running:  # a fault-injection test may have stopped it
        moto_server.restart()
    url = moto_server.url(f"replay-gpipe-{uuid.uuid4().hex[:8]}")
    extra = [
        "--cold-url",
        url,
        "--cold-endpoint",
        moto_server.endpoint_url,
        "--cold-key",
        moto_server.access_key,
        "--cold-secret",
        moto_server.secret_key,
    ]
    pipe = run_pipeline(base, "gpipe-s3", schedule="gpipe", iters=ITERS, ckpt_at=str(CKPT), cold=False, extra=extra)
    return Run(pipe, url, dict(moto_server.storage_options))


@pytest.fixture(scope="session")
def f1b_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return file_run(tmp_path_factory.mktemp("f1b"), "f1b", "1f1b")


@pytest.fixture(scope="session")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """1F1B whose checkpoints are torch.distributed.checkpoint directories (async saves)."""
    return file_run(tmp_path_factory.mktemp("dcp"), "dcp", "1f1b", extra=["--checkpoint-format", "dcp-async"])


@pytest.fixture(scope="session")
def groups_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return file_run(tmp_path_factory.mktemp("groups"), "groups", "1f1b", extra=["--groups", "2,2"])


@pytest.fixture(scope="session")
def groups_gpipe_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """GPipe with logging groups [1, 3]: only the 0|1 boundary is logged."""
    return file_run(tmp_path_factory.mktemp("groups-gpipe"), "groups-gpipe", "gpipe", extra=["--groups", "1,3"])


@pytest.fixture(scope="session")
def batchnorm_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """GPipe with a BatchNorm before every MLP: forwards that update module buffers (running statistics)."""
    return file_run(tmp_path_factory.mktemp("batchnorm"), "batchnorm", "gpipe", extra=["--mlp-norm", "batch"])


@pytest.fixture(scope="session")
def recompute_bn_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """1F1B with a BatchNorm inside activation recomputation: the backward re-runs each block's
    forward, so the running statistics are also updated in the backward, and where depends on how
    the live stage interleaved forwards and backwards."""
    return file_run(
        tmp_path_factory.mktemp("recompute-bn"), "recompute-bn", "1f1b", extra=["--mlp-norm", "batch", "--recompute"]
    )


@pytest.fixture(scope="session")
def recompute_bn_gpipe_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same under GPipe: every stage ran one order (all forwards, then all backwards)."""
    return file_run(
        tmp_path_factory.mktemp("recompute-bn-gpipe"),
        "recompute-bn-gpipe",
        "gpipe",
        extra=["--mlp-norm", "batch", "--recompute"],
    )


@pytest.fixture(scope="session")
def clip_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """1F1B with gradients clipped to a global norm over all four stages (client.clip_grad_norm_)."""
    return file_run(tmp_path_factory.mktemp("clip"), "clip", "1f1b", extra=["--clip-grad-norm", "0.05"])


@pytest.fixture(scope="session")
def autocast_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """1F1B with every schedule step under torch.autocast (CPU, bfloat16)."""
    return file_run(tmp_path_factory.mktemp("autocast"), "autocast", "1f1b", extra=["--autocast", "bf16"])


@pytest.fixture(scope="session")
def tied_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """1F1B with the first stage's embedding tied to the last stage's head: their gradients summed
    over the two stages by client.all_reduce_grads_ each iteration, then clipped to a global norm."""
    return file_run(
        tmp_path_factory.mktemp("tied"),
        "tied",
        "1f1b",
        extra=["--tie-embeddings", "client", "--clip-grad-norm", "0.05"],
    )


@pytest.fixture(scope="session")
def raw_tied_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same tie summed by a plain dist.all_reduce, which no replay can repeat."""
    return file_run(tmp_path_factory.mktemp("raw-tied"), "raw-tied", "gpipe", extra=["--tie-embeddings", "raw"])


@pytest.fixture(scope="session")
def gap_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return file_run(
        tmp_path_factory.mktemp("gap"),
        "gap",
        "gpipe",
        per_stage={0: ["--max-queue-bytes", "1024", "--overflow", "gap"]},
    )
