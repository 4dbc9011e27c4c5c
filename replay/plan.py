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

Rates: records are fetched at ``bandwidth_mbps`` MB/s (1 MB = 1e6 bytes) if given, else at the
measured rate of their tier (``rates``: what earlier recoveries of the job read at, from
:func:`replay.measured_rates`; the plan's ``assumptions["rates_measured"]`` names them), else at
the documented assumptions :data:`DEFAULT_HOT_MBPS` from a hot tier and
:data:`DEFAULT_COLD_MBPS` from the cold tier. Replay compute per iteration is
``replay_seconds_per_iteration`` per stage if given, else estimated from the live step time
recorded in META: a balanced GPipe/1F1B pipeline of S stages and n micro-batches takes about
(n + S - 1) micro-batch slots per step, a replay of one stage n of them, so one stage replays an
iteration in about ``step_s * n / (n + S - 1)``. Fetching overlaps computing (the engine
prefetches), so a unit takes about ``max(fetch, compute / workers) + fetch / iterations``.

The parts: ``replay.plan_types`` (what a plan says), ``replay._plan_index`` (what the stores
hold, listed once), ``replay._plan_fetch`` (where each record comes from, the estimate). This
module is the planner's decisions (units, checkpoints, target, what is missing, the fallback): one
module over 600 lines because they share one state, the units being planned and their reasons.

Never: writes to a store, loads a checkpoint, or raises for a recovery that is impossible (the
plan says so); raises ValueError only for arguments that make no sense (no store, no failed
stage, a stage outside the pipeline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from logstore import Channel, LogStore
from logstore.keys import Kind
from replay._plan_fetch import DEFAULT_COLD_MBPS, DEFAULT_HOT_MBPS, check_records, estimate, fetch_items, tier_rates
from replay._plan_index import LogIndex, cold_only_store
from replay.core import needed_channels
from replay.plan_types import FetchItem, RecoveryPlan, ReplayUnit
from trainer_client.mesh import STAGE_STYLES, rank_stages

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

_MAX_LISTED = 20  # missing keys / gaps named per unit


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
    rates: dict[str, float] | None = None,
    failed_ranks: Sequence[int] = (),
    stages_per_rank: int = 1,
    stage_style: str = "loop",
) -> RecoveryPlan:
    """Plan the recovery of ``failed_stages`` (and of every stage of ``failed_ranks``) from what
    ``stores`` hold.

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
        bandwidth_mbps: fetch rate in MB/s for every tier (default: ``rates``, else per-tier assumptions).
        rates: measured fetch rates per tier in MB/s (``{"hot": .., "cold": ..}``, e.g.
            :func:`replay.measured_rates` of earlier recoveries); a tier without one is assumed.
        workers: parallel replay workers per unit, for the estimate.
        replay_seconds_per_iteration: compute time of one stage-iteration (default: from META).
        check_records: also read every record the replay needs and check its checksums (costs
            the bytes); a corrupt one makes the unit impossible, naming the key.
        failed_ranks / stages_per_rank / stage_style: with a multi-stage schedule, the lost ranks
            (their ``pp`` positions) and how the schedule placed stages on them
            (``trainer_client.mesh.rank_stages``): every stage of each is planned, and the plan's
            ``failed_ranks`` names them.

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
    if (not failed and not failed_ranks) or (failed and failed[0] < 0) or any(r < 0 for r in failed_ranks):
        raise ValueError(
            f"failed_stages / failed_ranks must name at least one stage or rank >= 0, got {list(failed_stages)} / "
            f"{list(failed_ranks)}"
        )
    if stages_per_rank < 1 or stage_style not in STAGE_STYLES:
        raise ValueError(f"stages_per_rank must be >= 1 and stage_style one of {STAGE_STYLES}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if bandwidth_mbps is not None and bandwidth_mbps <= 0:
        raise ValueError(f"bandwidth_mbps must be > 0, got {bandwidth_mbps}")
    planner = _Planner(
        srcs, failed, num_stages, target_iteration, bandwidth_mbps, workers, replay_seconds_per_iteration, check_records
    )
    planner.rates = dict(rates or {})
    planner.ranks = (sorted(set(failed_ranks)), stages_per_rank, stage_style)
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
    """One plan: its arguments, what the stores hold (:class:`~replay._plan_index.LogIndex`), its warnings."""

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
        self.run = stores[0].run
        self.failed = failed
        self.num_stages_arg = num_stages
        self.target = target
        self.bandwidth = bandwidth
        self.workers = workers
        self.replay_s = replay_s
        self.check_records = check_records
        self.rates: dict[str, float] = {}  # measured per-tier fetch rates (MB/s)
        self.ranks: tuple[list[int], int, str] = ([], 1, "loop")  # failed ranks, stages per rank, stage style
        self.warnings: list[str] = []
        self.logs = LogIndex(stores, self.warnings)  # what the stores hold, listed once

    def close(self) -> None:
        self.logs.close()

    def _unrepeatable_steps(self, stages: Sequence[int], c: int, stop: int) -> list[str]:
        """Why a replay of ``stages`` over [c, stop) would stop at an optimizer step (at most one
        reason): an amended META (micro-batch 1) whose step the client saw differ from the
        document, or not made at all (gradients accumulated over iterations); or a loop seen
        stepping irregularly whose count after the last iteration never reached META."""
        for it in range(c, stop):
            for k in stages:
                carried = self.logs.own_meta(k, it, c).get("grads_carried")
                if carried:
                    return [
                        f"stage {k} iteration {it}: the live loop did not zero the gradients after the previous "
                        f"optimizer step ({', '.join(carried[:3])}...): a replay, which starts every iteration from no "
                        "gradients, stops there"
                    ]
                if 1 in self.logs.index(Channel.meta(k), c).get(it, {}):
                    am = self.logs.meta_record(k, it, 1) or {}
                    if am.get("changed_after_commit") or am.get("grads_changed") or not am:
                        what = am.get("changed_after_commit") or ["see its META"]
                        return [
                            f"stage {k} iteration {it}: the live optimizer step was not what its META says "
                            f"({'; '.join(what)}): a replay stops there (the live loop changed it in a way a replay "
                            "does not repeat)"
                        ]
                    if (am.get("apply") or {}).get("optimizer_steps") == 0:
                        return [
                            f"stage {k} iteration {it}: the live loop made no optimizer step after it (gradients "
                            "accumulated over iterations?): a replay, which makes one after every iteration, stops "
                            "there"
                        ]
                elif (
                    it == stop - 1
                    and it in self.logs.index(Channel.meta(k), c)
                    and (self.logs.meta(k, it) or {}).get("apply_irregular") is not None
                ):
                    return [
                        f"stage {k} iteration {it}: the live loop did not step its optimizer and lr scheduler once per "
                        "iteration, and what it made after this last iteration is not logged (the stage died before "
                        "its next iteration began)"
                    ]
        return []

    def _rank_stages(self, S: int) -> dict[int, list[int]]:
        """The stages of every failed rank (``self.ranks``) in a pipeline of ``S`` stages."""
        ranks, per_rank, style = self.ranks
        if not ranks:
            return {}
        if S % per_rank:
            raise ValueError(f"{S} stages cannot be held {per_rank} per rank")
        P = S // per_rank
        bad = [r for r in ranks if r >= P]
        if bad:
            raise ValueError(f"failed ranks {bad} are outside the {P} ranks of {per_rank} stages each")
        return {r: list(rank_stages(r, P, per_rank, style)) for r in ranks}

    def plan(self) -> RecoveryPlan:
        self.logs.hot_only_where_the_cold_tier_is_down()
        ckpts = self.logs.checkpoints()
        channels = self.logs.channels()
        self.logs.channel_set = channels
        gaps = self.logs.gaps()
        S = self._num_stages(ckpts, channels)
        by_rank = self._rank_stages(S)
        self.failed = sorted({*self.failed, *(k for ks in by_rank.values() for k in ks)})
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
            committed = max((max(self.logs.index(Channel.meta(k), 0), default=-1) for k in range(S)), default=-1)
            if target is not None and committed >= target:  # the default target hides what the survivors did after it
                self.warnings.append(
                    f"the default target is the last iteration the replay's inputs are complete for ({target}), but "
                    f"stages committed up to iteration {committed}: if the survivors stand past {target}, this plan "
                    "does not bring the failed stage(s) there (swiftlog replay --plan-only -t ITERATION shows what is "
                    "missing)"
                )
        for u in units:
            self._finish(u, target, gaps, S)
            if self.logs.unlisted:
                u.reasons.insert(0, f"no source could list the run's logs: {self.logs.unlisted[0]}")
                u.possible = False
        possible = all(u.possible for u in units)
        reasons = [f"stages {u.stages}: {r}" for u in units for r in u.reasons]
        fallback = self._fallback(ckpts, S, target)
        secs = [u.estimate.get("total_seconds") for u in units if u.possible]
        return RecoveryPlan(
            run=self.run,
            num_stages=S,
            failed_stages=list(self.failed),
            failed_ranks=by_rank,
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
            sources=[self.logs.describe(s) for s in self.logs.stores],
            assumptions={
                "bandwidth_mbps": self.bandwidth,
                "hot_mbps": tier_rates(self.bandwidth, self.rates)[0],
                "cold_mbps": tier_rates(self.bandwidth, self.rates)[1],
                "rates_measured": sorted(t for t in ("hot", "cold") if self.rates.get(t) and not self.bandwidth),
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
        if not stages and self.logs.unlisted:
            raise ValueError(f"run {self.run!r}: no source could be read: {self.logs.unlisted[0]}")
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
            its = sorted(self.logs.index(Channel.meta(k), 0))
            if its and (m := self.logs.meta(k, its[-1])) is not None:
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
                    f"META of stage {k} has logging_groups={lg!r}, which does not fit {S} stages; inferring from "
                    "channels"
                )
                break
        return groups_from_channels(S, channels), "channels present (no META found)"

    def _data_from_source(self, unit: ReplayUnit, S: int) -> bool:
        if unit.stages[0] != 0 and unit.stages[-1] != S - 1:
            return False
        for k in range(S):
            its = sorted(self.logs.index(Channel.meta(k), 0))
            if its and (m := self.logs.meta(k, its[-1])) is not None:
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
        have = self.logs.channel_set or set()
        chans["inputs"] = [
            *chans["inputs"],
            *(Channel.input(k) for k in u.stages if k > 0 and Channel.input(k) in have),
        ]
        return chans

    def _logged_through(self, u: ReplayUnit, inputs: list[Channel], c: int, S: int) -> int:
        """First iteration >= c at which some input of the unit is not completely logged."""
        idx = {ch: self.logs.index(ch, c) for ch in inputs}
        top = max((max(i) for i in idx.values() if i), default=c - 1)
        if not inputs:  # a whole-pipeline unit fed by a data source: only META bounds it
            top = max((max(self.logs.index(Channel.meta(k), 0), default=-1) for k in range(S)), default=c - 1)
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
        found = self.logs.any_meta(it, u.stages, S)
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
        # the iterations examined: never past the first one not fully logged (a target far beyond the logs costs
        # nothing)
        stop = target
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
                mbs = self.logs.index(ch, c).get(it, {})
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
                f"the logs of [{c}, {newest}) were garbage-collected when stage(s) {u.stages} registered their "
                f"checkpoint at {newest}: a replay starts from it and reaches only iterations from {newest} on",
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
                f"target iteration {target} is beyond the logs: iterations [{stop}, {target}) are not logged (nor is "
                f"{stop - 1} completely)"
            )
        # META: the unit's own, else another stage's stands in (ascending schedules only)
        meta_chans: set[Channel] = set()
        for it in range(c, stop):
            own = [k for k in u.stages if it in self.logs.index(Channel.meta(k), 0)]
            meta_chans.update(Channel.meta(k) for k in own)
            found = None if own else self.logs.any_meta(it, u.stages, S)
            if found is not None:
                meta_chans.add(Channel.meta(found[0]))
                if not any("stands in" in w for w in u.warnings):
                    u.warnings.append(
                        f"no META of stages {u.stages} at iteration {it} (lost with their node?): stage {found[0]}'s "
                        "META stands in"
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
                        f"gap on {g['channel']}/it{g['iteration']}/mb{g['micro_batch']} ({g['reason']}): that send "
                        "cannot be verified"
                    )
        # verification: a digest of every boundary send (part 0 at least) of every micro-batch
        u.verifiable = bool(chans["verify"]) and all(
            all(mb in self.logs.index(ch, c).get(it, {}) for mb in range(n_mbs[it] or 0))
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
        fetch_items(
            self.logs,
            u,
            [(ch, "input") for ch in [*chans["inputs"], *reduced]]
            + [(ch, "meta") for ch in sorted(meta_chans)]
            + [(ch, "verify") for ch in chans["verify"]],
            c,
            stop,
            failed_writers,
        )
        if self.check_records and not u.reasons:
            check_records(
                self.logs, u, [*chans["inputs"], *reduced, *sorted(meta_chans), *chans["verify"]], c, stop
            )  # what the replay reads, all of it
        u.possible = not u.reasons
        estimate(
            u,
            S,
            bandwidth=self.bandwidth,
            replay_s=self.replay_s,
            workers=self.workers,
            metas=self.logs.metas,
            rates=self.rates,
        )

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
                calls = self.logs.own_meta(k, it, c).get("grad_reduce") or []
                if not calls:
                    continue
                if ch not in chans:
                    chans.append(ch)
                have = self.logs.index(ch, c).get(it, {})
                for call in range(len(calls)):
                    if call not in have:
                        first_missing = first_missing or _note_missing(u, ch, it, call, gap_index)
        if first_missing is not None:
            u.reasons.append(
                f"the reduced gradients of a stage's all_reduce_grads_ call are missing: first {first_missing} (a "
                "stage's own records outlive its node only in the run's cold tier)"
            )
        return chans

    def _where_checkpoints_are(self) -> str:
        """Where else a stage's checkpoint registration is, when the given stores have no cold tier."""
        if any(s.cold is not None for s in self.logs.stores):
            return ""
        return (
            " (a stage registers its checkpoints on its own node and in the run's cold tier: pass the cold tier, "
            "--cold-url, or that node's store root)"
        )

    def _fallback(self, ckpts: dict[int, dict[int, Any]], S: int, target: int | None) -> dict[str, Any]:
        sets = [set(ckpts.get(k, {})) for k in range(S)]
        common = set.intersection(*sets) if sets else set()
        if target is not None:
            common = {c for c in common if c <= target}
        if not common:
            unknown = [k for k in range(S) if not sets[k]]
            note = (
                f"the given stores register no checkpoint of stage(s) {unknown}{self._where_checkpoints_are()}; if "
                "none was ever made, restart the run from scratch"
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
