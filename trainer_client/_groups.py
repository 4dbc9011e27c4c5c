"""The process groups of one generation that a client computes over.

:class:`MeshGroups` holds them: ``pp`` (the pipeline's sends), ``dp_replicate`` (the replicas'
gradient average) and ``dp_shard`` (FSDP's shard group), taken from a generation's mesh or given
directly, checked against the config's layout, and forgotten after a failure so the failed
groups' connections close. A ``fully_shard``-ed stage is rebound to the current shard group
(:meth:`MeshGroups.bind`).

Never: creates a process group; keeps a group after :meth:`MeshGroups.release`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from logstore.errors import ConfigError
from trainer_client import fsdp
from trainer_client.config import ClientConfig
from trainer_client.mesh import check_groups, mesh_groups

__all__ = ["MeshGroups"]


class MeshGroups:
    """The ``pp``, ``dp_replicate`` and ``dp_shard`` groups of the current generation (None: not
    set, or not needed by the config's layout)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.pp: dist.ProcessGroup | None = None
        self.dp_replicate: dist.ProcessGroup | None = None
        self.dp_shard: dist.ProcessGroup | None = None

    def set_mesh(self, mesh: Any) -> None:
        """The groups of ``mesh`` (``SwiftlogClient.set_mesh``). Raises ConfigError when its sizes or
        this rank's coordinate are not the config's."""
        c = self.config
        try:
            pp, dp, shard = mesh_groups(mesh, c.layout, c.stage, c.replica, c.shard)
        except ValueError as e:
            raise ConfigError(str(e), hint="build it with trainer_client.build_mesh") from None
        self.set(pp, dp, shard)

    def set(self, pp: Any, dp_replicate: Any, dp_shard: Any) -> None:
        """The groups given directly. Raises ConfigError when a group's size is not the config's."""
        try:
            check_groups(self.config.layout, pp, dp_replicate, dp_shard)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.pp = pp
        self.dp_replicate = dp_replicate if self.config.dp_replicate > 1 else None
        self.dp_shard = dp_shard if self.config.dp_shard > 1 else None

    def release(self) -> None:
        """Forget every group (after a failure)."""
        self.pp = self.dp_replicate = self.dp_shard = None

    def shard_mesh(self) -> Any:
        """A one-dimensional ``DeviceMesh`` of the stage's shard group (``fsdp.shard_mesh``).
        Raises RuntimeError without ``dp_shard > 1`` or before a mesh was set."""
        c = self.config
        if self.dp_shard is None:
            raise RuntimeError(
                f"dp_shard={c.dp_shard}: a shard mesh needs dp_shard > 1 and client.set_mesh(mesh) first "
                "(trainer_client.form_mesh or ResilientLoop.join does it)"
            )
        return fsdp.shard_mesh(c.layout.shard_group(c.stage, c.replica), self.dp_shard, c.rank)

    def bind(self, module: torch.nn.Module) -> None:
        """Rebind a ``fully_shard``-ed ``module`` to the current shard group (nothing for another
        module). Raises ConfigError when the module is sharded but there is no shard group."""
        if not fsdp.is_sharded(module):
            return
        if self.dp_shard is None:
            raise ConfigError(
                f"stage {self.config.stage}: the module is fully_shard-ed but the client has no shard group "
                f"(dp_shard={self.config.dp_shard})",
                hint="configure dp_shard/shard and call client.set_mesh(mesh) first (ResilientLoop.join does)",
            )
        fsdp.rebind(module, self.dp_shard)
