"""Prometheus metrics of one training client, served per rank and read at scrape time.

``MetricsConfig.port`` switches the exporter on: the client then serves
``http://{host}:{port}/metrics`` (127.0.0.1 by default) from prometheus_client's own
server thread, on a registry of its own. Each scrape calls ``client.stats()`` on that thread and
turns the numbers into metric families, so the training thread does no work for the metrics.
Every series carries the labels ``run``, ``stage`` and ``writer``; the table in
``docs/architecture.md`` lists them.

Never: runs on the training thread; registers on prometheus_client's global registry (several
clients may live in one process); asks the log store or the object store anything during a
scrape; keeps a closed client's port open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from logstore.errors import ConfigError

__all__ = ["MetricsExporter"]

logger = logging.getLogger(__name__)

_PREFIX = "swiftlog_client_"

# (key in stats()["writer"], help). The metric's name is the key, "_s" spelled "_seconds";
# prometheus_client adds "_total" to a counter's.
_WRITER_GAUGES = (
    ("queue_bytes", "Bytes of queued records not yet written (raw tensor bytes)"),
    ("queue_peak_bytes", "Most bytes of records ever queued at once"),
    ("queue_items", "Queued items: records, digests, gaps and markers"),
    ("digest_bytes", "Bytes of received buffers held until hashed"),
    ("pinned_bytes", "Pinned host memory held for device-to-host copies"),
)
_WRITER_COUNTERS = (
    ("records_submitted", "Records submitted for logging"),
    ("bytes_submitted", "Raw bytes submitted for logging"),
    ("records_written", "Records written to the log store"),
    ("bytes_written", "Raw bytes written to the log store"),
    ("stored_bytes_written", "Encoded bytes written to the log store"),
    ("records_dropped", "Records dropped (overflow, faults, close)"),
    ("bytes_dropped", "Raw bytes of dropped records"),
    ("gaps_recorded", "Gaps recorded in the log store"),
    ("overflow_drops", "Records dropped at the queue bound"),
    ("overflow_waits", "Times the training thread waited at the queue bound"),
    ("overflow_wait_s", "Seconds the training thread waited at the queue bound"),
    ("overflow_timeouts", "Waits at the queue bound that timed out (the record became a gap)"),
    ("digests_submitted", "Received tensors queued for a digest"),
    ("digests_hashed_at_bound", "Received buffers the training thread hashed at the bound"),
    ("digest_gaps", "Digests dropped at the bound (recorded gaps)"),
)


def _name(key: str) -> str:
    return key[:-2] + "_seconds" if key.endswith("_s") else key


def _families(stats: Mapping[str, Any], labels: Mapping[str, str]) -> list[Metric]:
    """The metric families of one ``SwiftlogClient.stats()`` result, every series with ``labels``."""
    names, values = list(labels), list(labels.values())
    w, sel = stats.get("writer", {}), stats.get("selective", {})
    c, ck = stats.get("commit", {}), stats.get("checkpoints", {})
    lagging = bool(c.get("ship_lagging"))
    since, now = c.get("ship_lag_since"), stats.get("iteration")
    behind = now - since if lagging and isinstance(since, int) and isinstance(now, int) else 0
    gauges = [(_name(key), doc, w.get(key)) for key, doc in _WRITER_GAUGES] + [
        ("iteration", "The iteration the client records now", now),
        ("logging_enabled", "1 while capture is on", bool(stats.get("logging_enabled"))),
        ("ship_lagging", "1 while this stage's own data is behind in the cold tier", lagging),
        ("ship_lag_iterations", "Iterations since the first whose own data missed the cold tier", behind),
        ("checkpoints_unregistered", "Checkpoints the log store refused so far", len(ck.get("unregistered") or ())),
    ]
    counters = [(_name(key), doc, w.get(key)) for key, doc in _WRITER_COUNTERS] + [
        ("training_thread_seconds", "Seconds the training thread spent logging", stats.get("training_thread_s")),
        ("logged_send_bytes", "Bytes of sends logged (crossing a group boundary)", sel.get("logged_send_bytes")),
        ("skipped_send_bytes", "Bytes of sends not logged (inside a logging group)", sel.get("skipped_send_bytes")),
        ("commits", "Iterations committed through the decision store", c.get("commits")),
        ("aborts", "Iterations aborted by the decision store", c.get("aborts")),
        ("commit_wait_seconds", "Seconds commits waited for the other stages", c.get("wait_s")),
        ("ship_wait_seconds", "Seconds commits waited for own data to reach the cold tier", c.get("ship_wait_s")),
        ("checkpoints_registered", "Checkpoints registered with the log store", len(ck.get("registered") or ())),
        ("gc_runs", "Garbage collections run after checkpoints", ck.get("gc_runs")),
        ("gc_deleted_records", "Records deleted by those collections", ck.get("gc_deleted_records")),
    ]
    out: list[Metric] = []
    for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, doc, value in rows:
            if value is None:  # not known yet (the iteration before the first step)
                continue
            fam = kind(_PREFIX + name, doc, labels=names)
            fam.add_metric(values, float(value))
            out.append(fam)
    faults = CounterMetricFamily(
        _PREFIX + "faults", "Logging faults by kind (never raised into training)", labels=[*names, "kind"]
    )
    for kind_name, n in sorted((w.get("faults_by_kind") or {}).items()):
        faults.add_metric([*values, kind_name], float(n))
    out.append(faults)
    return out


class _ClientCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any] | None], labels: Mapping[str, str]) -> None:
        self._stats = stats
        self._labels = dict(labels)

    def describe(self) -> list[Metric]:
        return []  # registration must not read the client

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception as e:  # a scrape never fails the client; it is logged and answers nothing
            logger.warning("swiftlog metrics: reading the client's stats failed: %s: %s", type(e).__name__, e)
            return
        if stats is not None:
            yield from _families(stats, self._labels)


class MetricsExporter:
    """An HTTP endpoint serving one client's metrics (``/metrics``) on ``host:port``.

    ``stats`` is called at each scrape on the server's thread (None: the client is gone, nothing
    is served). ``port=0`` takes a free port (:attr:`address` says which). Raises ConfigError when
    the address cannot be bound (in use, not local). :attr:`registry` may also be mounted on a
    server of the user's own.
    """

    def __init__(
        self, stats: Callable[[], Mapping[str, Any] | None], labels: Mapping[str, str], *, host: str, port: int
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ClientCollector(stats, labels))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(
                f"MetricsConfig.port: cannot serve metrics on {host}:{port}: {e.strerror or e}",
                hint="give each rank a free port (e.g. a base port plus the stage), or 0 for any free one",
            ) from e
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the endpoint listens on."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
