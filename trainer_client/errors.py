"""Errors raised by the trainer client, in one place.

Hierarchy (the log store's errors are reused, not redefined)::

    logstore.SwiftlogError
    ├── logstore.ConfigError (ValueError)     a ClientConfig value or call argument that cannot work
    │   └── UnsupportedScheduleError          a pipeline schedule the client cannot log exactly
    └── ClientError                           base of what the trainer client raises on purpose
        ├── CommitError                       the commit step could not decide normally
        │   ├── IterationAbortedError         the iteration's decision is "abort": apply nothing
        │   └── CommitStoreError              the decision store (TCPStore) is unreachable (retryable)
        ├── CheckpointError                   a checkpoint could not be written or read
        └── RecoveryFailedError               the pipeline could not be re-formed after a failure
            ├── RecoveryTimeoutError          a recovery wait passed its deadline
            ├── ReplicaTransferError          a replica's state arrived other than the donor sent it
            └── RestartRequired               torchrun: this rank's state is saved, the job must restart

What is deliberately *not* here: logging faults (store full, cold tier down, encode errors).
Those never raise into the training step; the client records and counts them and reports
them in ``commit``/``flush``/``close`` results and ``stats()``.
"""

from __future__ import annotations

from logstore.errors import ConfigError, SwiftlogError

__all__ = [
    "ClientError",
    "CommitError",
    "IterationAbortedError",
    "CommitStoreError",
    "CheckpointError",
    "UnsupportedScheduleError",
    "RecoveryFailedError",
    "RecoveryTimeoutError",
    "ReplicaTransferError",
    "RestartRequired",
    "ConfigError",
]


class ClientError(SwiftlogError):
    """Base class of errors raised by :mod:`trainer_client`."""


class CommitError(ClientError):
    """The commit step of an iteration did not end in a normal "commit" decision."""

    def __init__(self, message: str, *, iteration: int, generation: int, hint: str | None = None) -> None:
        self.iteration = iteration
        self.generation = generation
        super().__init__(message, hint=hint, iteration=iteration, generation=generation)


class IterationAbortedError(CommitError):
    """Every stage must discard the iteration (zero its gradients, skip the optimizer step).

    ``reason`` says why: a stage reported a failure, the generation was marked failed, or the
    commit timed out waiting for ``missing`` stages (the timeout itself writes "abort", so no
    stage can have committed). Not retryable within the same process-group generation.
    """

    def __init__(
        self, message: str, *, iteration: int, generation: int, reason: str, missing: list[int] | None = None
    ) -> None:
        self.reason = reason
        self.missing = list(missing or [])
        super().__init__(
            message,
            iteration=iteration,
            generation=generation,
            hint="discard the iteration (optimizer.zero_grad), tear down the process group and recover",
        )


class CommitStoreError(CommitError):
    """The decision store could not be reached; the outcome of the iteration is unknown here."""

    retryable = True


class CheckpointError(ClientError):
    """A checkpoint could not be written durably, or read back."""


class UnsupportedScheduleError(ConfigError):
    """A schedule whose execution the client cannot capture and replay exactly."""


class RecoveryFailedError(ClientError):
    """The pipeline could not be re-formed (the replacement gave up, or survivors disagree)."""


class RestartRequired(RecoveryFailedError):
    """No replacement comes (torchrun restarts every rank): this rank saved its state node-locally
    (``RecoveryConfig.snapshot_dir``) and must exit; ``replay.recover_on_restart`` resumes it."""


class RecoveryTimeoutError(RecoveryFailedError):
    """A recovery wait passed its deadline; the message names the keys it waited for."""


class ReplicaTransferError(RecoveryFailedError):
    """A state received from a replica does not match what the donor sent (a tensor's digest, the stage)."""
