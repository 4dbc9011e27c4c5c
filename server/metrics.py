"""Prometheus metrics of one server: HTTP requests and the node's store, on a private registry.

Request metrics: ``swiftlog_http_requests_total{method,route,status}`` and
``swiftlog_http_request_duration_seconds{method,route}``. Store metrics, per run, from the run
summaries (the same short cache the summary endpoint uses, so a scrape costs at most one
summary computation per run): records, raw/stored bytes per tier, hot disk bytes, cold object
bytes, segments per state, watermarks, and the summary's age.

Never: registers on prometheus_client's global registry (several apps may live in one process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from logstore.errors import SwiftlogError
from server.node import Node

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StoreCollector(Collector):
    def __init__(self, node: Node) -> None:
        self.node = node

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # registration must not compute summaries

    def collect(self) -> Iterator[GaugeMetricFamily]:
        records = GaugeMetricFamily("swiftlog_store_records", "Records per run and tier", labels=["run", "tier"])
        stored = GaugeMetricFamily(
            "swiftlog_store_stored_bytes", "Encoded record bytes per run and tier", labels=["run", "tier"]
        )
        raw = GaugeMetricFamily("swiftlog_store_raw_bytes", "Raw tensor bytes per run and tier", labels=["run", "tier"])
        disk = GaugeMetricFamily(
            "swiftlog_store_hot_disk_bytes", "Hot tier bytes on disk (index and segments)", labels=["run"]
        )
        objects = GaugeMetricFamily("swiftlog_store_cold_object_bytes", "Cold tier object bytes", labels=["run"])
        segments = GaugeMetricFamily("swiftlog_store_hot_segments", "Hot segments per state", labels=["run", "state"])
        wms = GaugeMetricFamily(
            "swiftlog_store_watermark_iteration", "Newest durable checkpoint per stage", labels=["run", "stage"]
        )
        age = GaugeMetricFamily(
            "swiftlog_store_summary_age_seconds", "Age of the summary these values come from", labels=["run"]
        )
        now = time.time()
        try:
            runs = self.node.run_names()
        except OSError as e:
            logger.warning("metrics: cannot list runs: %s", e)
            runs = []
        for run in runs:
            try:
                s = self.node.summary(run)
            except SwiftlogError as e:
                logger.warning("metrics: no summary of run %s: %s", run, e)
                continue
            tiers = [("hot", s.hot)] + ([("cold", s.cold)] if s.cold is not None else [])
            for tier, t in tiers:
                records.add_metric([run, tier], t.records)
                stored.add_metric([run, tier], t.stored_bytes)
                raw.add_metric([run, tier], t.raw_bytes)
            disk.add_metric([run], s.hot.disk_bytes)
            if s.cold is not None:
                objects.add_metric([run], s.cold.object_bytes)
            for state, n in s.hot.segments.model_dump().items():
                segments.add_metric([run, state], n)
            for w in s.watermarks:
                wms.add_metric([run, str(w.stage)], w.iteration)
            age.add_metric([run], max(0.0, now - s.as_of))
        yield from (records, stored, raw, disk, objects, segments, wms, age)


class ServerMetrics:
    """The registry of one app, fed by MetricsMiddleware and read by GET /metrics."""

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "swiftlog_http_requests", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "swiftlog_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(node))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
