"""Recovery strategies as the simulation sees them: what they cost while training, and what one
incident costs them.

A :class:`Strategy` names its mechanisms (persistent checkpoints, in-memory checkpoints, copies
from live replicas, logging with replay and its logging groups). :func:`make_plan` turns it, a
layout and the inputs into a :class:`Plan`: checkpoint intervals, stalls, the training slowdown,
and :meth:`Plan.outcome`, the cost of one incident from the position in the interval it strikes.
The simulation engine and the interval search both call ``outcome``: one model of a recovery.

Rules (printed with every result, :func:`assumptions`):
- a global rollback restarts every process and loads the persistent checkpoint;
- an in-memory checkpoint (CheckFreq / Gemini-like) is a snapshot kept in a peer node's memory;
  every process restarts from it unless the incident also took the peer;
- a lost unit with a live replica is copied from it over the network (SWIFT's replica path);
- otherwise, with logging, the lost stage (with FSDP, its whole shard group) goes back to its
  checkpoint and replays the lost iterations from its neighbours' logs, K ways; the survivors
  keep their state; a logging group of G stages replays in place as a pipeline, (m + G - 1) / m
  of one stage's time; a boundary whose sender was lost too is read from the object store;
- the iteration in flight is lost by every strategy (the commit step aborts it).

Never: draws random numbers itself (the caller's generator draws incidents).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from replay.sim.inputs import Layout, ScaleInputs
from trainer_client.config import group_of

__all__ = ["Strategy", "Plan", "STRATEGIES", "make_plan", "assumptions"]


@dataclass(frozen=True)
class Strategy:
    """A recovery strategy: which mechanisms it uses."""

    name: str
    memory_checkpoints: bool = False
    replicas: bool = False
    logging: bool = False
    groups: bool = False  # logging groups chosen by the planner within the disk budget
    description: str = ""


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("global_rollback", description="persistent checkpoints at the best interval; every process restarts"),
    Strategy("in_memory", memory_checkpoints=True, description="CheckFreq / Gemini-like snapshots in a peer's memory"),
    Strategy("replica", replicas=True, description="copy a lost unit from a live replica; else roll back"),
    Strategy("logging", logging=True, description="every boundary logged; the lost stage replays K ways"),
    Strategy("logging_groups", logging=True, groups=True, description="logging groups the planner chooses"),
    Strategy(
        "combined",
        memory_checkpoints=True,
        replicas=True,
        logging=True,
        groups=True,
        description="replicas where they survive, else replay from the newest in-memory checkpoint",
    ),
)

_COMPONENTS = ("detection", "restart", "load", "copy", "replay")


@dataclass
class Plan:
    """A strategy made concrete for one layout and one set of inputs (all times in seconds).

    ``persistent_s`` / ``memory_s``: checkpoint intervals in failure-free training time
    (``memory_s`` None without in-memory checkpoints). ``persistent_stall_s`` / ``memory_stall_s``:
    what taking one stops training for. ``slowdown``: wall time per second of failure-free
    training (logging and the commit step). ``groups``: logging group sizes (None: nothing
    logged). ``notes``: how the plan was constrained."""

    strategy: Strategy
    layout: Layout
    inputs: ScaleInputs
    persistent_s: float
    memory_s: float | None = None
    groups: tuple[int, ...] | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        x, lay = self.inputs, self.layout
        state = x.node_state_bytes(lay)
        snap = state / x.snapshot_bps
        self.persistent_stall_s = snap + x.ckpt_sync_s
        self.memory_stall_s = snap
        self.min_persistent_s = state / x.ckpt_write_bps  # the previous one's upload must be done
        self.min_memory_s = state / x.net_bps
        commit = x.commit_s(lay) / x.iteration_s if (self.strategy.logging or self.strategy.replicas) else 0.0
        self.slowdown = (x.logging_overhead if self.strategy.logging else 1.0) + commit
        self.rate = x.incidents_per_s(lay)
        self.set_groups(self.groups)

    def set_groups(self, groups: tuple[int, ...] | None) -> None:
        """Log at the edges of these groups (None: nothing logged)."""
        self.groups = groups
        self._members = {p: group_of(groups, p, self.layout.pp) for p in range(self.layout.pp)}

    # -- one incident ---------------------------------------------------------------------------
    def incident_nodes(self, node: int, correlated: bool) -> set[int]:
        """The nodes one incident takes: the node, or its whole failure domain."""
        if not correlated:
            return {node}
        d = self.inputs.domain_nodes
        first = (node // d) * d
        return set(range(first, min(first + d, self.layout.nodes)))

    def outcome(self, failed: set[int], done: float, ck_p: float, ck_m: float) -> tuple[float, dict[str, float]]:
        """(where training resumes, in failure-free seconds; seconds per recovery component) for an
        incident taking ``failed`` nodes at ``done``, with the newest persistent checkpoint at
        ``ck_p`` and in-memory one at ``ck_m``."""
        x, s = self.inputs, self.strategy
        it = x.iteration_s
        at_iteration = math.floor(done / it + 1e-9) * it  # the iteration in flight is lost
        state = x.node_state_bytes(self.layout)
        units = set().union(*(_units_of(self.layout, n) for n in failed))
        memory_ok = s.memory_checkpoints and self.memory_s is not None and self._peers_survive(failed)
        rollback_to = max(ck_p, ck_m) if memory_ok else ck_p
        rollback = {
            "detection": x.detect_s,
            "restart": x.restart_job_s,
            "load": state / (x.net_bps if memory_ok else x.ckpt_read_bps),
        }
        copied = {u for u in units if s.replicas and self._replica_survives(u, units)}
        rest = units - copied
        if rest and not s.logging:
            return rollback_to, rollback
        cost = {"detection": x.detect_s, "restart": x.replace_node_s}
        if copied:
            cost["copy"] = state / x.net_bps
        if rest:
            replay = self._replay_s(rest, at_iteration - rollback_to)
            if replay is None:
                return rollback_to, rollback
            cost["replay"] = replay
            cost["load"] = state / (x.net_bps if memory_ok else x.ckpt_read_bps)
        return at_iteration, cost

    def _replay_s(self, lost: set[tuple[int, int, int]], span: float) -> float | None:
        """Seconds to replay ``span`` failure-free seconds of every lost unit (in parallel); None
        when a boundary's logs are gone (the sender lost and no object store)."""
        x, lay = self.inputs, self.layout
        m, iters = x.n_microbatches, span / x.iteration_s
        compute_one = x.iteration_s * x.replay_ratio(lay) / x.parallel_speedup(x.replay_workers)
        worst = 0.0
        for r, f, p in lost:
            members = self._members[p]
            cold = False
            for edge_sender in (members[0] - 1, members[-1] + 1):  # the group's edges come from the logs
                if 0 <= edge_sender < lay.pp and (r, f, edge_sender) in lost:
                    cold = True
            if cold and not x.cold_tier:
                return None
            per_it = compute_one * (m + len(members) - 1) / m
            edge_bytes = x.logged_bytes_per_node_iteration()
            fetch = edge_bytes / (x.cold_fetch_bps if cold else x.net_bps)
            worst = max(worst, iters * max(per_it, fetch))
        return worst

    def _replica_survives(self, unit: tuple[int, int, int], lost: set[tuple[int, int, int]]) -> bool:
        r, f, p = unit
        return any((q, f, p) not in lost for q in range(self.layout.dp_replicate) if q != r)

    def _peers_survive(self, failed: set[int]) -> bool:
        n = self.layout.nodes
        d = self.inputs.domain_nodes if self.inputs.memory_peer_other_domain else 1
        return all(((k + d) % n) not in failed for k in failed) if n > 1 else False


