"""Every error the log store raises, in one place.

Hierarchy::

    SwiftlogError                       base of everything swiftlog raises on purpose
    ├── InvalidNameError (ValueError)   a run / channel / segment name that is not allowed
    ├── InvalidKeyError (ValueError)    a record key out of range or malformed bytes
    ├── CodecError                      a blob that is not a swiftlog tensor record
    ├── StoreError                      a log-store operation failed
    │   ├── RecordNotFoundError (KeyError)   no tier holds the key
    │   ├── CorruptRecordError          checksum mismatch: the bytes are never returned
    │   ├── CorruptIndexError           a writer's LMDB index cannot be read (damaged pages or entries)
    │   ├── StoreFullError              disk full (ENOSPC/EDQUOT) or LMDB map cannot grow
    │   ├── ColdTierUnavailableError    object store unreachable or failing (retryable)
    │   ├── ColdTierError               object store refused an operation (not retryable)
    │   │   ├── SegmentClashError       a segment name committed with other bytes
    │   │   └── WriterFencedError       a newer incarnation of this writer ships to the cold tier
    │   └── StoreClosedError            use after close()
    └── ConfigError (ValueError)        a configuration value that cannot work

The other packages' errors derive from these (each in its package's ``errors`` module; this is
the whole tree of what swiftlog raises)::

    SwiftlogError
    ├── ConfigError
    │   ├── trainer_client: UnsupportedScheduleError
    │   └── replay: BudgetTooSmallError
    ├── trainer_client: ClientError
    │   ├── CommitError
    │   │   ├── IterationAbortedError
    │   │   └── CommitStoreError
    │   ├── CheckpointError
    │   └── RecoveryFailedError
    │       ├── RecoveryTimeoutError
    │       ├── ReplicaTransferError          a replica's state arrived other than sent
    │       ├── RestartRequired               torchrun: the state is saved, restart the job
    │       ├── replay: ReplacementFallback      a replay is impossible: roll back instead
    │       └── replay: JobStoreLostError        an agent lost the job's store: restart every rank
    ├── replay: ReplayError
    │   ├── ReplayInputMissingError
    │   ├── ReplayMismatchError
    │   └── ReplayOrderError
    ├── StoreError
    │   ├── replay: NodeUnavailableError       a node server cannot be reached (retryable)
    │   ├── server: RunNotFoundError
    │   ├── server: CheckpointNotFoundError
    │   └── server: ProfileNotFoundError
    ├── server: BadRequestError (ValueError)
    ├── server: NoColdTierError
    ├── server: NotAvailableError
    └── server: AuthError

    server: DemoRunError (RuntimeError)      the demo's training or recovery failed (the CLI's exit code)

Outside the tree (never raised to a caller of the store)::

    ObjectExistsError                   cold tier internal: an exclusive write found the key taken
    S3ServerError (RuntimeError)        test tooling (logstore.testing): a loopback S3 server did not start

Each error carries ``retryable`` (may the same call succeed later?) and, where it makes sense,
the record key or object path it concerns, plus a hint that tells the reader what to do.
Backend errors (lmdb, OSError, botocore) are translated at the boundary with ``raise ... from e``
so the cause stays attached.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "SwiftlogError",
    "InvalidNameError",
    "InvalidKeyError",
    "CodecError",
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
    "ConfigError",
    "ObjectExistsError",
    "S3ServerError",
    "translate_os_error",
]


class SwiftlogError(Exception):
    """Base class. ``retryable`` says whether repeating the same call may succeed; ``message`` is
    the text without the hint (``str(e)`` has both)."""

    retryable: bool = False

    def __init__(self, message: str, *, hint: str | None = None, **context: Any) -> None:
        self.message = message
        self.hint = hint
        self.context = context
        full = message if hint is None else f"{message} (hint: {hint})"
        super().__init__(full)


class InvalidNameError(SwiftlogError, ValueError):
    """A run, channel or object name that is empty, too long, or could escape its directory."""


class InvalidKeyError(SwiftlogError, ValueError):
    """A record key with a field out of range, or bytes that are not an encoded key."""


class ConfigError(SwiftlogError, ValueError):
    """A configuration value that cannot work; the message names the field and the bad value."""


class CodecError(SwiftlogError):
    """A blob that is not a valid swiftlog tensor record (bad magic, header, dtype, or length)."""


class StoreError(SwiftlogError):
    """A log-store operation failed. ``key`` names the record when there is one."""

    def __init__(self, message: str, *, key: Any = None, hint: str | None = None, **context: Any) -> None:
        self.key = key
        super().__init__(message, hint=hint, **context)


class RecordNotFoundError(StoreError, KeyError):
    """No tier holds the record (never written, or garbage-collected)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class CorruptRecordError(StoreError):
    """Stored bytes do not match their checksum. The bytes are never returned."""


class CorruptIndexError(StoreError):
    """A writer's LMDB index cannot be read: damaged pages or entries. Its records are read no more
    through it (those uploaded are still in the cold tier); ``swiftlog verify`` lists it."""


class StoreFullError(StoreError):
    """The hot tier cannot take more data: disk full or the LMDB map cannot grow."""

    retryable = True


class ColdTierUnavailableError(StoreError):
    """The object store is unreachable or answering with server errors; records stay hot."""

    retryable = True


class ColdTierError(StoreError):
    """The object store refused an operation for a reason that retrying will not fix."""


class SegmentClashError(ColdTierError):
    """A segment name is already committed in the cold tier with other bytes (segments are
    immutable): e.g. an earlier incarnation of the writer, on another root, used the name."""


class WriterFencedError(ColdTierError):
    """Another process opened the same writer later (a replacement) and ships to the same cold
    tier: this one (the earlier incarnation, e.g. a stage thought dead but still running) stops
    uploading, so the two never interleave their segments there. Its records stay in its hot tier."""


class StoreClosedError(StoreError):
    """The store was used after close()."""


class ObjectExistsError(Exception):
    """An exclusive write found the key taken. Internal to the cold tier: its backends raise it,
    ``ColdTier`` turns it into a SegmentClashError or its fencing probe's answer."""


class S3ServerError(RuntimeError):
    """A test server could not be started (the message carries the tail of its log)."""


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def translate_os_error(exc: OSError, what: str, *, key: Any = None) -> StoreError:
    """Map an OSError from the local disk to a StoreError that says what failed.

    Never raises; returns the error for the caller to ``raise ... from exc``.
    """
    if exc.errno in _FULL_ERRNOS:
        return StoreFullError(
            f"{what}: disk full ({exc.strerror})",
            key=key,
            hint="free space under the store root or run GC after a checkpoint",
        )
    return StoreError(f"{what}: {exc.strerror or exc}", key=key)
