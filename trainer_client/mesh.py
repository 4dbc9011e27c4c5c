"""A rank's place in a data-parallel x pipeline mesh, and what recovers each lost rank.

swiftlog owns a rank's identity: its mesh coordinate ``(stage, replica, shard)``, never the global
rank a rendezvous handed out. The mesh has torchtitan's dimension names and order, ``pp``
outermost, then ``dp_replicate``, then ``dp_shard``, so the global rank of a coordinate is
``(stage * dp_replicate + replica) * dp_shard + shard`` (with one replica and one shard it is the
stage, as before meshes existed). Every ``(replica, shard)`` pair is one data-parallel pipeline.

- :class:`MeshLayout`: the mesh's shape, and the maps between ranks and coordinates.
- :func:`build_mesh`: the ``DeviceMesh`` of a layout over the current default process group
  (``mesh["pp"]`` carries the pipeline's sends, ``mesh["dp_replicate"]`` the gradient average,
  ``mesh["dp_shard"]`` FSDP's all-gathers and reduce-scatters).
- :func:`recovery_paths`: for every lost rank, how it comes back: a copy from a live replica of
  its shard of its stage, a replay from the logs when every replica of it was lost, and with
  sharding a replay of the whole shard group (the live members in place); and why.
- :func:`rank_stages` / :func:`stage_position`: which pipeline stages a rank holds in a schedule
  with several stages per rank (torch's "loop" and "v" styles), and the rank of a stage.
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
    "DP_SHARD",
    "PP",
    "MeshCoord",
    "MeshLayout",
    "RankRecovery",
    "build_mesh",
    "check_groups",
    "exposed_stages",
    "mesh_groups",
    "node_map",
    "rank_stages",
    "stage_position",
    "recovery_paths",
    "replica_run",
]

#: torchtitan's names of the mesh dimensions swiftlog uses
PP, DP_REPLICATE, DP_SHARD = "pp", "dp_replicate", "dp_shard"
#: how a multi-stage schedule places stages on ranks (torch's ``generate_stage_to_rank_mapping``)
STAGE_STYLES = ("loop", "v")


def rank_stages(position: int, num_ranks: int, stages_per_rank: int = 1, style: str = "loop") -> tuple[int, ...]:
    """The pipeline stages that the rank at ``position`` of the ``pp`` dimension holds, ascending.

    "loop" (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble): stages ``position + i * num_ranks``.
    "v" (ZBVZeroBubble, DualPipeV): the stages zigzag, ``position + i * num_ranks`` for even
    ``i`` and ``(i + 1) * num_ranks - 1 - position`` for odd ``i``; with two stages per rank the last
    rank holds the two middle stages. Raises ValueError for anything else.
    """
    if style not in STAGE_STYLES:
        raise ValueError(f"stage style must be one of {STAGE_STYLES}, got {style!r}")
    if not 0 <= position < num_ranks or stages_per_rank < 1:
        raise ValueError(f"position {position} of {num_ranks} ranks with {stages_per_rank} stage(s) each")
    if style == "v":
        return tuple(
            position + i * num_ranks if i % 2 == 0 else (i + 1) * num_ranks - 1 - position
            for i in range(stages_per_rank)
        )
    return tuple(position + i * num_ranks for i in range(stages_per_rank))


def stage_position(stage: int, num_ranks: int, stages_per_rank: int = 1, style: str = "loop") -> int:
    """The ``pp`` position of the rank that holds pipeline ``stage`` (see :func:`rank_stages`)."""
    for position in range(num_ranks):
        if stage in rank_stages(position, num_ranks, stages_per_rank, style):
            return position
    raise ValueError(f"stage {stage} is not in a pipeline of {num_ranks * stages_per_rank} stages")


@dataclass(frozen=True, slots=True, order=True)
class MeshCoord:
    """A rank's coordinate: its pipeline stage, its data-parallel replica and its shard."""

    stage: int
    replica: int
    shard: int = 0

    def __str__(self) -> str:
        return f"stage {self.stage} replica {self.replica}" + (f" shard {self.shard}" if self.shard else "")


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """A ``pp`` x ``dp_replicate`` x ``dp_shard`` mesh: ``num_stages`` stages, each held by
    ``dp_replicate`` replicas of ``dp_shard`` shards (FSDP's shard group)."""

    num_stages: int
    dp_replicate: int = 1
    dp_shard: int = 1

    def __post_init__(self) -> None:
        for name in ("num_stages", "dp_replicate", "dp_shard"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MeshLayout.{name} must be an int >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.dp_replicate * self.dp_shard

    @property
    def dp_size(self) -> int:
        """How many data-parallel pipelines the mesh runs: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    def shape(self) -> str:
        """``"2 x 2"`` or, with shards, ``"2 x 1 x 3"`` (pp x dp_replicate x dp_shard)."""
        dims = [self.num_stages, self.dp_replicate] + ([self.dp_shard] if self.dp_shard > 1 else [])
        return " x ".join(map(str, dims))

    def rank(self, stage: int, replica: int = 0, shard: int = 0) -> int:
        """The global rank of ``(stage, replica, shard)``; ValueError outside the mesh."""
        if not (0 <= stage < self.num_stages and 0 <= replica < self.dp_replicate and 0 <= shard < self.dp_shard):
            raise ValueError(f"({stage}, {replica}, {shard}) is outside the {self.shape()} mesh")
        return (stage * self.dp_replicate + replica) * self.dp_shard + shard

    def coord(self, rank: int) -> MeshCoord:
        """The coordinate of global rank ``rank``; ValueError outside the mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        rest, shard = divmod(rank, self.dp_shard)
        return MeshCoord(rest // self.dp_replicate, rest % self.dp_replicate, shard)

    def dp_index(self, rank: int) -> int:
        """The data-parallel pipeline ``rank`` belongs to: ``replica * dp_shard + shard``."""
        c = self.coord(rank)
        return c.replica * self.dp_shard + c.shard

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank holding (a part of) ``stage``, in rank order."""
        return [self.rank(stage, r, s) for r in range(self.dp_replicate) for s in range(self.dp_shard)]

    def replicas_of(self, stage: int, shard: int = 0) -> list[int]:
        """The ranks holding shard ``shard`` of ``stage`` (its replicas, replica 0 first)."""
        return [self.rank(stage, r, shard) for r in range(self.dp_replicate)]

    def shard_group(self, stage: int, replica: int = 0) -> list[int]:
        """The ranks sharding ``stage`` in replica ``replica`` (FSDP's group), shard 0 first."""
        return [self.rank(stage, replica, s) for s in range(self.dp_shard)]

    def pipeline_of(self, replica: int, shard: int = 0) -> list[int]:
        """The ranks of the pipeline of ``(replica, shard)``, stage 0 first."""
        return [self.rank(k, replica, shard) for k in range(self.num_stages)]

    def log_run(self, run_id: str, rank: int) -> str:
        """The run ``rank``'s pipeline logs under (:func:`replica_run` of its data-parallel index)."""
        return replica_run(run_id, self.dp_index(rank), self.dp_size)

    def describe(self, rank: int) -> str:
        """``"rank 3 (stage 1 replica 1)"``, or ``"stage 1"`` in a mesh of one pipeline."""
        c = self.coord(rank)
        if self.dp_size == 1:
            return f"stage {c.stage}"
        return f"rank {rank} (stage {c.stage} replica {c.replica}" + (
            f" shard {c.shard})" if self.dp_shard > 1 else ")"
        )


def replica_run(run_id: str, replica: int, dp_replicate: int) -> str:
    """The run replica ``replica``'s pipeline logs under: ``run_id`` with one replica, else
    ``f"{run_id}.dp{replica}"`` (replicas compute on different data: their sends differ)."""
    return run_id if dp_replicate == 1 else f"{run_id}.dp{replica}"


def build_mesh(layout: MeshLayout, device_type: str = "cpu") -> Any:
    """The ``DeviceMesh`` of ``layout`` over the current default process group, with the
    dimension names ``("pp", "dp_replicate")``, and ``"dp_shard"`` last when the layout shards.
    Every rank of the group must call it (it creates the sub-groups). Raises RuntimeError when the
    default group's size is not the layout's."""
    import torch  # here: a config (which uses the layout) imports no torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} ranks "
            f"but the mesh {layout.shape()} needs {layout.world_size}"
        )
    if layout.dp_shard == 1:
        ranks = torch.arange(layout.world_size).reshape(layout.num_stages, layout.dp_replicate)
        return DeviceMesh(device_type, ranks, mesh_dim_names=(PP, DP_REPLICATE))
    ranks = torch.arange(layout.world_size).reshape(layout.num_stages, layout.dp_replicate, layout.dp_shard)
    return DeviceMesh(device_type, ranks, mesh_dim_names=(PP, DP_REPLICATE, DP_SHARD))


def mesh_groups(mesh: Any, layout: MeshLayout, stage: int, replica: int, shard: int = 0) -> tuple[Any, Any, Any]:
    """The ``pp`` group, the ``dp_replicate`` group (None without replicas) and the ``dp_shard``
    group (None without shards) of ``mesh`` for the rank at ``(stage, replica, shard)``. Raises
    ValueError when the mesh has no ``pp`` dimension, or its sizes or this rank's coordinate are
    not the layout's."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if PP not in names:
        raise ValueError(f"the mesh has dimensions {names}, not {PP!r}")
    dims = (PP, DP_REPLICATE, DP_SHARD)
    want = dict(zip(dims, (layout.num_stages, layout.dp_replicate, layout.dp_shard), strict=True))
    got = {d: mesh[d].size() if d in names else 1 for d in dims}
    coord = mesh.get_coordinate()
    here = tuple(coord[names.index(d)] if d in names else 0 for d in dims)
    if got != want or here != (stage, replica, shard):
        raise ValueError(
            f"the mesh is {got} with this rank at (stage, replica, shard) {here}, "
            f"but the client is configured as {want} at {(stage, replica, shard)}"
        )
    return (
        mesh[PP].get_group(),
        mesh[DP_REPLICATE].get_group() if layout.dp_replicate > 1 else None,
        mesh[DP_SHARD].get_group() if layout.dp_shard > 1 else None,
    )


def check_groups(layout: MeshLayout, pp: Any, dp_replicate: Any, dp_shard: Any = None) -> None:
    """ValueError when ``pp`` (None: the default group), ``dp_replicate`` (needed with replicas)
    or ``dp_shard`` (needed with shards) is not of the layout's size."""
    import torch.distributed as dist

    if pp is not None and dist.get_world_size(pp) != layout.num_stages:
        raise ValueError(f"the pp group has {dist.get_world_size(pp)} ranks, the pipeline {layout.num_stages} stages")
    for name, want, group in (
        ("dp_replicate", layout.dp_replicate, dp_replicate),
        ("dp_shard", layout.dp_shard, dp_shard),
    ):
        if want > 1 and (group is None or dist.get_world_size(group) != want):
            size = "no group" if group is None else f"{dist.get_world_size(group)} ranks"
            raise ValueError(f"{name}={want} but the {name} group has {size}")


@dataclass(frozen=True, slots=True)
class RankRecovery:
    """How one lost rank comes back. ``path``:

    - ``"replica"``: its state is copied from ``donor``, a live replica of its shard of its stage;
    - ``"replay"``: recomputed from its checkpoint and the logs together with ``replay_group``,
      every lost replica of its stage (all replacements);
    - ``"shard"``: its whole shard group (``replay_group``, FSDP's group of its stage in its
      replica) goes back to its checkpoint and replays together, the live members in their own
      processes (``in_place``), the lost ones in their replacements.

    ``why`` says why."""

    rank: int
    stage: int
    replica: int
    path: str
    why: str
    donor: int | None = None
    replay_group: tuple[int, ...] = ()
    shard: int = 0
    in_place: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def recovery_paths(layout: MeshLayout, lost: Iterable[int]) -> dict[int, RankRecovery]:
    """For every rank in ``lost``: copy from a live replica when its shard of its stage has one
    (the donor is the lowest live replica: every rank computes the same answer); else, without
    sharding, replay with the other lost replicas of its stage; with sharding, replay its shard
    group with the group's live members. Raises ValueError for a rank outside the mesh, and for
    a sharded stage whose lost shards have no replica in several replicas at once (HSDP with a
    shard lost in every replica: its replay would have to repeat the average across shard groups,
    which is not built)."""
    lost_set = sorted(set(lost))
    for r in lost_set:
        layout.coord(r)
    out: dict[int, RankRecovery] = {}
    for r in lost_set:
        c = layout.coord(r)
        live = [x for x in layout.replicas_of(c.stage, c.shard) if x not in lost_set]
        what = f"stage {c.stage}" + (f" shard {c.shard}" if layout.dp_shard > 1 else "")
        if live:
            out[r] = RankRecovery(
                r,
                c.stage,
                c.replica,
                "replica",
                f"{what} has {len(live)} live replica(s) ({', '.join(map(str, live))}): copy rank {live[0]}",
                donor=live[0],
                shard=c.shard,
            )
        elif layout.dp_shard == 1:
            group = tuple(layout.replicas_of(c.stage))
            why = f"every replica of stage {c.stage} was lost (ranks {', '.join(map(str, group))}): " + (
                "replay from the logs" if len(group) == 1 else "replay them together from their own logs"
            )
            out[r] = RankRecovery(r, c.stage, c.replica, "replay", why, replay_group=group)
        else:
            if layout.dp_replicate > 1:
                raise ValueError(
                    f"{what} was lost in every replica: replaying several shard groups of one stage together "
                    "(HSDP without a replica) is not supported: roll back"
                )
            group = tuple(layout.shard_group(c.stage, c.replica))
            in_place = tuple(x for x in group if x not in lost_set)
            why = (
                f"{what} has no replica: its shard group (ranks {', '.join(map(str, group))}) replays from its "
                f"checkpoint and its pipelines' logs"
                + (f", ranks {', '.join(map(str, in_place))} in place" if in_place else "")
            )
            out[r] = RankRecovery(
                r, c.stage, c.replica, "shard", why, replay_group=group, shard=c.shard, in_place=in_place
            )
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
            f"node map of the {layout.shape()} mesh: "
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
    """Stage -> the machines holding its replicas, for every stage of which one machine's loss
    takes a shard whole (all its replicas on one machine). Empty: no single failure leaves a shard
    without a live replica, so every single failure is healed by a copy and the logs serve only
    double failures."""
    out: dict[int, list[str]] = {}
    for k in range(layout.num_stages):
        for s in range(layout.dp_shard):
            machines = sorted({nodes[r] for r in layout.replicas_of(k, s)})
            if len(machines) == 1:
                out[k] = sorted(set(out.get(k, [])) | set(machines))
    return out
