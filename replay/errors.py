"""Errors of the replay package (all are :class:`logstore.errors.SwiftlogError`).

Hierarchy::

    SwiftlogError (logstore.errors)
    └── ReplayError                     a replay could not run, or did not reproduce the log
        ├── ReplayInputMissingError     a needed record is in no source (``key`` names it)
        └── ReplayMismatchError         regenerated sends differ from the logged digests

Store errors pass through unchanged: ``CorruptRecordError`` (a record failed its checksum, ``key``
names it) and retryable ``StoreError`` subclasses such as ``replay.remote.NodeUnavailableError``.
"""

from __future__ import annotations

from logstore import RecordKey
from logstore.errors import SwiftlogError

__all__ = ["ReplayError", "ReplayInputMissingError", "ReplayMismatchError", "ReplayOrderError"]


class ReplayError(SwiftlogError):
    """A replay could not run or did not reproduce what was logged."""


class ReplayInputMissingError(ReplayError):
    """A record the replay needs is in no store (never logged, a gap, or garbage-collected)."""

    def __init__(self, message: str, *, key: RecordKey, hint: str | None = None) -> None:
        self.key = key
        super().__init__(message, hint=hint, key=str(key))


class ReplayMismatchError(ReplayError):
    """Replayed sends differ from the digests (or records) logged during the live run."""


class ReplayOrderError(ReplayError):
    """The replay cannot run the stage's forwards and backwards in the order the live stage did, and
    the result depends on it (a backward changed module buffers). The same stage replayed alone,
    with one worker, follows the live order."""
