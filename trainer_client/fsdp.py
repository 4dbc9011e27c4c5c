"""FSDP2 (``fully_shard``) stages under swiftlog: process groups swapped underneath, and what a
replay repeats of FSDP's work.

A recovery replaces every process group, but ``fully_shard`` binds its shard group when the module
is wrapped: its ``DeviceMesh`` names the group, and FSDP's mesh information keeps the group
object. :func:`rebind` points both at a new group of the same members in the same order, so a
surviving rank keeps its module, its parameters (sharded DTensors) and its optimizer state (DTensors
on the same mesh object) across generations. A DeviceMesh's identity is its ranks, shape and
names, never its groups, so DTensors made before and after a rebind still compute together.

What torch's pipeline schedules do with an FSDP stage, and a replay must do alike:

1. every micro-batch's backward runs without gradient sync (:func:`backward_without_sync`): the
   unsharded gradients accumulate locally;
2. after the last backward, one reduce-scatter per parameter group (:func:`reduce_gradients`,
   torch's ``perform_reduce_grad``), then the scale by the number of micro-batches.

Same participants, same order, same inputs: the same bits, in the live run and in a replay.

:func:`discard_unfinished` resets what an iteration abandoned midway leaves in FSDP (unsharded
parameters, gradients accumulated for a reduce-scatter that never ran).

Never: wraps or unwraps a module; changes a parameter's value.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate  # loaded with torch's pipelining anyway

__all__ = [
    "backward_without_sync",
    "clip_grads_with_norm_",
    "discard_unfinished",
    "fsdp_modules",
    "full_value",
    "is_sharded",
    "local_state",
    "local_tensor",
    "reshard_optimizer_state_",
    "rebind",
    "release",
    "reduce_gradients",
    "shard_mesh",
]


def fsdp_modules(module: torch.nn.Module) -> Iterator[Any]:
    """The ``fully_shard``-ed modules of ``module`` (itself included), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return (m for m in module.modules() if isinstance(m, FSDPModule))


