"""A rank's place in a data-parallel x pipeline mesh, and what recovers each lost rank.

swiftlog owns a rank's identity: its mesh coordinate ``(stage, replica)``, never the global rank
a rendezvous handed out. The mesh has torchtitan's dimension names and order, ``pp`` outermost
then ``dp_replicate``, so the global rank of a coordinate is ``stage * dp_replicate + replica``
(with one replica it is the stage, as before meshes existed).

- :class:`MeshLayout`: the mesh's shape, and the maps between ranks and coordinates.
- :func:`build_mesh`: the ``DeviceMesh`` of a layout over the current default process group
  (``mesh["pp"]`` carries the pipeline's sends, ``mesh["dp_replicate"]`` the gradient average).
- :func:`recovery_paths`: for every lost rank, how it comes back: a copy from a live replica of
  its stage, or a replay from the logs when every replica of its stage was lost; and why.
- :func:`node_map` / :func:`exposed_stages`: which machine holds each rank, and the stages one
  machine's loss takes whole (every replica on it): only those need the logs; where there is
  none, logging can be switched off for the run (``ClientConfig.replica_logging``).

Never: creates the default process group (the caller, e.g. ``ResilientLoop.join``, does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DP_REPLICATE",
    "PP",
    "MeshCoord",
    "MeshLayout",
    "RankRecovery",
    "build_mesh",
    "check_groups",
    "exposed_stages",
    "mesh_groups",
    "node_map",
    "recovery_paths",
    "replica_run",
]

#: torchtitan's names of the mesh dimensions swiftlog uses
PP, DP_REPLICATE = "pp", "dp_replicate"


@dataclass(frozen=True, slots=True, order=True)
class MeshCoord:
    """A rank's coordinate: its pipeline stage and its data-parallel replica."""

    stage: int
    replica: int

    def __str__(self) -> str:
        return f"stage {self.stage} replica {self.replica}"


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """A ``pp`` x ``dp_replicate`` mesh: ``num_stages`` stages, each held by ``dp_replicate`` replicas."""

    num_stages: int
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("num_stages", "dp_replicate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MeshLayout.{name} must be an int >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.dp_replicate

    def rank(self, stage: int, replica: int = 0) -> int:
        """The global rank of ``(stage, replica)``; ValueError outside the mesh."""
        if not (0 <= stage < self.num_stages and 0 <= replica < self.dp_replicate):
            raise ValueError(f"({stage}, {replica}) is outside the {self.num_stages} x {self.dp_replicate} mesh")
        return stage * self.dp_replicate + replica

    def coord(self, rank: int) -> MeshCoord:
        """The coordinate of global rank ``rank``; ValueError outside the mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        return MeshCoord(rank // self.dp_replicate, rank % self.dp_replicate)

    def replicas_of(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` (its replicas, replica 0 first)."""
        return [self.rank(stage, r) for r in range(self.dp_replicate)]

    def pipeline_of(self, replica: int) -> list[int]:
        """The ranks of replica ``replica``'s pipeline, stage 0 first."""
        return [self.rank(k, replica) for k in range(self.num_stages)]

    def describe(self, rank: int) -> str:
        """``"rank 3 (stage 1 replica 1)"``, or ``"stage 1"`` in a mesh of one replica."""
        c = self.coord(rank)
        return f"stage {c.stage}" if self.dp_replicate == 1 else f"rank {rank} ({c})"


def replica_run(run_id: str, replica: int, dp_replicate: int) -> str:
    """The run replica ``replica``'s pipeline logs under: ``run_id`` with one replica, else
    ``f"{run_id}.dp{replica}"`` (replicas compute on different data: their sends differ)."""
    return run_id if dp_replicate == 1 else f"{run_id}.dp{replica}"


def build_mesh(layout: MeshLayout, device_type: str = "cpu") -> Any:
    """The ``DeviceMesh`` of ``layout`` over the current default process group, with the
    dimension names ``("pp", "dp_replicate")``. Every rank of the group must call it (it creates
    the sub-groups). Raises RuntimeError when the default group's size is not the layout's."""
    import torch  # here: a config (which uses the layout) imports no torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} ranks but the mesh "
            f"{layout.num_stages} x {layout.dp_replicate} needs {layout.world_size}"
        )
    ranks = torch.arange(layout.world_size).reshape(layout.num_stages, layout.dp_replicate)
    return DeviceMesh(device_type, ranks, mesh_dim_names=(PP, DP_REPLICATE))


