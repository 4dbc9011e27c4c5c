"""Choosing logging groups from measured costs: SWIFT's selective logging as an exact optimisation.

A grouping splits the S stages of a pipeline into consecutive groups, and only the boundaries
between groups are logged. Fewer groups store less but recover slower: a failure makes its whole
group replay from the checkpoint. :func:`plan_groups` takes a :class:`~replay.profile.JobProfile`
(what each boundary stores per iteration, what each stage costs to replay, the fetch rate, the
checkpoint interval, the failure domains and replicas) and a failure rate, and returns the
grouping with the least expected recovery time whose logs fit a storage budget.

The model (every figure from the profile; :attr:`GroupPlan.assumptions` repeats it):

- storage of a grouping: the checkpoint interval times the bytes stored per iteration at each
  logged boundary (activations one way, gradients the other). GC frees them at each checkpoint.
- a failure of domain n (a node) loses its stages. A lost stage with a replica in another domain
  is copied from it, whatever the grouping. Every group holding a lost stage without a replica
  restarts from the checkpoint and replays the iterations since, on average half an interval,
  reading the logged inputs at its two edges.
- a group's recovery time is ``restart_s + max(fetch, replay)``: the edges' records over the
  fetch rate, overlapped with the replay. ``recovery="kill"`` (how groups recover today: every
  member's replacement replays the whole group in one process) replays the sum of the members'
  replay times. ``recovery="in_place"`` (the members replay their own stages as a pipeline)
  replays the slowest member's time stretched by the pipeline's bubble,
  ``(m + G - 1) / m`` for G members and m micro-batches. When the stages share one machine
  (the profile's ``compute_slots``), a group is also no faster than its total replay work over
  the slots (kill: G replacements' work; in place: the members' work).
- expected recovery seconds per hour = the sum over groups of the group's recovery time times
  the failure rates of the domains holding one of its stages without a replica. A domain whose
  stages lie in two groups is charged for both (they recover in parallel): an upper bound there,
  exact when the groups follow domain boundaries.

The search is exact: the cost is a sum over groups and the storage a sum over cuts, so a dynamic
program over cut points that keeps, for every prefix, the Pareto set of (bytes, cost) finds the
optimum for any stage count. :func:`greedy_groups` is the SWIFT prototype's heuristic (one group
per domain, then merge the adjacent pair that adds the least expected time per byte saved until
the budget holds); the plan reports it beside the exact answer, with its gap.

Never: measures anything, or reads a store (that is ``replay.profile``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from replay.errors import BudgetTooSmallError
from replay.profile import JobProfile

__all__ = [
    "DEFAULT_FAILURES_PER_DOMAIN_HOUR",
    "RECOVERY_MODES",
    "GroupCosts",
    "GroupPlan",
    "greedy_groups",
    "least_storage",
    "optimal_groups",
    "plan_groups",
]

#: failures per node-hour of an 8-GPU node: 419 unexpected interruptions in 54 days on 16,384 GPUs
#: (Llama 3's report), a node being 8 of them
DEFAULT_FAILURES_PER_DOMAIN_HOUR = 8 * 419 / (54 * 24 * 16384)
RECOVERY_MODES = ("kill", "in_place")


@dataclass(frozen=True)
class GroupCosts:
    """The cost model of one profile, failure rate and recovery mode (module docstring)."""

    profile: JobProfile
    failures_per_domain_hour: float = DEFAULT_FAILURES_PER_DOMAIN_HOUR
    recovery: str = "kill"
    max_recovery_s: float | None = None  # a group slower than this to recover is not allowed

    def __post_init__(self) -> None:
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery must be one of {RECOVERY_MODES}, got {self.recovery!r}")
        if not self.failures_per_domain_hour > 0:
            raise ValueError(f"failures_per_domain_hour must be > 0, got {self.failures_per_domain_hour!r}")

    def cut_bytes(self, boundary: int) -> float:
        """Bytes logged over a checkpoint interval at ``boundary`` (between stages b and b + 1)."""
        p = self.profile
        return p.checkpoint_interval * (p.activation_bytes[boundary] + p.gradient_bytes[boundary])

    def recovery_s(self, first: int, last: int) -> float:
        """Seconds to recover the group of stages ``first..last`` from a failure inside it."""
        p = self.profile
        lost = p.checkpoint_interval / 2
        edge = (p.activation_bytes[first - 1] if first > 0 else 0.0) + (
            p.gradient_bytes[last] if last < p.num_stages - 1 else 0.0
        )
        fetch = lost * edge / (p.fetch_mbps * 1e6)
        times = p.replay_s[first : last + 1]
        n, slots = len(times), p.compute_slots or len(times)
        if self.recovery == "kill":  # n replacements, each replaying the n stages
            per_it = max(sum(times), n * sum(times) / slots)
        else:  # the members as a pipeline, no faster than their work over the machine's slots
            per_it = max(max(times) * (p.n_microbatches + n - 1) / p.n_microbatches, sum(times) / slots)
        return p.restart_s + max(fetch, lost * per_it)

    def rate(self, first: int, last: int) -> float:
        """Failures per hour that make the group ``first..last`` replay."""
        p = self.profile
        domains = {p.domains[k] for k in range(first, last + 1) if not p.replicated[k]}
        return self.failures_per_domain_hour * len(domains)

    def group_cost(self, first: int, last: int) -> float:
        """Expected recovery seconds per hour the group ``first..last`` contributes (infinite for
        a group over ``max_recovery_s``)."""
        rate = self.rate(first, last)
        if rate == 0:
            return 0.0
        t = self.recovery_s(first, last)
        return float("inf") if self.max_recovery_s is not None and t > self.max_recovery_s else rate * t

    def evaluate(self, sizes: Sequence[int]) -> tuple[float, float]:
        """(stored bytes per interval, expected recovery seconds per hour) of a grouping."""
        stored, cost, first = 0.0, 0.0, 0
        for size in sizes:
            last = first + size - 1
            cost += self.group_cost(first, last)
            if last < self.profile.num_stages - 1:
                stored += self.cut_bytes(last)
            first = last + 1
        return stored, cost

    def domain_bytes(self, sizes: Sequence[int]) -> dict[int, float]:
        """Bytes per interval each domain's stages log under a grouping (senders log)."""
        p = self.profile
        out = dict.fromkeys(p.domains, 0.0)
        for b in _cuts(sizes):
            out[p.domains[b]] += p.checkpoint_interval * p.activation_bytes[b]
            out[p.domains[b + 1]] += p.checkpoint_interval * p.gradient_bytes[b]
        return out


