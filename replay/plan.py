"""Recovery planning: what it takes to rebuild failed stages by replay, or why it cannot be done.

:func:`plan_recovery` looks only at indexes and small documents (checkpoint registrations, gap
records, META records, key listings); it reads no activation or gradient bytes unless asked to
check their checksums (``check_records=True``). From them it decides, per *replay unit*:

- the unit: a logging group that holds a failed stage. Inside a group the sends are not logged,
  so every stage of the group restarts from its checkpoint and the group replays as one
  (its surviving members are listed as ``rolled_back``). Groups are read from the META records
  (``logging_groups``), else inferred from which boundary channels exist.
- the checkpoint it restarts from: the newest iteration at which every stage of the unit has a
  registered checkpoint and from which the logs are complete (older ones are tried when the
  newest cannot work, e.g. a gap after it);
- the iteration to replay up to (``stop_iteration``, exclusive: the iteration the survivors
  stand at). Default: the first iteration whose inputs are not completely logged, taken over
  every unit (the survivors share one iteration); pass ``target_iteration`` when it is known;
- the records to fetch and from where (which store, hot tier of which writer, or the cold
  tier), their bytes, and an estimated time from parameterized rates;
- whether the replay can be verified (the receivers' digests of the unit's boundary sends).

When a unit cannot be replayed (no common checkpoint, a record missing, a gap, a corrupt record
with ``check_records``) the plan says which and why, and names the fallback: a global rollback of
every stage to the newest iteration at which all of them have a checkpoint.

Rates (documented assumptions, not measurements): records are fetched at ``bandwidth_mbps``
MB/s (1 MB = 1e6 bytes) if given, else at :data:`DEFAULT_HOT_MBPS` from a hot tier and
:data:`DEFAULT_COLD_MBPS` from the cold tier. Replay compute per iteration is
``replay_seconds_per_iteration`` per stage if given, else estimated from the live step time
recorded in META: a balanced GPipe/1F1B pipeline of S stages and n micro-batches takes about
(n + S - 1) micro-batch slots per step, a replay of one stage n of them, so one stage replays an
iteration in about ``step_s * n / (n + S - 1)``. Fetching overlaps computing (the engine
prefetches), so a unit takes about ``max(fetch, compute / workers) + fetch / iterations``.

Never: writes to a store, loads a checkpoint, or raises for a recovery that is impossible (the
plan says so); raises ValueError only for arguments that make no sense (no store, no failed
stage, a stage outside the pipeline).
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from logstore import Channel, LogStore, RecordInfo, RecordKey
from logstore.errors import ColdTierError, ColdTierUnavailableError, StoreError, SwiftlogError
from logstore.keys import Kind
from replay.core import needed_channels
from trainer_client.meta import decode_meta

__all__ = [
    "plan_recovery",
    "RecoveryPlan",
    "ReplayUnit",
    "FetchItem",
    "cold_only_store",
    "groups_from_channels",
    "DEFAULT_HOT_MBPS",
    "DEFAULT_COLD_MBPS",
]

logger = logging.getLogger(__name__)

#: assumed read rate of a surviving node's hot tier (MB/s), when ``bandwidth_mbps`` is not given
DEFAULT_HOT_MBPS = 400.0
#: assumed read rate of the cold tier (MB/s), when ``bandwidth_mbps`` is not given
DEFAULT_COLD_MBPS = 100.0
_MAX_LISTED = 20  # missing keys / gaps named per unit


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
        return cls(**{**d, "units": units})


def cold_only_store(
    store_or_url: LogStore | str, run: str | None = None, options: dict[str, Any] | None = None
) -> LogStore:
    """A read-only LogStore that sees only a cold tier (no hot tier is ever opened).

    Give a LogStore (its run and cold tier are used) or a cold URL with ``run`` and fsspec
    ``options``. The caller closes it.
    """
    if isinstance(store_or_url, LogStore):
        if store_or_url.cold is None or not store_or_url.config.cold_url:
            raise ValueError(f"store of run {store_or_url.run!r} has no cold tier")
        url, run, options = store_or_url.config.cold_url, store_or_url.run, dict(store_or_url.config.cold_options)
    else:
        url = store_or_url
        if run is None:
            raise ValueError("cold_only_store(url) needs run=")
    # a root that does not exist: LogStore lists hot tiers under root/run only if it is a directory
    root = os.path.join(tempfile.gettempdir(), f"swiftlog-cold-only-{uuid.uuid4().hex}")
    return LogStore.open(root, run, cold_url=url, cold_options=dict(options or {}))


def groups_from_channels(num_stages: int, channels: set[Channel]) -> list[list[int]]:
    """Logging groups as the channels show them: boundary b|b+1 is logged iff an activation,
    gradient or digest channel crosses it."""
    names = {c.name for c in channels}
    groups: list[list[int]] = [[0]]
    for b in range(num_stages - 1):
        crossing = (
            Channel.activation(b).name,
            Channel.gradient(b + 1).name,
            Channel.digest(b, b + 1).name,
            Channel.digest(b + 1, b).name,
        )
        if any(n in names for n in crossing):
            groups.append([b + 1])
        else:
            groups[-1].append(b + 1)
    return groups


# ====================================================================== the planner
def plan_recovery(
    stores: LogStore | Sequence[LogStore] | None = None,
    failed_stages: Sequence[int] = (),
    *,
    store: LogStore | None = None,
    num_stages: int | None = None,
    target_iteration: int | None = None,
    bandwidth_mbps: float | None = None,
    workers: int = 1,
    replay_seconds_per_iteration: float | None = None,
    check_records: bool = False,
) -> RecoveryPlan:
    """Plan the recovery of ``failed_stages`` from what ``stores`` hold.

    Args:
        stores: one LogStore per reachable node root (each reads every writer's hot tier there and
            the cold tier if configured), a cold-tier-only store, or a node server
            (``replay.remote.HttpRecordSource``: what the node holds, read through its REST API).
            Order is preference order.
        failed_stages: the stages whose state is lost.
        store: one more store (the keyword ``server.planner`` uses).
        num_stages: pipeline size; default: from the checkpoint registrations or the channels.
        target_iteration: the iteration the survivors stand at (replay ``[checkpoint, target)``);
            default: the first iteration not completely logged, over every unit.
        bandwidth_mbps: fetch rate in MB/s for every tier (default: per-tier assumptions).
        workers: parallel replay workers per unit, for the estimate.
        replay_seconds_per_iteration: compute time of one stage-iteration (default: from META).
        check_records: also read every record the replay needs and check its checksums (costs
            the bytes); a corrupt one makes the unit impossible, naming the key.

    Returns a :class:`RecoveryPlan`; never raises for an impossible recovery. Raises ValueError for
    unusable arguments and lets store errors that prevent any planning (e.g. the cold tier is
    unreachable while listing checkpoints) propagate.
    """
    srcs: list[LogStore] = [] if stores is None else ([stores] if isinstance(stores, LogStore) else list(stores))
    if store is not None:
        srcs.append(store)
    if not srcs:
        raise ValueError("plan_recovery needs at least one LogStore")
    runs = {s.run for s in srcs}
    if len(runs) != 1:
        raise ValueError(f"stores of different runs given: {sorted(runs)}")
    failed = sorted({int(f) for f in failed_stages})
    if not failed or failed[0] < 0:
        raise ValueError(f"failed_stages must name at least one stage >= 0, got {list(failed_stages)}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if bandwidth_mbps is not None and bandwidth_mbps <= 0:
        raise ValueError(f"bandwidth_mbps must be > 0, got {bandwidth_mbps}")
    planner = _Planner(
        srcs, failed, num_stages, target_iteration, bandwidth_mbps, workers, replay_seconds_per_iteration, check_records
    )
    try:
        return planner.plan()
    finally:
        planner.close()


def _note_missing(
    u: ReplayUnit, ch: Channel, it: int, mb: int, gap_index: dict[tuple[str, int, int], dict[str, Any]]
) -> str:
    """Add record (``ch``, ``it``, ``mb``, part 0) to ``u.missing`` and its recorded gap, if any, to
    ``u.gaps`` (each list up to its limit); returns the key as text."""
    key = f"{ch.name}/it{it}/mb{mb}/p0"
    if len(u.missing) < _MAX_LISTED:
        u.missing.append(key)
    g = gap_index.get((ch.name, it, mb))
    if g is not None and len(u.gaps) < _MAX_LISTED:
        u.gaps.append(g)
    return key


def _optional(ch: Channel, mbs: dict[int, set[int]]) -> bool:
    """A later stage's keyword inputs (``input_k``, k > 0) are needed only in iterations whose step
    passed some: none logged in an iteration means none were given, not that they are lost."""
    return ch.kind is Kind.INPUT and ch.src > 0 and not mbs


class _Planner:
    def __init__(
        self,
        stores: list[LogStore],
        failed: list[int],
        num_stages: int | None,
        target: int | None,
        bandwidth: float | None,
        workers: int,
        replay_s: float | None,
        check_records: bool,
    ) -> None:
        self.stores = stores
        self.run = stores[0].run
        self.failed = failed
        self.num_stages_arg = num_stages
        self.target = target
        self.bandwidth = bandwidth
        self.workers = workers
        self.replay_s = replay_s
        self.check_records = check_records
        self.warnings: list[str] = []
        self._keys: dict[Channel, dict[int, dict[int, set[int]]]] = {}  # channel -> it -> mb -> parts
        self._keys_lo: dict[Channel, int] = {}
        self._views: list[tuple[int, LogStore]] | None = None
        self._hot_views: list[LogStore] = []
        self._channel_set: set[Channel] | None = None
        self._unlisted: list[
            str
        ] = []  # every source failed to list its channels (the reasons): nothing is known of the logs
        self._metas: dict[tuple[int, int], dict[str, Any] | None] = {}

    def close(self) -> None:
        for v in [*(v for _, v in self._views or []), *self._hot_views]:
            v.close()

    def _hot_only_where_the_cold_tier_is_down(self) -> None:
        """A node root whose cold tier cannot be listed is planned from its hot tiers alone (a
        view of the same root without the cold tier), with a warning: a recovery during an
        object-store outage uses what the survivors' disks hold. A cold-only source stays as it
        is (its error is the plan's)."""
        for i, s in enumerate(self.stores):
            if s.cold is None or s.is_cold_only():
                continue
            try:
                s.checkpoints()  # lists the cold tier's registrations
            except (
                ColdTierUnavailableError,
                ColdTierError,
            ) as e:  # down, or refusing (credentials, bucket, permissions)
                view = LogStore.open(s.root, s.run)
                self._hot_views.append(view)
                self.stores[i] = view
                self.warnings.append(
                    f"the cold tier of {self._describe(s)} cannot be read ({e.message}): planned from that root's hot tiers only "
                    "(the checkpoints registered on this node; records only the cold tier holds are not considered)"
                )

    # ------------------------------------------------------------------ gathering
    def _checkpoints(self) -> dict[int, dict[int, Any]]:
        out: dict[int, dict[int, Any]] = {}
        for s in self.stores:
            try:
                found = s.checkpoints()
            except StoreError as e:
                if not (hasattr(s, "describe") and e.retryable):
                    raise
                self.warnings.append(
                    f"{self._describe(s)} is unreachable, planned without it: {e.message}"
                )  # a node server down
                continue
            for c in found:
                out.setdefault(c.stage, {})[c.iteration] = c
        return out

    def _channels(self) -> set[Channel]:
        found: set[Channel] = set()
        failures = []
        for s in self.stores:
            try:
                found.update(s.channels())
            except SwiftlogError as e:
                failures.append(f"listing channels of {self._describe(s)} failed: {e}")
        self.warnings.extend(failures)
        if self.stores and len(failures) == len(
            self.stores
        ):  # knowing nothing of the logs is no plan of zero iterations
            self._unlisted = failures
        return found

    def _gaps(self) -> list[dict[str, Any]]:
        seen: dict[tuple, dict[str, Any]] = {}
        for s in self.stores:
            try:
                for g in s.gaps():
                    seen[(g["channel"], g["iteration"], g["micro_batch"])] = g
            except SwiftlogError as e:
                self.warnings.append(f"reading the gaps of {self._describe(s)} failed: {e}")
        return [seen[k] for k in sorted(seen)]

    def _index(self, ch: Channel, lo: int) -> dict[int, dict[int, set[int]]]:
        """iteration -> micro-batch -> parts of ``ch`` listed by any store (at least from ``lo`` on)."""
        if ch in self._keys and self._keys_lo[ch] <= lo:
            return self._keys[ch]
        if self._channel_set is not None and ch not in self._channel_set:
            return {}  # no store holds any record of it: no listing needed (pipelines can be wide)
        idx: dict[int, dict[int, set[int]]] = {}
        for s in self.stores:
            try:
                for k in s.keys(ch, lo, None):
                    idx.setdefault(k.iteration, {}).setdefault(k.micro_batch, set()).add(k.part)
            except SwiftlogError as e:
                self.warnings.append(f"listing {ch.name} in {self._describe(s)} failed: {e}")
        self._keys[ch] = idx
        self._keys_lo[ch] = lo
        return idx

    def _meta(self, stage: int, it: int) -> dict[str, Any] | None:
        k = (stage, it)
        if k not in self._metas:
            self._metas[k] = self._meta_record(stage, it, 0)
        return self._metas[k]

    def _own_meta(self, stage: int, it: int, lo: int) -> dict[str, Any]:
        """``stage``'s own META document of ``it`` where a store lists it (from ``lo`` on), else {}."""
        return (self._meta(stage, it) or {}) if it in self._index(Channel.meta(stage), lo) else {}

    def _meta_record(self, stage: int, it: int, micro_batch: int) -> dict[str, Any] | None:
        """A META record (micro-batch 0: the document; 1: its amendment) from the first store that
        has it intact, or None."""
        for s in self.stores:
            try:
                return decode_meta(s.get(RecordKey(Channel.meta(stage), it, micro_batch)))
            except SwiftlogError:
                continue
            except ValueError:  # not JSON: treat as absent
                continue
        return None

    def _unrepeatable_steps(self, stages: Sequence[int], c: int, stop: int) -> list[str]:
        """Why a replay of ``stages`` over [c, stop) would stop at an optimizer step (at most one
        reason): an amended META (micro-batch 1) whose step the client saw differ from the
        document, or not made at all (gradients accumulated over iterations); or a loop seen
        stepping irregularly whose count after the last iteration never reached META."""
        for it in range(c, stop):
            for k in stages:
                carried = self._own_meta(k, it, c).get("grads_carried")
                if carried:
                    return [
                        f"stage {k} iteration {it}: the live loop did not zero the gradients after the previous optimizer step "
                        f"({', '.join(carried[:3])}...): a replay, which starts every iteration from no gradients, stops there"
                    ]
                if 1 in self._index(Channel.meta(k), c).get(it, {}):
                    am = self._meta_record(k, it, 1) or {}
                    if am.get("changed_after_commit") or am.get("grads_changed") or not am:
                        what = am.get("changed_after_commit") or ["see its META"]
                        return [
                            f"stage {k} iteration {it}: the live optimizer step was not what its META says ({'; '.join(what)}): "
                            "a replay stops there (the live loop changed it in a way a replay does not repeat)"
                        ]
                    if (am.get("apply") or {}).get("optimizer_steps") == 0:
                        return [
                            f"stage {k} iteration {it}: the live loop made no optimizer step after it (gradients accumulated over "
                            "iterations?): a replay, which makes one after every iteration, stops there"
                        ]
                elif (
                    it == stop - 1
                    and it in self._index(Channel.meta(k), c)
                    and (self._meta(k, it) or {}).get("apply_irregular") is not None
                ):
                    return [
                        f"stage {k} iteration {it}: the live loop did not step its optimizer and lr scheduler once per iteration, and "
                        "what it made after this last iteration is not logged (the stage died before its next iteration began)"
                    ]
        return []

    def _any_meta(self, it: int, prefer: Sequence[int], num_stages: int) -> tuple[int, dict[str, Any]] | None:
        for k in list(prefer) + [k for k in range(num_stages) if k not in prefer]:
            if it in self._index(Channel.meta(k), 0) and (m := self._meta(k, it)) is not None:
                return k, m
        return None

    def _describe(self, s: LogStore) -> str:
        if hasattr(s, "describe"):  # a node server (replay.remote.HttpRecordSource)
            return str(s.describe())
        cold = getattr(s.config, "cold_url", None)
        return f"store root {s.root}" + (f" + cold tier {cold}" if cold else "")

    # ------------------------------------------------------------------ the plan
    def plan(self) -> RecoveryPlan:
        self._hot_only_where_the_cold_tier_is_down()
        ckpts = self._checkpoints()
        channels = self._channels()
        self._channel_set = channels
        gaps = self._gaps()
        S = self._num_stages(ckpts, channels)
        bad = [f for f in self.failed if f >= S]
        if bad:
            raise ValueError(f"failed stages {bad} are outside the pipeline of {S} stages (0..{S - 1})")
        groups, groups_from = self._groups(S, channels)
        units: list[ReplayUnit] = []
        for g in groups:
            fs = [f for f in self.failed if f in g]
            if not fs:
                continue
            prev = units[-1] if units else None
            b = g[
                0
            ]  # a failed stage next to a failed stage whose sends to it are nowhere: one unit, those sends regenerated
            if (
                prev is not None
                and prev.stages[-1] == b - 1
                and b - 1 in self.failed
                and b in self.failed
                and not (Channel.activation(b - 1) in channels and Channel.gradient(b) in channels)
            ):
                units[-1] = ReplayUnit(
                    stages=[*prev.stages, *g],
                    failed=[*prev.failed, *fs],
                    rolled_back=[*prev.rolled_back, *(k for k in g if k not in fs)],
                )
                self.warnings.append(
                    f"stages {b - 1} and {b} failed and their sends to each other are in no store: replayed together"
                )
                continue
            units.append(ReplayUnit(stages=list(g), failed=fs, rolled_back=[k for k in g if k not in fs]))
        for u in units:
            self._analyse(u, ckpts, gaps, S)
        # the survivors stand at one iteration: every unit replays up to the same one
        if self.target is not None:
            target: int | None = self.target
        else:
            horizons = [u.logged_through for u in units if u.logged_through is not None]
            target = min(horizons) if horizons else None
            committed = max((max(self._index(Channel.meta(k), 0), default=-1) for k in range(S)), default=-1)
            if target is not None and committed >= target:  # the default target hides what the survivors did after it
                self.warnings.append(
                    f"the default target is the last iteration the replay's inputs are complete for ({target}), but stages "
                    f"committed up to iteration {committed}: if the survivors stand past {target}, this plan does not bring "
                    f"the failed stage(s) there (swiftlog replay --plan-only -t ITERATION shows what is missing)"
                )
        for u in units:
            self._finish(u, target, gaps, S)
            if self._unlisted:
                u.reasons.insert(0, f"no source could list the run's logs: {self._unlisted[0]}")
                u.possible = False
        possible = all(u.possible for u in units)
        reasons = [f"stages {u.stages}: {r}" for u in units for r in u.reasons]
        fallback = self._fallback(ckpts, S, target)
        secs = [u.estimate.get("total_seconds") for u in units if u.possible]
        return RecoveryPlan(
            run=self.run,
            num_stages=S,
            failed_stages=list(self.failed),
            target_iteration=target,
            possible=possible,
            recommended="replay" if possible else "global_rollback",
            reasons=reasons,
            logging_groups=[list(g) for g in groups],
            groups_from=groups_from,
            units=units,
            fallback=fallback,
            records=sum(u.records for u in units),
            bytes=sum(u.bytes for u in units),
            estimated_seconds=max(secs) if secs and all(s is not None for s in secs) else None,
            sources=[self._describe(s) for s in self.stores],
            assumptions={
                "bandwidth_mbps": self.bandwidth,
                "hot_mbps": self.bandwidth or DEFAULT_HOT_MBPS,
                "cold_mbps": self.bandwidth or DEFAULT_COLD_MBPS,
                "workers": self.workers,
                "replay_seconds_per_iteration": self.replay_s,
                "units_run_concurrently": True,
            },
            warnings=self.warnings,
            planned_at=time.time(),
        )

    def _num_stages(self, ckpts: dict[int, dict[int, Any]], channels: set[Channel]) -> int:
        if self.num_stages_arg is not None:
            if self.num_stages_arg < 1:
                raise ValueError(f"num_stages must be >= 1, got {self.num_stages_arg}")
            return self.num_stages_arg
        for by_it in ckpts.values():
            for c in by_it.values():
                n = (c.meta or {}).get("num_stages")
                if isinstance(n, int) and n > 0:
                    return n
        stages = {c.src for c in channels} | {c.dst for c in channels} | set(ckpts)
        if not stages and self._unlisted:
            raise ValueError(f"run {self.run!r}: no source could be read: {self._unlisted[0]}")
        if not stages:
            raise ValueError(
                f"run {self.run!r}: no checkpoint and no record in any of the given stores "
                "(is the run id right, and are these the nodes' store roots or the run's cold tier?)"
            )
        n = max(stages) + 1
        self.warnings.append(
            f"num_stages={n} inferred from the channels (pass num_stages if the last stages logged nothing)"
        )
        return n

    def _groups(self, S: int, channels: set[Channel]) -> tuple[list[list[int]], str]:
        for k in range(S):
            its = sorted(self._index(Channel.meta(k), 0))
            if its and (m := self._meta(k, its[-1])) is not None:
                lg = m.get("logging_groups")
                if lg is None:
                    return [[s] for s in range(S)], f"META of stage {k} at iteration {its[-1]} (every boundary logged)"
                if sum(lg) == S and all(isinstance(x, int) and x > 0 for x in lg):
                    out, at = [], 0
                    for size in lg:
                        out.append(list(range(at, at + size)))
                        at += size
                    return out, f"META of stage {k} at iteration {its[-1]}"
                self.warnings.append(
                    f"META of stage {k} has logging_groups={lg!r}, which does not fit {S} stages; inferring from channels"
                )
                break
        return groups_from_channels(S, channels), "channels present (no META found)"

    def _data_from_source(self, unit: ReplayUnit, S: int) -> bool:
        if unit.stages[0] != 0 and unit.stages[-1] != S - 1:
            return False
        for k in range(S):
            its = sorted(self._index(Channel.meta(k), 0))
            if its and (m := self._meta(k, its[-1])) is not None:
                return m.get("data") == "source"
        return False

    def _analyse(self, u: ReplayUnit, ckpts: dict[int, dict[int, Any]], gaps: list[dict[str, Any]], S: int) -> None:
        """Choose the checkpoint and find how far the logs are complete (``logged_through``)."""
        u.needs_data_source = self._data_from_source(u, S)
        chans = self._unit_channels(u, S)
        have = [
            {it for it, info in ckpts.get(k, {}).items() if info.uri} for k in u.stages
        ]  # a registration without a URI (the API allows it) cannot be loaded
        missing_ck = [k for k, h in zip(u.stages, have, strict=True) if not h]
        if missing_ck:
            no_uri = [k for k in missing_ck if ckpts.get(k)]
            u.reasons.append(
                f"no registered checkpoint of stage(s) {missing_ck} in the given stores{self._where_checkpoints_are()}"
                if not no_uri
                else f"the checkpoints of stage(s) {no_uri} were registered without a URI: nothing to load them from"
            )
            return
        common = sorted(set.intersection(*have), reverse=True)
        u.newest_checkpoint = min(
            max(h) for h in have
        )  # the GC of the unit's inputs ran up to each stage's newest (at least)
        if self.target is not None:
            common = [c for c in common if c <= self.target]
        if not common:
            u.reasons.append(
                f"no checkpoint iteration common to stages {u.stages}"
                + (f" at or below the target {self.target}" if self.target is not None else "")
                + f" (registered: { {k: sorted(h) for k, h in zip(u.stages, have, strict=True)} })"
            )
            return
        best: tuple[int, int] | None = None
        for c in common:
            through = self._logged_through(u, chans["inputs"], c, S)
            if best is None:
                best = (c, through)
            if self.target is None or through >= self.target:
                best = (c, through)
                break
        assert best is not None
        c, through = best
        u.checkpoint_iteration = c
        u.checkpoints = {k: ckpts[k][c].uri for k in u.stages}
        u.logged_through = through
        if c != common[0]:
            u.warnings.append(
                f"the newest common checkpoint ({common[0]}) cannot reach the target; using the one at {c}"
            )

    def _unit_channels(self, u: ReplayUnit, S: int) -> dict[str, list[Channel]]:
        """:func:`needed_channels` of the unit, plus the step's keyword inputs its stages after stage 0
        logged (``input_k``; see :func:`_optional`)."""
        chans = needed_channels(u.stages[0], u.stages[-1], S, data_source=u.needs_data_source)
        have = self._channel_set or set()
        chans["inputs"] = [
            *chans["inputs"],
            *(Channel.input(k) for k in u.stages if k > 0 and Channel.input(k) in have),
        ]
        return chans

    def _logged_through(self, u: ReplayUnit, inputs: list[Channel], c: int, S: int) -> int:
        """First iteration >= c at which some input of the unit is not completely logged."""
        idx = {ch: self._index(ch, c) for ch in inputs}
        top = max((max(i) for i in idx.values() if i), default=c - 1)
        if not inputs:  # a whole-pipeline unit fed by a data source: only META bounds it
            top = max((max(self._index(Channel.meta(k), 0), default=-1) for k in range(S)), default=c - 1)
        it = c
        while it <= top:
            n = self._n_mb(u, it, S)
            if n is None:
                return it
            for ch in inputs:
                mbs = idx[ch].get(it, {})
                if not _optional(ch, mbs) and any(mb not in mbs for mb in range(n)):
                    return it
            it += 1
        return it

    def _n_mb(self, u: ReplayUnit, it: int, S: int) -> int | None:
        """Micro-batches of iteration ``it`` from any stage's META; None when no stage has one
        (no stage reached the commit of that iteration, so the survivors did not apply it)."""
        found = self._any_meta(it, u.stages, S)
        if found is None:
            return None
        return int(found[1].get("n_microbatches", 0)) or None

    def _finish(self, u: ReplayUnit, target: int | None, gaps: list[dict[str, Any]], S: int) -> None:
        """With the plan's target known: what is missing, what to fetch, the estimate."""
        if u.checkpoint_iteration is None:
            return
        c = u.checkpoint_iteration
        if target is None:
            target = u.logged_through
        assert target is not None
        u.stop_iteration = target
        if target < c:
            u.reasons.append(f"target iteration {target} is before the checkpoint at {c}")
            return
        u.iterations = target - c
        first = u.stages[0]
        chans = self._unit_channels(u, S)
        gap_index = {(g["channel"], g["iteration"], g["micro_batch"]): g for g in gaps}
        stop = target  # the iterations examined: never past the first one not fully logged (a target far beyond the logs costs nothing)
        if u.logged_through is not None and target > u.logged_through + 1:
            stop = u.logged_through + 1
        # inputs: every micro-batch of every iteration in [c, stop)
        n_mbs: dict[int, int | None] = {}
        for it in range(c, stop):
            n_mbs[it] = self._n_mb(u, it, S)
        known = [n for n in n_mbs.values() if n]
        u.n_microbatches = max(set(known), key=known.count) if known else None
        for it in range(c, stop):
            n = n_mbs[it]
            if n is None:
                u.missing.append(f"{Channel.meta(first).name}/it{it}/mb0/p0")
                u.reasons.append(
                    f"iteration {it}: no stage has a META record (no stage committed it, or it was garbage-collected)"
                )
                continue
            for ch in chans["inputs"]:
                mbs = self._index(ch, c).get(it, {})
                if _optional(ch, mbs):
                    continue
                for mb in range(n):
                    if mb not in mbs:
                        _note_missing(u, ch, it, mb, gap_index)
        reduced = self._reduced_channels(
            u, c, stop, gap_index
        )  # what the stages' all_reduce_grads_ calls left, where they made some
        newest = u.newest_checkpoint
        collected = (
            newest is not None and c < newest and (u.missing or any("no stage has a META" in r for r in u.reasons))
        )
        if collected:
            u.reasons.insert(
                0,
                f"the logs of [{c}, {newest}) were garbage-collected when stage(s) {u.stages} registered their checkpoint at {newest}: "
                f"a replay starts from it and reaches only iterations from {newest} on",
            )
        if u.missing:
            first_key = u.missing[0]
            g = u.gaps[0] if u.gaps else None
            why = (
                f"; a gap was recorded for {g['channel']}/it{g['iteration']}/mb{g['micro_batch']}: {g['reason']}"
                if g
                else ""
            )
            u.reasons.append(f"inputs missing for [{c}, {target}): first missing record {first_key}{why}")
        if stop < target and not (collected and newest is not None and target <= newest):
            u.reasons.append(
                f"target iteration {target} is beyond the logs: iterations [{stop}, {target}) are not logged (nor is {stop - 1} completely)"
            )
        # META: the unit's own, else another stage's stands in (ascending schedules only)
        meta_chans: set[Channel] = set()
        for it in range(c, stop):
            own = [k for k in u.stages if it in self._index(Channel.meta(k), 0)]
            meta_chans.update(Channel.meta(k) for k in own)
            found = None if own else self._any_meta(it, u.stages, S)
            if found is not None:
                meta_chans.add(Channel.meta(found[0]))
                if not any("stands in" in w for w in u.warnings):
                    u.warnings.append(
                        f"no META of stages {u.stages} at iteration {it} (lost with their node?): stage {found[0]}'s META stands in"
                    )
        u.reasons.extend(self._unrepeatable_steps(u.stages, c, stop))
        # gaps on channels the replay reads or verifies
        verify_names = {ch.name for ch in chans["verify"]}
        input_names = {ch.name for ch in chans["inputs"]}
        for g in gaps:
            if c <= g["iteration"] < target:
                if g["channel"] in input_names and g not in u.gaps and len(u.gaps) < _MAX_LISTED:
                    u.gaps.append(g)
                    if not u.missing:
                        u.reasons.append(
                            f"gap recorded on {g['channel']}/it{g['iteration']}/mb{g['micro_batch']}: {g['reason']}"
                        )
                elif g["channel"] in verify_names:
                    u.warnings.append(
                        f"gap on {g['channel']}/it{g['iteration']}/mb{g['micro_batch']} ({g['reason']}): that send cannot be verified"
                    )
        # verification: a digest of every boundary send (part 0 at least) of every micro-batch
        u.verifiable = bool(chans["verify"]) and all(
            all(mb in self._index(ch, c).get(it, {}) for mb in range(n_mbs[it] or 0))
            for ch in chans["verify"]
            for it in range(c, stop)
        )
        if not chans["verify"]:
            u.warnings.append(
                "the unit sends nothing across a logged boundary: there is nothing to verify the replay against"
            )
        elif not u.verifiable:
            u.warnings.append("some digests of the unit's sends are missing: the replay cannot be fully verified")
        # where to fetch from
        failed_writers = {f"stage{k}" for k in self.failed}
        self._fetch_items(
            u,
            [(ch, "input") for ch in [*chans["inputs"], *reduced]]
            + [(ch, "meta") for ch in sorted(meta_chans)]
            + [(ch, "verify") for ch in chans["verify"]],
            c,
            stop,
            failed_writers,
        )
        if self.check_records and not u.reasons:
            self._check_records(
                u, [*chans["inputs"], *reduced, *sorted(meta_chans), *chans["verify"]], c, stop
            )  # what the replay reads, all of it
        u.possible = not u.reasons
        self._estimate(u, S)

    def _reduced_channels(
        self, u: ReplayUnit, c: int, stop: int, gap_index: dict[tuple[str, int, int], dict[str, Any]]
    ) -> list[Channel]:
        """The ``reduced_{stage}`` channels of the unit's stages whose META lists
        ``all_reduce_grads_`` calls in [c, stop); a call's record missing is added to ``u.missing``
        (and its gap, if one was recorded), with a reason."""
        chans: list[Channel] = []
        first_missing = None
        for k in u.stages:
            ch = Channel.reduced(k)
            for it in range(c, stop):
                calls = self._own_meta(k, it, c).get("grad_reduce") or []
                if not calls:
                    continue
                if ch not in chans:
                    chans.append(ch)
                have = self._index(ch, c).get(it, {})
                for call in range(len(calls)):
                    if call not in have:
                        first_missing = first_missing or _note_missing(u, ch, it, call, gap_index)
        if first_missing is not None:
            u.reasons.append(
                f"the reduced gradients of a stage's all_reduce_grads_ call are missing: first {first_missing} (a stage's own records "
                "outlive its node only in the run's cold tier)"
            )
        return chans

    def _cold_views(self) -> list[tuple[int, LogStore]]:
        """(store index, cold-only view) for every store with a cold tier: a record listed hot on a
        failed stage's writer may also be in the cold tier, which a replacement can always read."""
        if self._views is None:
            self._views = []
            for i, s in enumerate(self.stores):
                if (
                    s.cold is None
                    or not s.config.cold_url
                    or any(v.config.cold_url == s.config.cold_url for _, v in self._views)
                ):
                    continue
                self._views.append((i, cold_only_store(s)))
        return self._views

    def _fetch_items(
        self, u: ReplayUnit, chans: list[tuple[Channel, str]], lo: int, hi: int, failed_writers: set[str]
    ) -> None:
        def rank(info: RecordInfo) -> int:  # hot on a survivor < cold < hot on a failed node
            return 1 if info.tier == "cold" else (2 if info.writer in failed_writers else 0)

        listers = [(i, s) for i, s in enumerate(self.stores)] + self._cold_views()
        for ch, purpose in chans:
            chosen: dict[RecordKey, tuple[int, RecordInfo]] = {}
            for i, s in listers:
                after: RecordKey | None = None
                try:
                    while True:
                        page = s.list_records(ch, lo, hi, after=after, limit=1000)
                        if not page:
                            break
                        for info in page:
                            prev = chosen.get(info.key)
                            if prev is None or rank(info) < rank(prev[1]):
                                chosen[info.key] = (i, info)
                        after = page[-1].key
                except SwiftlogError as e:
                    self.warnings.append(f"listing {ch.name} in {self._describe(s)} failed: {e}")
            runs: dict[tuple[int, str, str], FetchItem] = {}
            for key in sorted(chosen):
                i, info = chosen[key]
                item = runs.get((i, info.tier, info.writer))
                if item is None:
                    item = runs[(i, info.tier, info.writer)] = FetchItem(
                        channel=ch.name,
                        purpose=purpose,
                        source=i,
                        tier=info.tier,
                        writer=info.writer,
                        first_iteration=key.iteration,
                        last_iteration=key.iteration,
                        records=0,
                        bytes=0,
                        on_failed_node=info.tier == "hot" and info.writer in failed_writers,
                    )
                item.first_iteration = min(item.first_iteration, key.iteration)
                item.last_iteration = max(item.last_iteration, key.iteration)
                item.records += 1
                item.bytes += info.stored_bytes
            for item in runs.values():
                u.fetch.append(item)
                u.records += item.records
                u.bytes += item.bytes
                if item.on_failed_node and not any("failed stage's node" in w for w in u.warnings):
                    u.warnings.append(
                        f"{item.channel} is read from the hot tier of writer {item.writer} (a failed stage's node): "
                        "reachable only if that disk survived; flush or ship it to the cold tier"
                    )

    def _check_records(self, u: ReplayUnit, chans: list[Channel], lo: int, hi: int) -> None:
        for ch in chans:
            for it in range(lo, hi):
                for mb, parts in sorted(self._index(ch, lo).get(it, {}).items()):
                    for part in sorted(parts):
                        key = RecordKey(ch, it, mb, part)
                        errs = []
                        for s in self.stores:
                            try:
                                s.get_blob(key)
                                errs = []
                                break
                            except SwiftlogError as e:
                                errs.append(e)
                        if errs:
                            u.reasons.append(f"record {key} cannot be read intact: {errs[-1]}")
                            u.missing.append(str(key))
                            return

    def _estimate(self, u: ReplayUnit, S: int) -> None:
        hot = self.bandwidth or DEFAULT_HOT_MBPS
        cold = self.bandwidth or DEFAULT_COLD_MBPS
        fetch_s = sum(f.bytes / ((hot if f.tier == "hot" else cold) * 1e6) for f in u.fetch)
        per_it: float | None = None
        basis = ""
        if self.replay_s is not None:
            per_it = self.replay_s * len(u.stages)
            basis = f"replay_seconds_per_iteration={self.replay_s} x {len(u.stages)} stage(s)"
        else:
            lo = u.checkpoint_iteration or 0
            hi = u.stop_iteration or lo
            steps = [
                float(m["step_s"])
                for (_, it), m in self._metas.items()
                if lo <= it < hi and m and isinstance(m.get("step_s"), (int, float))
            ]
            n = u.n_microbatches
            if steps and n:
                step = statistics.median(steps)
                per_it = step * n / (n + S - 1) * len(u.stages)
                basis = (
                    f"live step {step:.4f} s (median of META) x n/(n+S-1) = {n}/{n + S - 1} x {len(u.stages)} stage(s)"
                )
        if per_it is None:
            u.estimate = {
                "fetch_seconds": fetch_s,
                "replay_seconds": None,
                "total_seconds": None,
                "workers": self.workers,
                "basis": "no live step time in META and replay_seconds_per_iteration not given",
            }
            return
        replay_s = per_it * u.iterations
        total = max(fetch_s, replay_s / self.workers) + (fetch_s / u.iterations if u.iterations else 0.0)
        u.estimate = {
            "fetch_seconds": fetch_s,
            "replay_seconds": replay_s,
            "seconds_per_iteration": per_it,
            "total_seconds": total,
            "workers": self.workers,
            "basis": basis,
        }

    def _where_checkpoints_are(self) -> str:
        """Where else a stage's checkpoint registration is, when the given stores have no cold tier."""
        if any(s.cold is not None for s in self.stores):
            return ""
        return " (a stage registers its checkpoints on its own node and in the run's cold tier: pass the cold tier, --cold-url, or that node's store root)"

    def _fallback(self, ckpts: dict[int, dict[int, Any]], S: int, target: int | None) -> dict[str, Any]:
        sets = [set(ckpts.get(k, {})) for k in range(S)]
        common = set.intersection(*sets) if sets else set()
        if target is not None:
            common = {c for c in common if c <= target}
        if not common:
            unknown = [k for k in range(S) if not sets[k]]
            note = (
                f"the given stores register no checkpoint of stage(s) {unknown}{self._where_checkpoints_are()}; if none was ever made, restart the run from scratch"
                if unknown
                else "no iteration at which every stage has a checkpoint: restart the run from scratch"
            )
            return {
                "kind": "global_rollback",
                "iteration": None,
                "checkpoints": {},
                "lost_iterations": target,
                "note": note,
            }
        c = max(common)
        return {
            "kind": "global_rollback",
            "iteration": c,
            "checkpoints": {str(k): ckpts[k][c].uri for k in range(S)},
            "lost_iterations": None if target is None else target - c,
            "note": f"restart every stage from its checkpoint at iteration {c} (all survivors' progress since is lost)",
        }
