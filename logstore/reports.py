"""What the log store reports: GC and verify results, an unregister preview, a record's place.

Plain dataclasses with ``to_dict()`` where the API serves them; made by ``LogStore``, read by the
CLI, the admin API and the planner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from logstore.checkpoints import CheckpointInfo
from logstore.keys import RecordKey

__all__ = ["GcReport", "UnregisterPreview", "VerifyReport", "RecordInfo"]


@dataclass(slots=True)
class GcReport:
    dry_run: bool
    watermarks: dict[int, int]
    hot_records: int = 0
    hot_segments: int = 0
    hot_bytes: int = 0
    cold_segments: int = 0
    cold_bytes: int = 0
    aborted_uploads: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # deleted (or to delete) record keys, first 1000
    segments: list[str] = field(default_factory=list)  # cold objects deleted (or to delete)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class UnregisterPreview:
    """What withdrawing one registration does (``LogStore.preview_unregister``).

    checkpoint: the registration. watermarks_before / watermarks_after: every stage's watermark
    with it and without it (groups applied). gc_before / gc_after: what a GC would delete with
    the registrations as they are, and once it is gone (dry runs; whatever the first holds beyond
    the second is what the remaining registrations keep). Records a GC already deleted are not
    brought back by unregistering.
    """

    checkpoint: CheckpointInfo
    watermarks_before: dict[int, int]
    watermarks_after: dict[int, int]
    gc_before: GcReport
    gc_after: GcReport


@dataclass(slots=True)
class VerifyReport:
    hot_checked: int = 0
    cold_checked: int = 0
    cold_segments: int = 0
    problems: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """Where one record lives and what it weighs, from the indexes alone (no record bytes read).

    tier: "hot" (a segment file on this node) or "cold" (only in the object store: never
    uploaded from here, or evicted). writer: the writer whose segment holds it. stored_bytes:
    length of the encoded blob. raw_bytes: the tensor's raw size (None when only a cold footer
    was read). checksum: xxh3-64 of the encoded blob (what frames and footers store).
    segment: the hot segment path relative to the run directory, or the cold object name.
    """

    key: RecordKey
    tier: str
    writer: str
    stored_bytes: int
    raw_bytes: int | None
    checksum: int
    segment: str