def is_sharded(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` or one of its submodules is ``fully_shard``-ed."""
    return module is not None and next(fsdp_modules(module), None) is not None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a view: writing to it writes the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value as a plain tensor (a collective over its mesh: every member calls
    it), e.g. the norm of sharded gradients; any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grads_with_norm_(
    parameters: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None
) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``, also for sharded (DTensor) gradients: a plain
    ``total`` becomes a replicated DTensor on their mesh (torch refuses to mix the two). The same
    arithmetic on every shard, so the same bits as the unsharded clip's."""
    sharded = next((p.grad for p in parameters if isinstance(p.grad, DTensor)), None)
    if sharded is not None and not isinstance(total, DTensor):
        mesh = sharded.device_mesh
        total = DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)


def local_state(state: Any) -> Any:
    """``state`` (nested dicts and lists, e.g. a state dict) with every DTensor replaced by its
    local part: what this rank holds, to send or save. Other values are kept as they are."""
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_state(v) for v in state]
    return local_tensor(state) if isinstance(state, torch.Tensor) else state


def reshard_optimizer_state_(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of a :func:`local_state`: every state tensor shaped like
    its parameter's local shard becomes a DTensor laid out as that parameter (an optimizer step
    mixes no plain tensor with a DTensor). Scalars (``step``) stay as they are."""
    for p, st in optimizer.state.items():
        if not isinstance(p, DTensor):
            continue
        local = p.to_local()
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == local.shape and v.dim() > 0:
                st[k] = DTensor.from_local(
                    v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )


def shard_mesh(ranks: Sequence[int], group: dist.ProcessGroup, rank: int, device_type: str = "cpu") -> Any:
    """A one-dimensional ``DeviceMesh`` named ``"dp_shard"`` over ``group``, whose ranks are the
    mesh's global ``ranks`` (stable across generations), this process being ``rank``: the mesh to
    give ``fully_shard``. Raises ValueError when ``rank`` is not among ``ranks`` or the group's
    size is not theirs."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = [int(r) for r in ranks]
    if rank not in ranks or dist.get_world_size(group) != len(ranks):
        raise ValueError(
            f"rank {rank} with a group of {dist.get_world_size(group)} ranks cannot shard over ranks {ranks}"
        )
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("dp_shard",), _init_backend=False, _rank=rank)
    _point(mesh, group)
    return mesh


def rebind(module: torch.nn.Module, group: dist.ProcessGroup) -> int:
    """Point every FSDP state of ``module`` at ``group``: its mesh (the same object, so every
    DTensor on it follows) and FSDP's cached shard group and rank. ``group`` has the members of the
    old one, in the same order. Returns how many meshes were rebound (0: nothing is sharded).
    Raises ValueError when a mesh is not one-dimensional or the group's size is not the mesh's."""
    meshes: dict[int, Any] = {}
    infos: dict[int, Any] = {}
    for m in fsdp_modules(module):
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            for info in (pg.mesh_info, pg.post_forward_mesh_info):
                if info is not None:
                    infos[id(info)] = info
                    meshes[id(info.mesh)] = info.mesh
    for mesh in meshes.values():
        if mesh.ndim != 1 or mesh.size() != dist.get_world_size(group):
            raise ValueError(
                f"FSDP mesh {mesh} cannot move to a group of {dist.get_world_size(group)} ranks: swiftlog shards "
                "over one dimension (dp_shard) of the mesh's size"
            )
        _point(mesh, group)
    for info in infos.values():
        info.__post_init__()  # FSDP's shard group, its size and this rank's place in it, read again
    return len(meshes)


def release(module: torch.nn.Module) -> None:
    """Drop every reference ``module``'s FSDP states hold to their process group (after a
    failure): a gloo group's sockets close only when its last reference is gone, and until then a
    peer blocked on this rank waits. :func:`rebind` gives the next generation's."""
    for m in fsdp_modules(module):
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            for info in (pg.mesh_info, pg.post_forward_mesh_info):
                if info is None:
                    continue
                info.mesh._pg_registry.clear()
                for name in ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group"):
                    if hasattr(info, name):
                        setattr(info, name, None)


def _point(mesh: Any, group: dist.ProcessGroup) -> None:
    mesh._dim_group_names = [group.group_name]
    mesh._pg_registry[group.group_name] = group


def backward_without_sync(module: torch.nn.Module) -> None:
    """Before a micro-batch's backward: accumulate unsharded gradients, no reduce-scatter (what
    torch's schedules set for every micro-batch of an FSDP stage)."""
    for m in _roots(module):
        m.set_is_last_backward(False)
        m.set_reshard_after_backward(False)
        m.set_requires_gradient_sync(False)


def reduce_gradients(module: torch.nn.Module) -> None:
    """After the last micro-batch's backward: reduce-scatter the accumulated gradients into the
    sharded ones, as torch's schedules do (``perform_reduce_grad``). A collective over the shard
    group: every member calls it."""
    from torch.distributed.fsdp import fully_shard

    for m in _roots(module):
        m.set_is_last_backward(True)
        m.set_reshard_after_backward(True)
        m.set_requires_gradient_sync(True)
        state = fully_shard.state(m)
        for st in state._state_ctx.all_states:
            for pg in st._fsdp_param_groups:
                pg.post_backward()
        state._root_post_backward_final_callback()


def discard_unfinished(module: torch.nn.Module) -> None:
    """After an iteration abandoned midway (a peer died in a forward, a backward or a collective):
    forget FSDP's pending collectives, reshard the parameters, and drop every gradient FSDP holds,
    sharded or accumulated unsharded for a reduce-scatter that never ran."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for m in fsdp_modules(module):
        state = m._get_fsdp_state()
        state._training_state = TrainingState.IDLE  # PRE_BACKWARD would skip the next forward's all-gather
        state._comm_ctx.all_gather_state = None
        state._comm_ctx.reduce_scatter_states.clear()
        state._state_ctx.post_backward_final_callback_queued = False
        for pg in state._fsdp_param_groups:
            pg._all_gather_result = None  # a collective of the failed group: never waited on
            pg._post_reduce_event = None
            pg._all_reduce_state = None
            pg._partial_reduce_output = None
            pg._post_forward_indices.clear()
            pg._training_state = TrainingState.IDLE
            for fp in pg.fsdp_params:
                fp.unsharded_accumulated_grad = None
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
        m.reshard()
        for p in m.parameters():
            p.grad = None


def _roots(module: torch.nn.Module) -> list[Any]:
    """The outermost FSDP modules of ``module`` (the schedule sets its flags on the stage's module,
    which FSDP passes down to the states it holds)."""
    out: list[Any] = []
    for m in fsdp_modules(module):
        if not any(m in r.modules() for r in out):
            out.append(m)
    return out
