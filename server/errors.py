"""Errors of the admin layer, the CLI's exit codes, and the one table that maps every error to both.

Hierarchy (server-specific errors extend the log store's, see ``logstore.errors``)::

    SwiftlogError
    ├── StoreError
    │   ├── RunNotFoundError        no hot tier of that run under the node's root        404 / exit 3
    │   ├── CheckpointNotFoundError no such registration of the run                      404 / exit 3
    │   └── ProfileNotFoundError    the run has no saved cost profile                    404 / exit 3
    ├── BadRequestError (ValueError) a request that cannot be answered as asked          400 / exit 2
    ├── NoColdTierError             an operation that needs a cold tier, none configured 409 / exit 2
    ├── NotAvailableError           a feature whose package is not installed (replay/)   501 / exit 4
    └── AuthError                   missing/invalid token (401) or mutations disabled (403)
    RuntimeError
    └── DemoRunError                one of ``swiftlog demo``'s trainings did not finish       exit 1

:func:`classify` is used by the API's exception handlers and by the CLI, so the same failure reads
the same everywhere: ``{"error": {"code", "message", "hint", "key", "retryable"}}`` over HTTP,
``error: <message>`` plus ``hint: <hint>`` and an exit code on the command line.

Exit codes, defined here once (``EXIT_*``): 0 ok, 1 problems found (verify, corrupt data),
2 usage or bad input, 3 not found, 4 unavailable (object store down, feature not installed, store
failure), 130 interrupted (Ctrl-C). The stage processes of a resilient training have their own
code 3, "recovery fell back to a global rollback": that one is defined in ``replay``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    StoreClosedError,
    StoreError,
    StoreFullError,
    SwiftlogError,
    WriterFencedError,
)

__all__ = [
    "RunNotFoundError",
    "CheckpointNotFoundError",
    "ProfileNotFoundError",
    "BadRequestError",
    "NoColdTierError",
    "NotAvailableError",
    "AuthError",
    "DemoRunError",
    "Problem",
    "classify",
    "plain_message",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "EXIT_NOT_FOUND",
    "EXIT_UNAVAILABLE",
    "EXIT_INTERRUPTED",
]

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


class RunNotFoundError(StoreError):
    """The run has no hot tier under this node's store root."""


class CheckpointNotFoundError(StoreError):
    """The run has no registration of that stage's checkpoint at that iteration."""


class ProfileNotFoundError(StoreError):
    """The run has no saved cost profile (``swiftlog profile`` measures one)."""


class BadRequestError(SwiftlogError, ValueError):
    """A well-formed request that cannot be answered as asked (bad cursor, contradictory filters)."""


class NoColdTierError(SwiftlogError):
    """The operation needs a cold tier and none is configured."""


class NotAvailableError(SwiftlogError):
    """A pluggable part cannot be loaded (e.g. the recovery planner named by --planner)."""


class AuthError(SwiftlogError):
    """Authentication failed (``status`` 401) or the operation is disabled (403)."""

    def __init__(self, message: str, *, status: int, hint: str | None = None) -> None:
        self.status = status
        super().__init__(message, hint=hint)


class DemoRunError(RuntimeError):
    """One of ``swiftlog demo``'s trainings did not finish (its stage logs are in the message)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """How one error is reported: HTTP status, machine code, exit code, and the words."""

    status: int
    code: str
    exit_code: int
    message: str
    hint: str | None = None
    key: str | None = None
    retryable: bool = False

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "hint": self.hint,
                "key": self.key,
                "retryable": self.retryable,
            }
        }


# (class, HTTP status, code, exit code); first match wins, so subclasses come first
_TABLE: tuple[tuple[type[BaseException], int, str, int], ...] = (
    (RunNotFoundError, 404, "run_not_found", EXIT_NOT_FOUND),
    (CheckpointNotFoundError, 404, "checkpoint_not_found", EXIT_NOT_FOUND),
    (ProfileNotFoundError, 404, "profile_not_found", EXIT_NOT_FOUND),
    (RecordNotFoundError, 404, "record_not_found", EXIT_NOT_FOUND),
    (CorruptRecordError, 409, "corrupt_record", EXIT_PROBLEMS),
    (CorruptIndexError, 409, "corrupt_index", EXIT_PROBLEMS),
    (CodecError, 409, "corrupt_record", EXIT_PROBLEMS),
    (InvalidNameError, 400, "invalid_name", EXIT_USAGE),
    (InvalidKeyError, 400, "invalid_key", EXIT_USAGE),
    (BadRequestError, 400, "bad_request", EXIT_USAGE),
    (ConfigError, 400, "invalid_argument", EXIT_USAGE),
    (NoColdTierError, 409, "no_cold_tier", EXIT_USAGE),
    (NotAvailableError, 501, "not_available", EXIT_UNAVAILABLE),
    (ColdTierUnavailableError, 503, "cold_tier_unavailable", EXIT_UNAVAILABLE),
    (StoreClosedError, 503, "store_closed", EXIT_UNAVAILABLE),
    (StoreFullError, 507, "store_full", EXIT_UNAVAILABLE),
    # an earlier incarnation's segments: never shipped over a later one's
    (WriterFencedError, 409, "writer_fenced", EXIT_PROBLEMS),
    (ColdTierError, 502, "cold_tier_error", EXIT_UNAVAILABLE),
    (StoreError, 500, "store_error", EXIT_UNAVAILABLE),
)


def plain_message(e: SwiftlogError) -> str:
    """The message without the ``(hint: ...)`` suffix SwiftlogError appends."""
    text = str(e)
    suffix = f" (hint: {e.hint})" if e.hint else ""
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


def classify(exc: BaseException) -> Problem:
    """The Problem for ``exc``. Never raises. Unknown exceptions are internal errors (500 / exit 1)."""
    if isinstance(exc, AuthError):
        code = "unauthorized" if exc.status == 401 else "forbidden"
        return Problem(exc.status, code, EXIT_USAGE, plain_message(exc), exc.hint)
    if isinstance(exc, SwiftlogError):
        key = getattr(exc, "key", None)
        for cls, status, code, exit_code in _TABLE:
            if isinstance(exc, cls):
                return Problem(
                    status,
                    code,
                    exit_code,
                    plain_message(exc),
                    exc.hint,
                    None if key is None else str(key),
                    bool(exc.retryable),
                )
        return Problem(
            500, "internal_error", EXIT_PROBLEMS, plain_message(exc), exc.hint, None if key is None else str(key)
        )
    return Problem(
        500,
        "internal_error",
        EXIT_PROBLEMS,
        f"internal error: {type(exc).__name__}",
        "this is a bug in swiftlog; the server log has the traceback",
    )
