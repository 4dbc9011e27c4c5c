"""logstore: the tiered log store of swiftlog (records, codec, hot/cold tiers, retention, errors).

Public API (re-exported here; implementation modules are listed in docs/architecture.md)::

    from logstore import LogStore, StoreConfig, Channel, RecordKey, Kind

Must never import torch.distributed or FastAPI: it sits below every other package.
"""

from logstore.errors import (
    CodecError,
    ColdTierError,
    ColdTierUnavailableError,
    ConfigError,
    CorruptRecordError,
    InvalidKeyError,
    InvalidNameError,
    RecordNotFoundError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    SwiftlogError,
)
from logstore.keys import Channel, Kind, RecordKey, validate_name, validate_run
from logstore.store import CheckpointInfo, Encoded, GcReport, LogStore, StoreConfig, VerifyReport, list_runs

__all__ = [
    "LogStore",
    "StoreConfig",
    "Encoded",
    "CheckpointInfo",
    "GcReport",
    "VerifyReport",
    "list_runs",
    "Channel",
    "Kind",
    "RecordKey",
    "validate_name",
    "validate_run",
    "SwiftlogError",
    "StoreError",
    "RecordNotFoundError",
    "CorruptRecordError",
    "StoreFullError",
    "ColdTierUnavailableError",
    "ColdTierError",
    "StoreClosedError",
    "CodecError",
    "ConfigError",
    "InvalidKeyError",
    "InvalidNameError",
]
