"""How a client writes its stage's checkpoints and hands them to registration.

Two formats (``CheckpointConfig.format``): one ``torch.save`` file (``trainer_client.checkpoint``),
or a DCP directory and its pointer (``trainer_client.dcp_checkpoint``), saved synchronously or
with ``dcp.async_save``. A checkpoint is registered with the log store (which makes older logs
garbage) by the maintenance thread, and only once it is complete: a file renamed into place, a
DCP directory with ``.metadata`` whose pointer is written, an async save whose future completed.

Never: registers a checkpoint whose save failed or did not finish.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from trainer_client.checkpoint import checkpoint_uri, class_name, save_checkpoint, scheduler_next_rates
from trainer_client.config import ClientConfig
from trainer_client.dcp_checkpoint import dcp_dir_uri, pointer_uri, save_dcp, write_pointer
from trainer_client.maintenance import CheckpointMaintenance
from trainer_client.writer import AsyncLogWriter

__all__ = ["StageCheckpoints"]


class StageCheckpoints:
    """The checkpoints of one client's stage: write, then submit the registration."""

    def __init__(self, config: ClientConfig, writer: AsyncLogWriter, maint: CheckpointMaintenance) -> None:
        self.config, self.writer, self.maint = config, writer, maint

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
            "classes": {
                name: class_name(obj)
                for name, obj in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler))
                if obj is not None
            },
            "sched_next": None if lr_scheduler is None else scheduler_next_rates(lr_scheduler),
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
