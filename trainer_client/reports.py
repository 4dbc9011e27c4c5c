"""What the client reports at ``commit``, ``flush`` and ``close``: the decision and the logging
faults, which are reported here and never raised into training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_client.commit import CommitResult
from trainer_client.writer import Fault

__all__ = ["CommitReport", "FlushReport"]


@dataclass(frozen=True, slots=True)
class CommitReport:
    """What ``commit`` did: the decision (None when no decision store is configured) and the
    logging faults that happened since the previous report (never raised)."""

    iteration: int
    decision: CommitResult | None
    logging_faults: list[Fault] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FlushReport:
    """Outcome of ``flush``/``close``.

    ``logging_faults`` are the faults since the previous report (commit/flush/close);
    ``faults_total`` counts every fault of this client's life. ``ok`` iff everything queued was
    written, (with a cold tier) uploaded, and no logging fault ever happened, i.e. the logs of
    this stage are complete.
    """

    drained: bool
    uploaded_segments: int
    error: str | None
    logging_faults: list[Fault] = field(default_factory=list)
    faults_total: int = 0

    @property
    def ok(self) -> bool:
        return self.drained and self.error is None and not self.logging_faults and self.faults_total == 0
