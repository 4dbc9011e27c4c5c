"""Typed request and response bodies of the admin API (and the ``--json`` output of the CLI).

Conventions: sizes are bytes; iteration ranges in summaries are inclusive (``first_iteration`` ..
``last_iteration``), filters are half-open (``it_lo`` <= iteration < ``it_hi``); checksums are
16 lowercase hex digits of an xxh3-64; times are Unix seconds. Every error body is
:class:`ErrorResponse`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from logstore.checkpoints import MAX_META_BYTES, MAX_META_DEPTH, check_meta
from logstore.keys import Kind

__all__ = [
    "ErrorDetail",
    "ErrorResponse",
    "Health",
    "RunBrief",
    "RunList",
    "TierRange",
    "ChannelSummary",
    "SegmentStates",
    "HotTierSummary",
    "Collected",
    "ColdTierSummary",
    "Checkpoint",
    "Watermark",
    "Gap",
    "RunSummary",
    "KindName",
    "RecordEntry",
    "RecordPage",
    "TensorStats",
    "RecordDetail",
    "CheckpointRequest",
    "CheckpointList",
    "UnregisterRequest",
    "GcPreview",
    "UnregisterResult",
    "GcRequest",
    "GcResult",
    "OpenSegment",
    "FlushResult",
    "VerifyProblem",
    "VerifyResult",
    "PlanFetch",
    "PlanUnit",
    "RecoveryPlanDetail",
    "RecoveryPlan",
    "MAX_API_ITERATION",
]

MAX_STAGE = 0xFFFF
# Iterations the API accepts: the largest integer a JSON number (an IEEE double in most clients)
# holds exactly. Keys go to 2**63-1, but beyond 2**53 JSON clients silently round.
MAX_API_ITERATION = 2**53 - 1
KIND_NAMES = tuple(
    k.name.lower() for k in Kind
)  # "activation", "gradient", ..., "reduced": every channel kind the store has
KindName = Literal[KIND_NAMES]  # type: ignore[valid-type]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _json_integer(v: Any) -> Any:
    """A JSON number (598 or 598.0, as JSON Schema's "integer" allows), never a string or a boolean
    (``"1"`` or ``true`` were taken as 1 on a request that makes logs garbage)."""
    if isinstance(v, (bool, str)):
        raise ValueError(f"must be a JSON integer, not {type(v).__name__}")
    return v


# ---------------------------------------------------------------------------------- errors
class ErrorDetail(_Model):
    code: str = Field(description="machine-readable, e.g. record_not_found, invalid_name, unauthorized")
    message: str
    hint: str | None = Field(None, description="what to do about it")
    key: str | None = Field(None, description="the record key or object the error concerns")
    retryable: bool = Field(False, description="may the same request succeed later?")


class ErrorResponse(_Model):
    error: ErrorDetail


# ---------------------------------------------------------------------------------- health, runs
class Health(_Model):
    status: Literal["ok"] = "ok"
    version: str
    root: str
    root_exists: bool
    cold_tier: bool = Field(description="a cold tier URL is configured")
    runs: int
    auth: Literal["token", "insecure-loopback", "read-only"] = Field(
        description="how mutating endpoints are guarded: token, loopback without token, or refused"
    )


class RunBrief(_Model):
    run: str
    writers: list[str] = Field(description="writer (hot tier) directories of the run on this node")


class RunList(_Model):
    runs: list[RunBrief]


# ---------------------------------------------------------------------------------- summary
class TierRange(_Model):
    records: int
    stored_bytes: int
    raw_bytes: int
    first_iteration: int | None = None
    last_iteration: int | None = None


class ChannelSummary(_Model):
    name: str = Field(description="e.g. act_0_1, grad_2_1, input_0")
    kind: KindName
    src: int
    dst: int
    owner: int = Field(description="the stage whose checkpoint makes older records garbage")
    hot: TierRange | None = None
    cold: TierRange | None = None


class SegmentStates(_Model):
    open: int = 0
    sealed: int = 0
    uploaded: int = 0
    evicted: int = 0


class Collected(_Model):
    stage: int = Field(description="the owner stage whose checkpoint made the records garbage")
    records: int
    stored_bytes: int
    below: int = Field(description="the highest watermark of the stage that collected any: records below it")


class HotTierSummary(TierRange):
    disk_bytes: int = Field(description="LMDB index plus segment files on disk")
    segments: SegmentStates
    writers: list[str]
    collected: list[Collected] = Field(
        default_factory=list, description="what GC deleted from this node's hot tiers, per owner stage"
    )
    unreadable: dict[str, str] = Field(
        default_factory=dict,
        description="writers whose index was left out (damaged, truncated, missing), and why: "
        "their records are counted only where the cold tier has them",
    )


class ColdTierSummary(TierRange):
    segments: int
    object_bytes: int
    error: str | None = Field(None, description="why the cold tier could not be listed, if it could not")


class Checkpoint(_Model):
    stage: int
    iteration: int
    uri: str | None = None
    registered_at: float = 0.0
    meta: dict[str, Any] = Field(default_factory=dict)


class Watermark(_Model):
    stage: int
    iteration: int = Field(description="newest durable checkpoint: records received by the stage below it are garbage")


class Gap(_Model):
    channel: str
    iteration: int
    micro_batch: int
    reason: str
    at: float


class RunSummary(_Model):
    run: str
    as_of: float = Field(description="when this summary was computed (it may be served from a short cache)")
    stages: list[int]
    channels: list[ChannelSummary]
    hot: HotTierSummary
    cold: ColdTierSummary | None = Field(None, description="None when no cold tier is configured")
    raw_bytes: int = Field(description="raw tensor bytes held on this node (hot tier)")
    stored_bytes: int = Field(description="encoded bytes held on this node (hot tier)")
    compression_ratio: float | None = Field(
        None, description="raw / stored over the hot tier (the cold tier if the hot one is empty)"
    )
    checkpoints: list[Checkpoint]
    watermarks: list[Watermark]
    gaps: list[Gap]
    incomplete: list[Literal["cold", "checkpoints", "watermarks", "gaps"]] = Field(
        default_factory=list,
        description="parts the cold tier could not be read for (see cold.error): what this node's hot tier knows only",
    )


# ---------------------------------------------------------------------------------- records
class RecordEntry(_Model):
    key: str = Field(description="e.g. act_0_1/it5/mb2/p0")
    channel: str
    kind: KindName
    iteration: int
    micro_batch: int
    part: int
    tier: Literal["hot", "cold"]
    writer: str
    stored_bytes: int
    raw_bytes: int | None = Field(None, description="None when only the cold segment index was read")
    checksum: str = Field(description="xxh3-64 of the encoded blob (hex)")


class RecordPage(_Model):
    run: str
    records: list[RecordEntry]
    next_cursor: str | None = Field(None, description="pass as cursor= for the next page; None at the end")
    cold_error: str | None = Field(
        None, description="set when the cold tier could not be listed: the page then holds the hot tier's records only"
    )


class TensorStats(_Model):
    numel: int
    min: float | None = Field(None, description="over finite values; None if there are none")
    max: float | None = None
    mean: float | None = None
    norm: float | None = Field(None, description="L2 norm over finite values")
    nan_count: int = 0
    inf_count: int = 0


class RecordDetail(RecordEntry):
    dtype: str
    shape: list[int]
    codec: str
    raw_checksum: str = Field(description="xxh3-64 of the raw tensor bytes, from the record header (hex)")
    stats: TensorStats | None = None
    stats_skipped: str | None = Field(None, description="why stats is None")
    meta: dict[str, Any] | None = Field(
        None,
        description="a META record's document (the stage's schedule, order, seeds, loss function... of the iteration)",
    )


# ---------------------------------------------------------------------------------- checkpoints, gc, flush
class CheckpointRequest(_Model):
    stage: int = Field(ge=0, le=MAX_STAGE)
    iteration: int = Field(ge=0, le=MAX_API_ITERATION)
    uri: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="where the checkpoint is readable from a replacement (no control characters)",
    )
    meta: dict[str, Any] = Field(
        default_factory=dict,
        description=f"free-form JSON object: valid Unicode, finite numbers, at most {MAX_META_DEPTH} levels deep "
        f"and {MAX_META_BYTES} bytes",
    )

    @field_validator("stage", "iteration", mode="before")
    @classmethod
    def _json_integer(cls, v: Any) -> Any:
        return _json_integer(v)

    @field_validator("meta")
    @classmethod
    def _portable(cls, v: dict[str, Any]) -> dict[str, Any]:
        """Stored as JSON and served as UTF-8: a lone surrogate, a non-finite number, a deep nest or a large document is
        refused here (each used to be stored, then break every later read of the checkpoint list)."""
        try:
            check_meta(v)
        except ValueError as e:
            raise ValueError(f"meta is not portable JSON within the limits: {e}") from e
        return v

    force: StrictBool = Field(
        False,
        description="register even a stage beyond the run's logged stages, an iteration beyond its logs, "
        "or a local uri that does not exist on this node "
        "(each refused with 400 otherwise: it would make logs garbage for nothing)",
    )


class CheckpointList(_Model):
    run: str
    checkpoints: list[Checkpoint]
    watermarks: list[Watermark]


class UnregisterRequest(_Model):
    stage: int = Field(ge=0, le=MAX_STAGE)
    iteration: int = Field(ge=0, le=MAX_API_ITERATION)
    confirm: StrictBool = Field(False, description="false (default): preview only; true: withdraw the registration")

    @field_validator("stage", "iteration", mode="before")
    @classmethod
    def _json_integer(cls, v: Any) -> Any:
        return _json_integer(v)


class GcPreview(_Model):
    hot_records: int
    hot_segments: int
    hot_bytes: int
    cold_segments: int
    cold_bytes: int


class UnregisterResult(_Model):
    run: str
    dry_run: bool = Field(description="true: a preview, nothing was changed")
    checkpoint: Checkpoint = Field(description="the registration withdrawn (or that would be)")
    watermarks_before: list[Watermark]
    watermarks_after: list[Watermark] = Field(
        description="once it is withdrawn: a stage's watermark falls back to its newest registration left"
    )
    gc_before: GcPreview = Field(description="what a GC would delete with the registrations as they are")
    gc_after: GcPreview = Field(
        description="what a GC would delete once it is withdrawn; "
        "the rest of gc_before is what the remaining registrations keep"
    )
    notes: list[str] = Field(default_factory=list, description="what to know before (or after) confirming")


class GcRequest(_Model):
    confirm: StrictBool = Field(False, description="false (default): dry run, report only; true: delete")


class GcResult(_Model):
    run: str
    dry_run: bool
    watermarks: list[Watermark]
    hot_records: int
    hot_segments: int
    hot_bytes: int
    cold_segments: int
    cold_bytes: int
    aborted_uploads: list[str]
    keys: list[str] = Field(description="record keys deleted (or that would be), first 1000")
    segments: list[str] = Field(description="cold objects deleted (or that would be)")


class OpenSegment(_Model):
    writer: str
    channel: str
    first_iteration: int
    last_iteration: int
    records: int
    bytes: int


class FlushResult(_Model):
    run: str
    uploaded_segments: int
    uploaded_bytes: int
    already_uploaded: int
    open_segments: list[OpenSegment] = Field(
        description="still open in their writer: only the writer seals them (at a segment boundary, "
        "on its flush/close, or when it restarts), so they are not in the cold tier yet"
    )
    skipped_writers: dict[str, str] = Field(
        default_factory=dict,
        description="writers whose index was left out (damaged, truncated, missing), "
        "and why: nothing of theirs was shipped",
    )


class VerifyProblem(_Model):
    tier: str
    key: str
    where: str
    error: str


class VerifyResult(_Model):
    run: str
    ok: bool
    hot_checked: int
    cold_checked: int
    cold_segments: int
    problems: list[VerifyProblem]


class PlanFetch(_Model):
    """A run of records of one channel that one source serves (``replay.plan.FetchItem``)."""

    channel: str
    purpose: Literal["input", "meta", "verify"] = Field(
        description="needed to replay, the live order and scaling, or digests to check the replay's sends against"
    )
    source: int = Field(description="index into the plan's sources")
    tier: Literal["hot", "cold"]
    writer: str
    first_iteration: int
    last_iteration: int
    records: int
    bytes: int
    on_failed_node: bool = Field(
        False, description="a failed stage's writer: its hot tier is reachable only if that node's disk survived"
    )


class PlanUnit(_Model):
    """The plan of one replay unit (``replay.plan.ReplayUnit``)."""

    stages: list[int]
    failed: list[int]
    rolled_back: list[int]
    possible: bool = False
    reasons: list[str] = Field(default_factory=list)
    checkpoint_iteration: int | None = Field(None, description="where every stage of the unit restarts")
    checkpoints: dict[str, str | None] = Field(default_factory=dict, description="stage -> checkpoint URI")
    stop_iteration: int | None = Field(None, description="the first iteration not replayed")
    logged_through: int | None = None
    newest_checkpoint: int | None = None
    iterations: int = 0
    n_microbatches: int | None = None
    needs_data_source: bool = False
    verifiable: bool = False
    fetch: list[PlanFetch] = Field(default_factory=list)
    records: int = 0
    bytes: int = 0
    estimate: dict[str, Any] = Field(default_factory=dict, description="seconds, by phase")
    missing: list[str] = Field(default_factory=list, description="the first missing input keys")
    gaps: list[dict[str, Any]] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class RecoveryPlanDetail(_Model):
    """What the default planner (``replay.plan:plan_recovery``) decided (``replay.plan.RecoveryPlan``)."""

    run: str
    num_stages: int
    failed_stages: list[int]
    target_iteration: int | None = Field(description="the iteration every unit replays up to")
    possible: bool
    recommended: Literal["replay", "global_rollback"]
    reasons: list[str]
    logging_groups: list[list[int]]
    groups_from: str
    units: list[PlanUnit]
    fallback: dict[str, Any] = Field(description="the global rollback: iteration, checkpoint URIs, iterations lost")
    records: int
    bytes: int
    estimated_seconds: float | None
    sources: list[str]
    assumptions: dict[str, Any]
    warnings: list[str] = Field(default_factory=list)
    planned_at: float = 0.0
    failed_ranks: dict[str, list[int]] = Field(
        default_factory=dict, description="multi-stage schedules: each failed rank's pp position -> its stages"
    )


class RecoveryPlan(_Model):
    run: str
    failed_stages: list[int]
    planner: str
    plan: RecoveryPlanDetail | dict[str, Any] = Field(
        union_mode="left_to_right",
        description="the default planner's plan; another planner's JSON object as it returned it",
    )


class CostProfile(_Model):
    """A run's measured costs (``replay.profile.JobProfile``): per boundary, per stage, rates."""

    run_id: str
    num_stages: int
    activation_bytes: list[float] = Field(description="stored bytes per iteration, stage b -> b + 1")
    gradient_bytes: list[float] = Field(description="stored bytes per iteration, stage b + 1 -> b")
    replay_s: list[float] = Field(description="seconds to replay one iteration, per stage")
    step_s: list[float] = Field(description="the live step, per stage")
    iteration_s: float
    checkpoint_interval: int
    fetch_mbps: float
    n_microbatches: int
    domains: list[int] = Field(description="failure domain (node) of each stage")
    replicated: list[bool] = Field(description="a live replica survives the stage's domain's loss")
    restart_s: float
    fixed_bytes: float = Field(description="stored per iteration whatever the grouping (META, digests, inputs)")
    iterations_profiled: int
    compute_slots: int | None = Field(None, description="stages computed at once on their shared machine (None: own)")
    sources: dict[str, str] = Field(description="how each figure was obtained: measured, given, assumed")


class LoggingGroupPlan(_Model):
    """The logging groups the planner chose (``replay.group_planner.GroupPlan``); ``sizes`` is
    what ``ClientConfig.logging_groups`` takes (it takes this whole document too)."""

    sizes: list[int]
    groups: list[list[int]]
    stored_bytes: float = Field(description="logged over a checkpoint interval")
    budget_bytes: float
    expected_recovery_s_per_hour: float = Field(description="the objective: expected recovery seconds per hour")
    recovery_s: list[float] = Field(description="each group's recovery time from a failure inside it")
    mean_recovery_s: float
    greedy: dict[str, Any] = Field(description="the SWIFT prototype's greedy merge on the same inputs, and its gap")
    all_logged: dict[str, Any]
    domain_bytes: dict[str, float]
    recovery: Literal["kill", "in_place"]
    assumptions: dict[str, Any]
    warnings: list[str] = Field(default_factory=list)
