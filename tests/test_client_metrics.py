"""The training client's counters as Prometheus metrics: a per-rank exporter switched on from
ClientConfig, scraped over real HTTP on loopback."""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from logstore.errors import ConfigError
from trainer_client import ClientConfig, SwiftlogClient
from trainer_client.config import CheckpointConfig, CommitConfig, MetricsConfig, StorageConfig, WriterConfig

LABELS = {"run": "m", "stage": "1", "writer": "stage1"}


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the exporter serves: (name, sorted labels) -> value."""
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **extra: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **extra}.items())))]


def _config(tmp_path, **kw: Any) -> ClientConfig:
    return ClientConfig(run_id="m", stage=1, num_stages=2, store_root=str(tmp_path / "store"), **kw)


def test_the_exporter_serves_what_stats_says_at_scrape_time_and_stops_at_close(tmp_path):
    client = SwiftlogClient(
        _config(
            tmp_path,
            metrics=MetricsConfig(port=0),
            writer=WriterConfig(max_queue_bytes=1000, overflow="gap"),
        )
    )
    host, port = client.metrics_address
    assert host == "127.0.0.1" and port > 0
    gate = threading.Event()
    client.writer.mark(gate.wait)  # the writer is busy: what is queued stays queued
    assert client.log_send(torch.zeros(200), 0, "gradient", 0, 0)  # 800 bytes queued
    assert not client.log_send(torch.zeros(200), 0, "gradient", 0, 1)  # beyond the bound: a gap
    m = _scrape(port)
    assert _value(m, "swiftlog_client_queue_bytes") == 800
    assert _value(m, "swiftlog_client_overflow_drops_total") == 1
    assert _value(m, "swiftlog_client_faults_total", kind="overflow") == 1
    assert _value(m, "swiftlog_client_records_written_total") == 0
    gate.set()
    assert client.writer.drain(30)
    m = _scrape(port)  # read again at this scrape: nothing was pushed by the training thread
    w = client.stats()["writer"]
    assert _value(m, "swiftlog_client_queue_bytes") == w["queue_bytes"] == 0
    assert _value(m, "swiftlog_client_records_written_total") == w["records_written"] == 1
    assert _value(m, "swiftlog_client_gaps_recorded_total") == w["gaps_recorded"] == 1
    assert _value(m, "swiftlog_client_overflow_wait_seconds_total") == w["overflow_wait_s"]
    assert _value(m, "swiftlog_client_ship_lagging") == 0
    assert _value(m, "swiftlog_client_logging_enabled") == 1
    assert not any(n.startswith("swiftlog_client") for n in REGISTRY._names_to_collectors)  # a registry of its own
    client.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_a_port_in_use_is_a_config_error_naming_it_and_nothing_is_left_open(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"MetricsConfig.port.*127.0.0.1:{port}"):
            SwiftlogClient(_config(tmp_path, metrics=MetricsConfig(port=port)))
    finally:
        taken.close()
    # the failed one left no writer lock on the store
    again = SwiftlogClient(_config(tmp_path, metrics=MetricsConfig(port=0)))
    again.close()


@pytest.mark.parametrize(
    "kw",
    [{"port": -1}, {"port": 70000}, {"port": "9100"}, {"port": 0, "host": ""}],
)
def test_bad_metrics_settings_are_refused_naming_the_field(tmp_path, kw):
    with pytest.raises(ConfigError, match=r"MetricsConfig\." + (next(iter(kw)) if len(kw) == 1 else "host")):
        _config(tmp_path, metrics=MetricsConfig(**kw))


def test_ship_lag_is_exported_once_the_cold_tier_falls_behind(tmp_path, single_rank_group):
    """A first stage whose object store is down: its commit's wait for its inputs times out, and the
    exporter says the stage's data is lagging, by how many iterations."""
    with socket.socket() as s:  # a loopback port nothing listens on: the object store is down
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cfg = ClientConfig(
        run_id="m",
        stage=0,
        num_stages=1,
        store_root=str(tmp_path / "store"),
        metrics=MetricsConfig(port=0),
        cold_url="s3://swiftlog-dead/logs",
        checkpoints=CheckpointConfig(url=str(tmp_path / "ckpt")),
        storage=StorageConfig(cold_options={"endpoint_url": f"http://127.0.0.1:{dead}", "key": "k", "secret": "s"}),
        commit=CommitConfig(ship_wait=datetime.timedelta(seconds=0.5)),
    )
    client = SwiftlogClient(cfg)
    stage = client.pipeline_stage(
        torch.nn.Linear(8, 5), "cpu", input_args=torch.zeros(2, 8), output_args=torch.zeros(2, 5, requires_grad=True)
    )
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    for it in range(3):
        g = torch.Generator().manual_seed(it)
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        client.commit(it)
    m = _scrape(client.metrics_address[1])
    labels = {"run": "m", "stage": "0", "writer": "stage0"}
    c = client.stats()["commit"]
    assert c["ship_lagging"] and c["ship_lag_since"] == 0
    assert m[("swiftlog_client_ship_lagging", tuple(sorted(labels.items())))] == 1
    assert m[("swiftlog_client_ship_lag_iterations", tuple(sorted(labels.items())))] == 3  # iterations 0, 1, 2 behind
    assert m[("swiftlog_client_faults_total", tuple(sorted({**labels, "kind": "ship_timeout"}.items())))] == 1
    assert m[("swiftlog_client_ship_wait_seconds_total", tuple(sorted(labels.items())))] >= 0.5
    client.close(flush=False, timeout=10)
