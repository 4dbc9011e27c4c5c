"""Whether a run with data-parallel replicas needs its logs, and what switching them off saves.

With replicas, a single failure is healed by a copy from a live replica of the lost rank's
stage; the logs serve only when every replica of a stage is lost at once. Where the node map
shows that no machine holds every replica of a stage (``trainer_client.mesh.exposed_stages``),
no single machine's loss needs them, and the run can log nothing
(``ClientConfig(replica_logging="when_exposed")``). :func:`plan_replica_logging` says so and
prices it from what the run's stores hold: the bytes logged per iteration (what switching off
saves), and the checkpoint interval (what a double failure would then cost: a rollback of every
rank by up to that many iterations, instead of a replay of the lost stage's replicas).

Never: writes anything; lists more than the stores' statistics and registrations.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer_client.mesh import MeshLayout, exposed_stages, node_map

__all__ = ["ReplicaLoggingPlan", "plan_replica_logging"]


@dataclass(slots=True)
class ReplicaLoggingPlan:
    """What :func:`plan_replica_logging` found. ``machines``: stage -> the machines holding its
    replicas; ``exposed``: the stages one machine's loss takes whole; ``logging_needed``: some
    stage is exposed; ``stored_bytes_per_iteration`` / ``raw_bytes_per_iteration``: what the
    replicas' logs take per iteration (None without a store that holds some); ``checkpoint_interval``:
    iterations between the run's checkpoints (None with fewer than two)."""

    num_stages: int
    dp_replicate: int
    machines: dict[int, list[str]]
    exposed: dict[int, list[str]]
    logging_needed: bool
    why: str
    stored_bytes_per_iteration: float | None = None
    raw_bytes_per_iteration: float | None = None
    iterations_measured: int = 0
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_interval: int | None = None
    double_failure: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_replica_logging(
    layout: MeshLayout,
    nodes: Mapping[Any, str] | Sequence[str],
    stores: Sequence[Any] = (),
) -> ReplicaLoggingPlan:
    """The logging assessment of ``layout`` under the node map ``nodes`` (rank -> machine).
    ``stores``: the replicas' log stores (``LogStore`` of each ``{run}.dp{r}``) to measure the
    logs from; none: the assessment alone. Raises ValueError for a node map that does not fit."""
    nodes = node_map(layout, nodes)
    machines = {k: sorted({nodes[r] for r in layout.replicas_of(k)}) for k in range(layout.num_stages)}
    exposed = exposed_stages(layout, nodes)
    if layout.dp_replicate < 2:
        why = "one replica: every failure is replayed from the logs"
    elif exposed:
        why = "one machine holds every replica of stage(s) " + ", ".join(
            f"{k} ({v[0]})" for k, v in sorted(exposed.items())
        )
    else:
        why = "every stage has replicas on two or more machines: any one machine's loss is healed by a copy"
    plan = ReplicaLoggingPlan(
        layout.num_stages,
        layout.dp_replicate,
        machines,
        exposed,
        bool(exposed) or layout.dp_replicate < 2,
        why,
    )
    _measure(plan, stores)
    interval = f"{plan.checkpoint_interval} iterations" if plan.checkpoint_interval else "the checkpoint interval"
    plan.double_failure = (
        f"losing every replica of a stage at once: with logs, its replicas are replayed from their checkpoint; "
        f"without, every rank rolls back to the newest checkpoint all have and recomputes up to {interval}"
    )
    return plan


def _measure(plan: ReplicaLoggingPlan, stores: Sequence[Any]) -> None:
    """Bytes per iteration over every channel of every store (the tier that holds more records of
    a channel: a segment uploaded is in both), and the registered checkpoints' iterations."""
    stored = raw = 0.0
    spans: list[int] = []
    its: set[int] = set()
    for st in stores:
        s = st.stats()
        for ch in (s.get("channels") or {}).values():
            tiers = [t for t in (ch.get("hot"), ch.get("cold")) if t and t.get("records")]
            if not tiers:
                continue
            t = max(tiers, key=lambda x: x["records"])
            n = t["hi"] - t["lo"] + 1
            stored += t["stored_bytes"] / n
            raw += t["raw_bytes"] / n
            spans.append(n)
        its |= {c.iteration for c in st.checkpoints()}
    if spans:
        plan.stored_bytes_per_iteration, plan.raw_bytes_per_iteration = stored, raw
        plan.iterations_measured = max(spans)
    plan.checkpoints = sorted(its)
    gaps = [b - a for a, b in zip(plan.checkpoints, plan.checkpoints[1:], strict=False) if b > a]
    plan.checkpoint_interval = int(statistics.median(gaps)) if gaps else None
