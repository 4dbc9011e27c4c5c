"""How a client writes its stage's checkpoints and hands them to registration.

Two formats (``CheckpointConfig.format``): one ``torch.save`` file (``trainer_client.checkpoint``),
or a DCP directory and its pointer (``trainer_client.dcp_checkpoint``), saved synchronously or
with ``dcp.async_save``. A checkpoint is registered with the log store (which makes older logs
garbage) by the maintenance thread, and only once it is complete: a file renamed into place, a
DCP directory with ``.metadata`` whose pointer is written, an async save whose future completed.

Never: registers a checkpoint whose save failed or did not finish.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from logstore import LogStore
from trainer_client.checkpoint import checkpoint_uri, save_checkpoint, saved_kinds
from trainer_client.commit import SharedRegistrations
from trainer_client.config import ClientConfig
from trainer_client.dcp_checkpoint import dcp_dir_uri, pointer_uri, save_dcp, write_pointer
from trainer_client.maintenance import CheckpointMaintenance
from trainer_client.writer import AsyncLogWriter

__all__ = ["StageCheckpoints"]

logger = logging.getLogger(__name__)


class StageCheckpoints:
    """The checkpoints of one client's stage: write, then submit the registration to the
    maintenance thread it opens (``maint``: registration, retention, GC)."""

    def __init__(
        self, config: ClientConfig, store: LogStore, writer: AsyncLogWriter, commit_store: dist.Store | None, name: str
    ) -> None:
        self.config, self.writer = config, writer
        shared = None
        if commit_store is not None:
            # registrations govern one pipeline's logs: each data-parallel pipeline shares its own
            prefix = config.commit_prefix + ("" if config.dp_size == 1 else f"/dp{config.dp_index}")
            shared = SharedRegistrations(commit_store, prefix=prefix, stage=config.stage, num_stages=config.num_stages)
        elif config.cold_url is None and config.num_stages > 1:
            logger.warning(
                "stage %d: no cold tier and no commit store: this stage's checkpoint registrations reach this "
                "node's store root only, so nodes holding what it received never free it",
                config.stage,
            )
        self.maint = CheckpointMaintenance(
            store,
            writer,
            name,
            keep=config.checkpoints.keep,
            own_uri=self.uri,
            storage_options=config.checkpoint_options(),
            shared=shared,
        )

    def uri(self, stage: int, iteration: int) -> str:
        """Where the checkpoint of (stage, iteration) is, or goes, in the configured format (a DCP
        checkpoint: its pointer)."""
        where = pointer_uri if self.config.checkpoints.format == "dcp" else checkpoint_uri
        return where(self.config.resolved_checkpoint_url(), stage, iteration)

    def save(
        self,
        iteration: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None,
        extra: dict[str, Any] | None,
    ) -> str:
        """Write the checkpoint in the configured format and submit its registration; its URI
        (a DCP checkpoint's pointer, written when complete)."""
        c = self.config
        base = c.resolved_checkpoint_url()
        if c.checkpoints.format == "torch":
            uri = save_checkpoint(
                checkpoint_uri(base, c.stage, iteration),
                run_id=c.log_run,
                stage=c.stage,
                num_stages=c.num_stages,
                iteration=iteration,
                seed=c.seed,
                model=model,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                extra=extra,
                storage_options=c.checkpoint_options(),
            )
            self._register(iteration, uri)
            return uri
        directory = dcp_dir_uri(base, c.stage, iteration)
        future = save_dcp(directory, model, optimizer, lr_scheduler, asynchronous=c.checkpoints.async_save)
        identity = self._identity(iteration, optimizer, lr_scheduler, extra)
        pointer = pointer_uri(base, c.stage, iteration)
        if future is None:
            uri = write_pointer(
                pointer, dcp_dir=directory, owned=True, identity=identity, storage_options=c.checkpoint_options()
            )
            self._register(iteration, uri)
            return uri

        def complete() -> str:  # on the maintenance thread: raises when the save failed
            future.result()
            return write_pointer(
                pointer, dcp_dir=directory, owned=True, identity=identity, storage_options=c.checkpoint_options()
            )

        self._register(iteration, pointer, complete)
        return pointer

    def register_dcp(
        self,
        iteration: int,
        path: str,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None,
        extra: dict[str, Any] | None,
    ) -> str:
        """Register a DCP checkpoint written by the caller's own code (its directory ``path``):
        write its pointer (CheckpointError when ``path`` has no ``.metadata``) and submit it."""
        c = self.config
        uri = write_pointer(
            pointer_uri(c.resolved_checkpoint_url(), c.stage, iteration),
            dcp_dir=path,
            owned=False,
            identity=self._identity(iteration, optimizer, lr_scheduler, extra),
            storage_options=c.checkpoint_options(),
        )
        self._register(iteration, uri)
        return uri

    def _identity(
        self, iteration: int, optimizer: Any | None, lr_scheduler: Any | None, extra: dict[str, Any] | None
    ) -> dict[str, Any]:
        c = self.config
        return {
            "run_id": c.log_run,
            "stage": c.stage,
            "num_stages": c.num_stages,
            "iteration": iteration,
            "seed": c.seed,
            **saved_kinds(optimizer, lr_scheduler),
            "extra": dict(extra or {}),
        }

    def _register(self, iteration: int, uri: str, complete: Any = None) -> None:
        c = self.config
        drained = threading.Event()
        self.writer.mark(drained.set)
        meta: dict[str, Any] = {"seed": c.seed, "num_stages": c.num_stages, "writer": c.writer_name}
        # a group is replayed from the checkpoint all its members have: GC keeps what that needs
        if c.logging_groups is not None:
            meta["logging_groups"] = list(c.logging_groups)
        self.maint.submit(("register", c.stage, iteration, uri, meta, drained, c.checkpoints.gc_after, complete))
