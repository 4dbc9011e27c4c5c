"""Survivor snapshots: a rank's state kept on its node while torchrun restarts every rank.

torchrun's agent stops every worker when one fails and starts them all again. With
``RecoveryConfig.snapshot_dir`` a survivor saves its state at the agreed resume iteration
(:func:`save_snapshot`: model, optimizer and lr scheduler state, keyed by run and rank) before it
exits; in the next attempt ``replay.recover_on_restart`` loads it (:func:`load_snapshot`) and
only the lost ranks replay from their checkpoints. The directory must outlive the worker
processes but need not be durable: ``/dev/shm`` (the default) survives a worker's restart on the
same machine, not the machine's (nor a Kubernetes pod's) loss.

Never: replaces a checkpoint (a snapshot is not registered with the log store and makes no log
garbage), or hands out a snapshot of another run or rank.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["default_snapshot_dir", "load_snapshot", "save_snapshot", "snapshot_path"]

_VERSION = 1


def default_snapshot_dir() -> str:
    """``/dev/shm/swiftlog-snapshots`` where ``/dev/shm`` is writable (memory: fast, node-local),
    else a directory under the temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return str(shm / "swiftlog-snapshots")
    return os.path.join(tempfile.gettempdir(), "swiftlog-snapshots")


def snapshot_path(directory: str | os.PathLike[str], run_id: str, rank: int) -> Path:
    return Path(directory) / run_id / f"rank{rank:05d}.pt"


def save_snapshot(
    directory: str | os.PathLike[str],
    *,
    run_id: str,
    rank: int,
    stage: int,
    replica: int,
    iteration: int,
    generation: int,
    commit_prefix: str,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
) -> Path:
    """Write rank ``rank``'s state at ``iteration`` (iterations applied) atomically; its path.

    ``generation`` and ``commit_prefix`` name the failed generation of this attempt, whose
    survivor reports a restarted lost rank reads to replay up to ``iteration``."""
    path = snapshot_path(directory, run_id, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "version": _VERSION,
        "run_id": run_id,
        "rank": rank,
        "stage": stage,
        "replica": replica,
        "iteration": iteration,
        "generation": generation,
        "commit_prefix": commit_prefix,
        "t": time.time(),
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
    }
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    torch.save(doc, tmp)
    os.replace(tmp, path)
    return path


def load_snapshot(directory: str | os.PathLike[str], run_id: str, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s snapshot of ``run_id``, or None (none there, unreadable, or another run's)."""
    path = snapshot_path(directory, run_id, rank)
    if not path.is_file():
        return None
    try:
        doc = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - a torn or foreign file: as if there were none
        return None
    if doc.get("version") != _VERSION or doc.get("run_id") != run_id or doc.get("rank") != rank:
        return None
    return doc