@dataclass(frozen=True)
class GroupPlan:
    """The chosen grouping and what it costs.

    ``sizes``: the group sizes (what ``ClientConfig.logging_groups`` takes; the client also takes
    the plan itself or its ``to_dict()``). ``stored_bytes``: logged over a checkpoint interval.
    ``expected_recovery_s_per_hour``: the objective. ``recovery_s``: each group's recovery time
    from a failure inside it. ``mean_recovery_s``: the expected time of one failure.
    ``greedy``: the SWIFT prototype's heuristic on the same inputs and its ``gap`` (relative
    excess of its objective over the optimum). ``all_logged``: every boundary logged.
    ``domain_bytes``: what each failure domain's stages log. ``warnings``: e.g. a domain over its
    disk share. ``assumptions``: the model and where each figure came from.
    """

    sizes: tuple[int, ...]
    stored_bytes: float
    budget_bytes: float
    expected_recovery_s_per_hour: float
    recovery_s: list[float]
    mean_recovery_s: float
    greedy: dict[str, Any]
    all_logged: dict[str, Any]
    domain_bytes: dict[int, float]
    recovery: str
    assumptions: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def groups(self) -> list[list[int]]:
        """The stages of each group."""
        return _groups(self.sizes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sizes"] = list(self.sizes)
        d["groups"] = self.groups
        d["domain_bytes"] = {str(k): v for k, v in self.domain_bytes.items()}
        return d


def optimal_groups(costs: GroupCosts, budget_bytes: float, *, min_groups: int = 2) -> tuple[int, ...] | None:
    """The grouping of least expected recovery time whose storage is at most ``budget_bytes``,
    with at least ``min_groups`` groups; None when none fits. Exact (module docstring)."""
    S = costs.profile.num_stages
    # front[i]: Pareto set over groupings of stages 0..i-1: (bytes, cost, groups, sizes), sorted by bytes
    front: list[list[tuple[float, float, int, tuple[int, ...]]]] = [[(0.0, 0.0, 0, ())]] + [[] for _ in range(S)]
    for i in range(1, S + 1):
        cands = []
        for j in range(i):
            g = costs.group_cost(j, i - 1)
            if g == float("inf"):
                continue
            cut = costs.cut_bytes(j - 1) if j > 0 else 0.0
            for b, c, n, sizes in front[j]:
                if b + cut <= budget_bytes:
                    cands.append((b + cut, c + g, n + 1, (*sizes, i - j)))
        front[i] = _pareto(cands, min_groups if i == S else 0)
    done = [x for x in front[S] if x[2] >= min_groups]
    if not done:
        return None
    return min(done, key=lambda x: (x[1], x[0], x[3]))[3]


def _pareto(
    cands: list[tuple[float, float, int, tuple[int, ...]]], min_groups: int
) -> list[tuple[float, float, int, tuple[int, ...]]]:
    """The candidates no other beats in both bytes and cost. The group count only matters for the
    last prefix (``min_groups``), where too few groups are kept apart from the rest."""
    out = []
    for enough in {x[2] >= min_groups for x in cands}:
        best = float("inf")
        for x in sorted((x for x in cands if (x[2] >= min_groups) == enough), key=lambda x: (x[0], x[1], x[3])):
            if x[1] < best:
                out.append(x)
                best = x[1]
    return out


def greedy_groups(costs: GroupCosts, budget_bytes: float) -> tuple[int, ...]:
    """The SWIFT prototype's heuristic: one group per run of stages in one domain, then merge the
    adjacent pair with the least added expected time per byte saved while over ``budget_bytes``
    (down to one group, which logs nothing)."""
    p = costs.profile
    sizes = [1]
    for k in range(1, p.num_stages):
        if p.domains[k] == p.domains[k - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    stored, cost = costs.evaluate(sizes)
    while stored > budget_bytes and len(sizes) > 1:
        best = None
        for i in range(len(sizes) - 1):
            merged = sizes[:i] + [sizes[i] + sizes[i + 1]] + sizes[i + 2 :]
            b, c = costs.evaluate(merged)
            score = (c - cost) / max(stored - b, 1e-9)
            if best is None or score < best[0]:
                best = (score, merged, b, c)
        assert best is not None
        _, sizes, stored, cost = best
    return tuple(sizes)


def plan_groups(
    profile: JobProfile,
    *,
    budget_bytes: float | None = None,
    budget_fraction: float | None = None,
    disk_fraction: float | None = None,
    disk_bytes: float | None = None,
    failures_per_domain_hour: float = DEFAULT_FAILURES_PER_DOMAIN_HOUR,
    recovery: str = "kill",
    max_recovery_s: float | None = None,
) -> GroupPlan:
    """Choose logging groups for ``profile`` within a storage budget (module docstring).

    The budget, over a checkpoint interval, is one of: ``budget_bytes``; ``budget_fraction`` of
    what logging every boundary stores; ``disk_fraction`` of each node's disk (``disk_bytes``),
    as a total over the domains (a domain beyond its share is named in ``warnings``).
    ``max_recovery_s``: no group may take longer to recover. Raises BudgetTooSmallError when no
    grouping that logs anything fits (it names the bytes the cheapest one needs), ValueError for
    inputs that make no sense.
    """
    costs = GroupCosts(profile, failures_per_domain_hour, recovery)
    S = profile.num_stages
    if S < 2:
        raise ValueError("a pipeline of one stage has no boundary to log")
    every = (1,) * S
    all_bytes, all_cost = costs.evaluate(every)
    n_domains = len(set(profile.domains))
    budget, per_domain = _budget(all_bytes, n_domains, budget_bytes, budget_fraction, disk_fraction, disk_bytes)
    if max_recovery_s is not None:
        costs = GroupCosts(profile, failures_per_domain_hour, recovery, max_recovery_s)
    sizes = optimal_groups(costs, budget)
    if sizes is None:
        least = least_storage(costs)
        need = None if least is None else least[0]
        raise BudgetTooSmallError(
            _too_small(profile, budget, least, max_recovery_s), budget_bytes=budget, needed_bytes=need
        )
    stored, cost = costs.evaluate(sizes)
    base = GroupCosts(profile, failures_per_domain_hour, recovery)
    greedy = greedy_groups(base, budget)
    g_bytes, g_cost = base.evaluate(greedy)
    rates = [costs.rate(g[0], g[-1]) for g in _groups(sizes)]
    times = [costs.recovery_s(g[0], g[-1]) for g in _groups(sizes)]
    domain_bytes = costs.domain_bytes(sizes)
    warnings = [
        f"domain {d} logs {b:.3g} bytes per interval, over its share {per_domain:.3g} ({disk_fraction} of its disk)"
        for d, b in domain_bytes.items()
        if per_domain is not None and b > per_domain
    ]
    return GroupPlan(
        sizes=sizes,
        stored_bytes=stored,
        budget_bytes=budget,
        expected_recovery_s_per_hour=cost,
        recovery_s=times,
        mean_recovery_s=cost / sum(rates) if sum(rates) > 0 else 0.0,
        greedy={
            "sizes": list(greedy),
            "stored_bytes": g_bytes,
            "expected_recovery_s_per_hour": g_cost,
            "within_budget": g_bytes <= budget,
            "gap": (g_cost - cost) / cost if cost > 0 else 0.0,
        },
        all_logged={"sizes": list(every), "stored_bytes": all_bytes, "expected_recovery_s_per_hour": all_cost},
        domain_bytes=domain_bytes,
        recovery=recovery,
        assumptions=_assumptions(profile, failures_per_domain_hour, recovery, max_recovery_s),
        warnings=warnings,
    )


def least_storage(costs: GroupCosts, *, min_groups: int = 2) -> tuple[float, tuple[int, ...]] | None:
    """The grouping of least storage with at least ``min_groups`` groups, each within the cost
    model's ``max_recovery_s``, and its bytes; None when there is none (a dynamic program)."""
    S = costs.profile.num_stages
    # best[i][n]: least bytes covering stages 0..i-1 with min(groups, min_groups) == n
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}] + [{} for _ in range(S)]
    for i in range(1, S + 1):
        for j in range(i):
            if costs.group_cost(j, i - 1) == float("inf"):
                continue
            cut = costs.cut_bytes(j - 1) if j > 0 else 0.0
            for n, (b, sizes) in best[j].items():
                m = min(n + 1, min_groups)
                if m not in best[i] or b + cut < best[i][m][0]:
                    best[i][m] = (b + cut, (*sizes, i - j))
    return best[S].get(min_groups)


