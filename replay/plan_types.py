"""What a recovery plan says: :class:`RecoveryPlan`, its :class:`ReplayUnit` and their :class:`FetchItem`.

``replay.plan.plan_recovery`` returns a :class:`RecoveryPlan`; ``to_dict`` is what the REST API
and the CLI print, ``from_dict`` reads it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FetchItem", "RecoveryPlan", "ReplayUnit"]


@dataclass(slots=True)
class FetchItem:
    """A run of records of one channel that one source serves.

    ``source``: index into :attr:`RecoveryPlan.sources`; ``tier``: "hot" (a segment file of
    ``writer`` on that store's node) or "cold" (the object store); ``purpose``: "input" (needed to
    replay), "meta" (the live order and scaling) or "verify" (digests of the unit's sends);
    ``on_failed_node``: the writer is a failed stage's, so its hot tier is only reachable if that
    node's disk survived.
    """

    channel: str
    purpose: str
    source: int
    tier: str
    writer: str
    first_iteration: int
    last_iteration: int
    records: int
    bytes: int
    on_failed_node: bool = False


@dataclass(slots=True)
class ReplayUnit:
    """The plan of one replay unit (a stage, the logging group that holds failed stages, or adjacent
    failed stages whose sends to each other are in no store).

    ``checkpoint_iteration``: where every stage of the unit restarts (``checkpoints``: their URIs);
    ``stop_iteration``: the first iteration not replayed; ``logged_through``: the first iteration
    from the checkpoint on whose inputs are not completely logged (None: no checkpoint);
    ``newest_checkpoint``: the newest checkpoint every stage of the unit has (their logs before it
    may be garbage-collected: a replay from an older one is impossible then, and says so).
    ``needs_data_source``: stage-0 inputs / last-stage targets were not logged, the replay must be
    given the run's deterministic data source. ``verifiable``: every boundary send of the unit has
    a receiver's digest to be checked against. ``missing``/``gaps``: the first missing input keys /
    recorded gaps that make the replay impossible. ``estimate``: seconds (see module docstring).
    """

    stages: list[int]
    failed: list[int]
    rolled_back: list[int]
    possible: bool = False
    reasons: list[str] = field(default_factory=list)
    checkpoint_iteration: int | None = None
    checkpoints: dict[int, str | None] = field(default_factory=dict)
    stop_iteration: int | None = None
    logged_through: int | None = None
    newest_checkpoint: int | None = None
    iterations: int = 0
    n_microbatches: int | None = None
    needs_data_source: bool = False
    verifiable: bool = False
    fetch: list[FetchItem] = field(default_factory=list)
    records: int = 0
    bytes: int = 0
    estimate: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    gaps: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RecoveryPlan:
    """What :func:`plan_recovery` decided; ``to_dict()`` is what the REST API and CLI print.

    ``possible``: every unit can be replayed (then ``recommended`` is "replay", else
    "global_rollback"); ``reasons``: why not. ``target_iteration``: the iteration every unit
    replays up to (the survivors' iteration). ``fallback``: the global rollback (newest iteration
    at which every stage has a checkpoint, their URIs, iterations lost). ``sources``: the stores
    the plan read, indexed by :attr:`FetchItem.source`. ``assumptions``: the rates used.
    """

    run: str
    num_stages: int
    failed_stages: list[int]
    target_iteration: int | None
    possible: bool
    recommended: str
    reasons: list[str]
    logging_groups: list[list[int]]
    groups_from: str
    units: list[ReplayUnit]
    fallback: dict[str, Any]
    records: int
    bytes: int
    estimated_seconds: float | None
    sources: list[str]
    assumptions: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    planned_at: float = 0.0
    #: with a multi-stage schedule: every failed rank (its ``pp`` position) and the stages it held
    failed_ranks: dict[int, list[int]] = field(default_factory=dict)

    def unit_of(self, stage: int) -> ReplayUnit:
        """The unit that replays ``stage``; KeyError if the stage is in none."""
        for u in self.units:
            if stage in u.stages:
                return u
        raise KeyError(f"stage {stage} is in no replay unit of this plan (failed stages {self.failed_stages})")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (stage numbers as string keys where they are dict keys)."""
        d = asdict(self)
        for u in d["units"]:
            u["checkpoints"] = {str(k): v for k, v in u["checkpoints"].items()}
        d["failed_ranks"] = {str(k): v for k, v in d["failed_ranks"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecoveryPlan:
        """Inverse of :meth:`to_dict` (e.g. the ``plan`` a node server's recovery-plan endpoint returned)."""
        units = []
        for ud in d["units"]:
            ud = dict(ud)
            ud["checkpoints"] = {int(k): v for k, v in ud["checkpoints"].items()}
            ud["fetch"] = [FetchItem(**f) for f in ud.get("fetch", [])]
            units.append(ReplayUnit(**ud))
        ranks = {int(k): list(v) for k, v in d.get("failed_ranks", {}).items()}
        return cls(**{**d, "units": units, "failed_ranks": ranks})
