"""Configuration of a log store: :class:`StoreConfig`, one dataclass validated where it is made.

Never: opens a file or a connection (``LogStore`` does, from this config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from logstore.errors import ConfigError
from logstore.keys import validate_name, validate_run

__all__ = ["StoreConfig"]


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """Configuration of one LogStore.

    root: the node's store root directory (hot tiers live under ``root/run/writer``).
    run: run id (a safe name).
    writer: this process's writer name (e.g. ``stage2``); None opens the store read-only
        (reads, stats, verify, GC and checkpoint registration still work).
    cold_url: ``file:///dir``, a plain directory path, or ``s3://bucket/prefix``; None = hot only.
    cold_options: fsspec storage options for the cold tier (s3: endpoint_url, key, secret...).
    durability: "process" (survive process death; default) or "fsync" (survive power loss).
    segment_iters: iterations per segment (segments align to multiples of it); smaller means
        finer-grained GC and upload, more objects.
    segment_max_bytes: a segment is sealed early when it reaches this size.
    upload: run the background uploader (writer stores with a cold tier only).
    max_backlog_bytes: sealed-but-not-uploaded bytes beyond which ``put`` raises StoreFullError
        (the caller records a gap); None = bounded only by the disk.
    hot_max_bytes: after upload, evict the oldest uploaded segments from the hot tier while it
        holds more than this many bytes; None = keep until GC.
    codec: tensor codec for ``put`` ("auto", "planes", "zstd", "raw").
    stale_upload_age: multipart uploads older than this are aborted by ``gc``.
    """

    root: str | os.PathLike[str]
    run: str
    writer: str | None = None
    cold_url: str | None = None
    cold_options: dict[str, Any] = field(default_factory=dict)
    durability: str = "process"
    segment_iters: int = 4
    segment_max_bytes: int = 64 << 20
    upload: bool = True
    max_backlog_bytes: int | None = None
    hot_max_bytes: int | None = None
    codec: str = "auto"
    stale_upload_age: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        validate_run(self.run)
        if self.writer is not None:
            validate_name(self.writer, "writer name")
        if self.segment_iters < 1:
            raise ConfigError(f"segment_iters must be >= 1, got {self.segment_iters}")
        if self.segment_max_bytes < 1 << 16:
            raise ConfigError(f"segment_max_bytes must be >= 64 KiB, got {self.segment_max_bytes}")
        if self.codec not in ("auto", "planes", "zstd", "raw"):
            raise ConfigError(f"codec {self.codec!r} unknown", hint="use auto, planes, zstd or raw")