def _budget(
    all_bytes: float,
    n_domains: int,
    budget_bytes: float | None,
    fraction: float | None,
    disk_fraction: float | None,
    disk_bytes: float | None,
) -> tuple[float, float | None]:
    given = [x is not None for x in (budget_bytes, fraction, disk_fraction)]
    if sum(given) != 1:
        raise ValueError("give exactly one budget: budget_bytes, budget_fraction or disk_fraction (with disk_bytes)")
    if budget_bytes is not None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
        return float(budget_bytes), None
    if fraction is not None:
        if not 0 <= fraction:
            raise ValueError(f"budget_fraction must be >= 0, got {fraction!r}")
        return fraction * all_bytes, None
    assert disk_fraction is not None
    if not 0 < disk_fraction <= 1 or disk_bytes is None or disk_bytes <= 0:
        raise ValueError(f"disk_fraction must be in (0, 1] with disk_bytes > 0, got {disk_fraction!r}, {disk_bytes!r}")
    per_domain = disk_fraction * disk_bytes
    return per_domain * n_domains, per_domain


def _too_small(
    profile: JobProfile, budget: float, least: tuple[float, tuple[int, ...]] | None, cap: float | None
) -> str:
    capped = f" with every group recovering within {cap} s" if cap is not None else ""
    if least is None:
        return f"no grouping of {profile.num_stages} stages{capped} exists, whatever the budget"
    return (
        f"the storage budget ({budget:.4g} bytes per checkpoint interval of {profile.checkpoint_interval} "
        f"iterations) is too small for any grouping that logs something{capped}: the cheapest, "
        f"{list(least[1])}, needs {least[0]:.4g} bytes"
    )


