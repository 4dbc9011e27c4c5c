"""Errors of the replay package, and the exit code of a replacement that falls back.

Hierarchy::

    SwiftlogError (logstore.errors)
    ├── ReplayError                     a replay could not run, or did not reproduce the log
    │   ├── ReplayInputMissingError     a needed record is in no source (``key`` names it)
    │   ├── ReplayMismatchError         regenerated sends differ from the logged digests
    │   └── ReplayOrderError            the replay cannot run the live order of forwards and backwards
    ├── ConfigError (logstore.errors)
    │   └── BudgetTooSmallError         no logging grouping fits the storage budget (it names what one needs)
    ├── StoreError (logstore.errors)
    │   └── NodeUnavailableError        a node server did not answer after the retries (retryable)
    └── ClientError (trainer_client.errors)
        └── RecoveryFailedError (trainer_client)
            ├── ReplacementFallback     the failed stage cannot be replayed: roll every stage back
            └── JobStoreLostError       a node agent lost the job's store: only a global restart goes on

Store errors pass through unchanged: ``CorruptRecordError`` (a record failed its checksum, ``key``
names it) and retryable ``StoreError`` subclasses such as :class:`NodeUnavailableError`.

:data:`EXIT_FALLBACK` is the exit code of a replacement (or a replay helper) whose in-place
recovery is impossible: the scheduler then restarts every stage from a common checkpoint.
"""

from __future__ import annotations

from logstore import RecordKey
from logstore.errors import ConfigError, StoreError, SwiftlogError
from trainer_client import RecoveryFailedError

__all__ = [
    "EXIT_FALLBACK",
    "BudgetTooSmallError",
    "JobStoreLostError",
    "NodeUnavailableError",
    "ReplacementFallback",
    "ReplayError",
    "ReplayInputMissingError",
    "ReplayMismatchError",
    "ReplayOrderError",
]

#: exit code of a replacement or replay helper process whose in-place recovery is impossible
EXIT_FALLBACK = 3


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


class BudgetTooSmallError(ConfigError):
    """No logging grouping that logs anything fits the storage budget. ``needed_bytes``: what the
    cheapest one needs (None when no grouping meets the other constraints at any budget)."""

    def __init__(self, message: str, *, budget_bytes: float, needed_bytes: float | None) -> None:
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        super().__init__(
            message,
            hint="raise the budget, or checkpoint more often (the logs kept are those since the last checkpoint)",
        )


class NodeUnavailableError(StoreError):
    """A node server did not answer, or answered with a server error, after the retries."""

    retryable = True


class ReplacementFallback(RecoveryFailedError):
    """The failed stage cannot be replayed; every stage must restart from a checkpoint."""


class JobStoreLostError(RecoveryFailedError):
    """The job's store (node 0's agent hosts it) is gone: this node's agent stopped its processes.
    Only a global restart from checkpoints goes on (``swiftlog agent --resume --attempt N+1``)."""