@functools.lru_cache(maxsize=65536)
def _units_of(layout: Layout, node: int) -> frozenset[tuple[int, int, int]]:
    return frozenset(layout.units_of_node(node))


def make_plan(
    strategy: Strategy,
    layout: Layout,
    inputs: ScaleInputs,
    persistent_s: float,
    memory_s: float | None = None,
    groups: Sequence[int] | None = None,
) -> Plan:
    """A :class:`Plan` (its intervals clamped to what the storage allows; the clamps are noted)."""
    plan = Plan(strategy, layout, inputs, persistent_s, memory_s if strategy.memory_checkpoints else None)
    plan.set_groups(tuple(groups) if groups else ((1,) * layout.pp if strategy.logging else None))
    if persistent_s < plan.min_persistent_s:
        plan.persistent_s = plan.min_persistent_s
        plan.notes.append(f"checkpoint interval raised to the upload time {plan.min_persistent_s:.0f} s")
    if plan.memory_s is not None and plan.memory_s < plan.min_memory_s:
        plan.memory_s = plan.min_memory_s
    if plan.memory_s is not None and plan.memory_s >= plan.persistent_s:
        plan.memory_s = None
    return plan


def assumptions(layout: Layout, inputs: ScaleInputs) -> dict[str, str]:
    """The rules the figures come from, with the derived values of this layout."""
    x = inputs
    state = x.node_state_bytes(layout)
    return {
        "node_state": f"params x bytes_per_param / nodes per replica = {state / 1e9:.2f} GB per node",
        "logged_per_node": "2 boundary sends (activation, gradient) x micro-batches / compression = "
        f"{x.logged_bytes_per_node_iteration() / 1e9:.2f} GB per iteration",
        "replay_ratio": f"m / (m + S - 1) / replay_efficiency = {x.replay_ratio(layout):.3f} of a live iteration",
        "parallel_replay": f"Amdahl with serial fraction {x.parallel_serial_fraction:.3f}: "
        f"K = {x.replay_workers} gives {x.parallel_speedup(x.replay_workers):.2f}x",
        "commit": f"nodes x commit_requests / store_requests_per_s = {x.commit_s(layout) * 1e3:.1f} ms per iteration",
        "incidents": f"{x.incidents_per_s(layout) * 3600:.3f} per hour ({layout.nodes} nodes), "
        f"{x.correlated_fraction:.0%} taking {x.domain_nodes} nodes",
        "checkpoint_stall": "node state / snapshot_bps (+ ckpt_sync_s for a persistent one); the next one waits "
        "for the upload (node state / ckpt_write_bps)",
        "placement": "TP innermost, then stage, shard, replica; a domain is consecutive nodes",
        "components": ", ".join(_COMPONENTS) + ", lost work, checkpoint stalls, logging overhead",
    }