def _groups(sizes: Sequence[int]) -> list[list[int]]:
    out, first = [], 0
    for s in sizes:
        out.append(list(range(first, first + s)))
        first += s
    return out


def _cuts(sizes: Sequence[int]) -> list[int]:
    """The logged boundaries of a grouping (b: between stages b and b + 1)."""
    return [g[-1] for g in _groups(sizes)[:-1]]


def _assumptions(profile: JobProfile, rate: float, recovery: str, cap: float | None) -> dict[str, Any]:
    return {
        "storage": "checkpoint interval x bytes per iteration at each logged boundary (GC at every checkpoint)",
        "lost_iterations": f"half the checkpoint interval ({profile.checkpoint_interval / 2:g})",
        "recovery": {
            "kill": "every member's replacement replays the whole group: the sum of the members' replay times",
            "in_place": "members replay their own stages as a pipeline: the slowest x (m + G - 1) / m",
        }[recovery],
        "compute_slots": "every stage on its own device"
        if profile.compute_slots is None
        else f"the stages share {profile.compute_slots} compute slots: no group is faster than its work over them",
        "group_time": "restart_s + max(fetch of the edges' records, replay)",
        "failures_per_domain_hour": rate,
        "replicas": "a lost stage with a replica in another domain is copied, whatever the grouping",
        "max_recovery_s": cap,
        "profile_sources": dict(profile.sources),
    }