def mesh_groups(mesh: Any, layout: MeshLayout, stage: int, replica: int) -> tuple[Any, Any]:
    """The ``pp`` group and (with replicas) the ``dp_replicate`` group of ``mesh`` for the rank at
    ``(stage, replica)``. Raises ValueError when the mesh has no ``pp`` dimension, or its sizes or
    this rank's coordinate are not the layout's."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if PP not in names:
        raise ValueError(f"the mesh has dimensions {names}, not {PP!r}")
    want = {PP: layout.num_stages, DP_REPLICATE: layout.dp_replicate}
    got = {PP: mesh[PP].size(), DP_REPLICATE: mesh[DP_REPLICATE].size() if DP_REPLICATE in names else 1}
    coord = mesh.get_coordinate()
    here = (coord[names.index(PP)], coord[names.index(DP_REPLICATE)] if DP_REPLICATE in names else 0)
    if got != want or here != (stage, replica):
        raise ValueError(
            f"the mesh is {got} with this rank at (stage, replica) {here}, "
            f"but the client is configured as {want} at {(stage, replica)}"
        )
    return mesh[PP].get_group(), mesh[DP_REPLICATE].get_group() if layout.dp_replicate > 1 else None


def check_groups(layout: MeshLayout, pp: Any, dp_replicate: Any) -> None:
    """ValueError when ``pp`` (None: the default group) or ``dp_replicate`` (needed with
    replicas) is not of the layout's size."""
    import torch.distributed as dist

    if pp is not None and dist.get_world_size(pp) != layout.num_stages:
        raise ValueError(f"the pp group has {dist.get_world_size(pp)} ranks, the pipeline {layout.num_stages} stages")
    if layout.dp_replicate > 1 and (dp_replicate is None or dist.get_world_size(dp_replicate) != layout.dp_replicate):
        size = "no group" if dp_replicate is None else f"{dist.get_world_size(dp_replicate)} ranks"
        raise ValueError(f"dp_replicate={layout.dp_replicate} but the replicas' group has {size}")


@dataclass(frozen=True, slots=True)
class RankRecovery:
    """How one lost rank comes back: ``path`` is ``"replica"`` (its state is copied from
    ``donor``, a live rank of the same stage) or ``"replay"`` (recomputed from its checkpoint and
    the logs, together with ``replay_group``: every lost replica of its stage). ``why`` says why."""

    rank: int
    stage: int
    replica: int
    path: str
    why: str
    donor: int | None = None
    replay_group: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def recovery_paths(layout: MeshLayout, lost: Iterable[int]) -> dict[int, RankRecovery]:
    """For every rank in ``lost``: copy from a live replica when its stage has one (the donor is
    the lowest live replica: every rank computes the same answer), else replay with the other
    lost replicas of its stage. Raises ValueError for a rank outside the mesh."""
    lost_set = sorted(set(lost))
    for r in lost_set:
        layout.coord(r)
    out: dict[int, RankRecovery] = {}
    for r in lost_set:
        c = layout.coord(r)
        live = [x for x in layout.replicas_of(c.stage) if x not in lost_set]
        if live:
            out[r] = RankRecovery(
                r,
                c.stage,
                c.replica,
                "replica",
                f"stage {c.stage} has {len(live)} live replica(s) ({', '.join(map(str, live))}): copy rank {live[0]}",
                donor=live[0],
            )
        else:
            group = tuple(layout.replicas_of(c.stage))
            why = f"every replica of stage {c.stage} was lost (ranks {', '.join(map(str, group))}): " + (
                "replay from the logs" if len(group) == 1 else "replay them together from their own logs"
            )
            out[r] = RankRecovery(r, c.stage, c.replica, "replay", why, replay_group=group)
    return out


def node_map(layout: MeshLayout, nodes: Mapping[int, str] | Mapping[str, str] | Sequence[str]) -> dict[int, str]:
    """Rank -> the machine (failure domain) it runs on, checked against the mesh: a list indexed
    by rank, or a mapping whose keys are ranks (ints or their strings, as JSON has them). Raises
    ValueError naming the ranks missing or outside the mesh, or a machine name that is not a
    non-empty string."""
    items = list(enumerate(nodes)) if isinstance(nodes, Sequence) and not isinstance(nodes, str) else None
    if items is None:
        if not isinstance(nodes, Mapping):
            raise ValueError(f"a node map is a list or a mapping rank -> machine, got {type(nodes).__name__}")
        try:
            items = [(int(k), v) for k, v in nodes.items()]
        except (TypeError, ValueError) as e:
            raise ValueError(f"a node map's keys are ranks: {e}") from None
    out = dict(items)
    missing = sorted(set(range(layout.world_size)) - set(out))
    outside = sorted(set(out) - set(range(layout.world_size)))
    bad = sorted(r for r, v in out.items() if not isinstance(v, str) or not v)
    if missing or outside or bad:
        raise ValueError(
            f"node map of the {layout.num_stages} x {layout.dp_replicate} mesh: "
            + "; ".join(
                part
                for part in (
                    f"ranks {missing} missing" if missing else "",
                    f"ranks {outside} outside it" if outside else "",
                    f"ranks {bad} without a machine name" if bad else "",
                )
                if part
            )
        )
    return out


def exposed_stages(layout: MeshLayout, nodes: Mapping[int, str]) -> dict[int, list[str]]:
    """Stage -> the machines holding its replicas, for every stage that one machine's loss takes
    whole (all its replicas on one machine). Empty: no single failure leaves a stage without a live
    replica, so every single failure is healed by a copy and the logs serve only double failures."""
    out: dict[int, list[str]] = {}
    for k in range(layout.num_stages):
        machines = sorted({nodes[r] for r in layout.replicas_of(k)})
        if len(machines) == 1:
            out[k] = machines
    return out
