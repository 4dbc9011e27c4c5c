"""What the asynchronous writer reports: its counters and its logging faults.

:class:`Fault` records reach the user through ``commit``, ``flush`` and ``close`` reports;
:class:`WriterStats` is the writer's counters, ``SwiftlogClient.stats()["writer"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Fault", "WriterStats", "MAX_FAULTS"]

#: the most faults kept for ``recent_faults``, and waiting for ``take_faults``
MAX_FAULTS = 256


@dataclass(frozen=True, slots=True)
class Fault:
    """One logging fault: when, what kind, which records, and the error text."""

    at: float
    kind: str  # "encode" | "store_full" | "write" | "gap_record" | "marker" | "overflow" | "closed"
    message: str
    channel: str | None = None
    iteration: int | None = None
    micro_batch: int | None = None


@dataclass(slots=True)
class WriterStats:
    """Counters of one writer; see :meth:`AsyncLogWriter.stats`. Bytes are raw tensor bytes
    unless the name says ``stored`` (encoded blob bytes)."""

    records_submitted: int = 0
    bytes_submitted: int = 0
    records_written: int = 0
    bytes_written: int = 0
    stored_bytes_written: int = 0
    batches_written: int = 0
    digests_submitted: int = 0
    records_dropped: int = 0
    bytes_dropped: int = 0
    gaps_recorded: int = 0
    overflow_drops: int = 0  # records dropped at the bound ("gap", a wait timed out, or the writer is stuck)
    overflow_waits: int = 0
    overflow_wait_s: float = 0.0
    overflow_timeouts: int = 0  # waits that ended after overflow_wait_s without room: the record became a gap
    queue_bytes: int = 0
    queue_peak_bytes: int = 0
    queue_items: int = 0
    digest_bytes: int = 0  # received buffers held until hashed (references on CPU, pinned copies on GPU)
    digest_peak_bytes: int = 0
    digests_hashed_at_bound: int = 0  # CPU buffers hashed at submit because digest_bytes was at the bound
    digest_gaps: int = 0  # GPU buffers whose digest was dropped at the bound (each a recorded gap)
    encode_threads: int = 0  # the encode pool's size (0: encoding on the writer thread, or not chosen yet)
    # pinned host memory held for device-to-host copies now: in flight, or kept for reuse (at most max_queue_bytes free)
    pinned_bytes: int = 0
    faults: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    last_fault: str | None = None
    # training-thread time in the capture path, wall clock (perf_counter, no syscall: a syscall
    # here would be where a pending preemption lands and attribute the stall to logging)
    submit_s: float = 0.0  # inside submit() (references, copies, queueing)
    digest_s: float = 0.0  # inside submit_digests() and settle_digests() (queueing / hashing received buffers)
    digests_settled_inline: int = 0  # deferred digests the training thread had to hash itself at settle time
    submit_max_s: float = 0.0  # longest single submit()
    encode_s: float = 0.0  # background encode wall time (summed over threads)
    write_s: float = 0.0  # background store wall time
    encode_cpu_s: float = 0.0  # the same as CPU time of the background threads
    write_cpu_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}
