"""logstore: the tiered log store of swiftlog (records, codec, hot/cold tiers, retention, errors).

Public API (re-exported here; implementation modules are listed in docs/architecture.md)::

    from logstore import LogStore, StoreConfig, Channel, RecordKey, Kind

``LogStore`` is the one facade: writes, reads, listings, uploads, checkpoint registrations, GC,
stats and verify. What it returns is in :mod:`logstore.reports`; every error it raises is in
:mod:`logstore.errors` (the tree is drawn there). The tiers themselves (:mod:`logstore.hot`,
:mod:`logstore.cold`), the record codec (:mod:`logstore.codec`) and the segment format
(:mod:`logstore.segment`) are public modules for tools and tests; modules whose name starts with
an underscore are internal.

Must never import torch.distributed or FastAPI: it sits below every other package.
"""

from logstore.checkpoints import CheckpointInfo
from logstore.config import StoreConfig
from logstore.errors import (
    CodecError,
    ColdTierError,
    ColdTierUnavailableError,
    ConfigError,
    CorruptIndexError,
    CorruptRecordError,
    InvalidKeyError,
    InvalidNameError,
    RecordNotFoundError,
    SegmentClashError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    SwiftlogError,
    WriterFencedError,
)
from logstore.keys import Channel, Kind, RecordKey, validate_name, validate_run
from logstore.reports import GcReport, RecordInfo, UnregisterPreview, VerifyReport
from logstore.store import Encoded, LogStore, list_runs

__all__ = [
    # the store
    "LogStore",
    "StoreConfig",
    "Encoded",
    "list_runs",
    # what it reports
    "CheckpointInfo",
    "GcReport",
    "RecordInfo",
    "UnregisterPreview",
    "VerifyReport",
    # record names
    "Channel",
    "Kind",
    "RecordKey",
    "validate_name",
    "validate_run",
    # errors (logstore.errors draws the tree)
    "SwiftlogError",
    "StoreError",
    "RecordNotFoundError",
    "CorruptRecordError",
    "CorruptIndexError",
    "StoreFullError",
    "ColdTierUnavailableError",
    "ColdTierError",
    "SegmentClashError",
    "WriterFencedError",
    "StoreClosedError",
    "CodecError",
    "ConfigError",
    "InvalidKeyError",
    "InvalidNameError",
]
