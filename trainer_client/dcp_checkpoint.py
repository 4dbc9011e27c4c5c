"""Stage checkpoints through ``torch.distributed.checkpoint`` (DCP): one directory per step.

Layout under a stage's checkpoint location (``{base}/stage{k:05d}/``, beside the torch-format
``it{c:012d}.pt`` files):

- ``step-{c:012d}/``: a DCP checkpoint (``.metadata`` and its shards) holding ``model`` (the
  module's state dict), ``optimizer`` (``get_optimizer_state_dict``: keyed by parameter names) and
  ``lr_scheduler``: torchtitan's keys, so a checkpoint written by one's own DCP code with them
  loads too;
- ``it{c:012d}.dcp.json``: the pointer that makes it a swiftlog checkpoint: the run, stage and
  iteration, the seed, the DCP directory, whether swiftlog wrote it (``owned``: retention then
  deletes the directory with the pointer).

A pointer is written only after the save finished (for ``async_save``, its future completed) and
the directory's ``.metadata`` exists, so a listed checkpoint is complete and a save killed midway
is never listed nor registered. ``trainer_client.checkpoint.load_checkpoint`` of a pointer returns
a lazy ``Checkpoint`` whose ``apply`` runs ``dcp.load`` (:func:`apply_dcp`) into the live objects.

Never: writes a pointer for a directory without ``.metadata``; deletes a directory it did not
write.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import fsspec
import torch

from trainer_client.errors import CheckpointError

__all__ = [
    "POINTER_SUFFIX",
    "apply_dcp",
    "dcp_dir_uri",
    "has_metadata",
    "read_pointer",
    "pointer_uri",
    "remove_dcp",
    "save_dcp",
    "write_pointer",
]

POINTER_SUFFIX = ".dcp.json"
POINTER_FORMAT = "swiftlog-dcp-1"


def pointer_uri(base: str, stage: int, iteration: int) -> str:
    """The pointer of the DCP checkpoint of (stage, iteration) under ``base``."""
    return f"{base.rstrip('/')}/stage{stage:05d}/it{iteration:012d}{POINTER_SUFFIX}"


def dcp_dir_uri(base: str, stage: int, iteration: int) -> str:
    """The directory swiftlog writes the DCP checkpoint of (stage, iteration) to."""
    return f"{base.rstrip('/')}/stage{stage:05d}/step-{iteration:012d}"


def _fs(uri: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    if "://" not in uri:
        uri = "file://" + os.path.abspath(uri)
    return fsspec.core.url_to_fs(uri, **(storage_options or {}))


def _local(uri: str) -> str | None:
    if uri.startswith("file://"):
        return uri[len("file://") :]
    return None if "://" in uri else os.path.abspath(uri)


@contextlib.contextmanager
def _one_process() -> Any:
    """DCP warns on every no_dist call that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def has_metadata(dir_uri: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the DCP directory is complete (DCP writes ``.metadata`` last)."""
    fs, path = _fs(dir_uri, storage_options)
    return bool(fs.exists(f"{path.rstrip('/')}/.metadata"))


def dcp_state(model: torch.nn.Module, optimizer: Any | None, lr_scheduler: Any | None) -> dict[str, Any]:
    """The state swiftlog saves and loads with DCP: torchtitan's keys (``model``, ``optimizer``,
    ``lr_scheduler``). A fresh optimizer's state is created here (``get_optimizer_state_dict``),
    so that a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    return state


def save_dcp(
    dir_uri: str,
    model: torch.nn.Module,
    optimizer: Any | None,
    lr_scheduler: Any | None,
    *,
    asynchronous: bool = False,
) -> Future[Any] | None:
    """Save with ``dcp.save`` (this rank alone: ``no_dist``), or start ``dcp.async_save`` and
    return its future (the state is staged first, so training may go on). Raises
    CheckpointError when the synchronous save fails."""
    import torch.distributed.checkpoint as dcp

    state = dcp_state(model, optimizer, lr_scheduler)
    target = _local(dir_uri) or dir_uri
    try:
        with _one_process():
            if asynchronous:
                return dcp.async_save(state, checkpoint_id=target, no_dist=True)  # type: ignore[return-value]
            dcp.save(state, checkpoint_id=target, no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"DCP save to {dir_uri} failed: {type(e).__name__}: {e}") from e
    return None


def write_pointer(
    uri: str,
    *,
    dcp_dir: str,
    owned: bool,
    identity: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write the pointer ``uri`` to the complete DCP checkpoint ``dcp_dir`` (atomically: a temporary
    name, then a rename; an object PUT elsewhere). Raises CheckpointError when ``dcp_dir`` has
    no ``.metadata`` (a save not finished, or not a DCP checkpoint)."""
    if not has_metadata(dcp_dir, storage_options):
        raise CheckpointError(
            f"{dcp_dir} is not a complete DCP checkpoint (no .metadata)",
            hint="register a checkpoint once its save finished (for async_save: its future completed)",
        )
    doc = {"format": POINTER_FORMAT, "dcp": dcp_dir, "owned": owned, "saved_at": time.time(), **identity}
    data = json.dumps(doc, sort_keys=True).encode()
    local = _local(uri)
    try:
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            tmp = f"{local}.partial-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, local)
            return "file://" + local
        fs, path = _fs(uri, storage_options)
        fs.pipe_file(path, data)
        return uri
    except OSError as e:
        raise CheckpointError(f"could not write the DCP pointer {uri}: {e}") from e


def read_pointer(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pointer document; CheckpointError when it cannot be read or is not one."""
    try:
        fs, path = _fs(uri, storage_options)
        doc = json.loads(fs.cat_file(path))
    except Exception as e:
        raise CheckpointError(f"could not read checkpoint {uri}: {type(e).__name__}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        raise CheckpointError(f"{uri} is not a swiftlog DCP pointer ({POINTER_FORMAT})")
    return doc


def apply_dcp(
    dir_uri: str,
    model: torch.nn.Module,
    optimizer: Any | None,
    lr_scheduler: Any | None,
    what: str,
    check_scheduler: Callable[[dict[str, Any]], None],
) -> None:
    """``dcp.load`` of the checkpoint into the live objects (values copied into their tensors).
    ``check_scheduler`` sees the loaded scheduler state before it is applied (the class and field
    checks of ``Checkpoint.apply``). Raises CheckpointError naming what does not fit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = dcp_state(model, optimizer, lr_scheduler)
    try:
        with _one_process():
            dcp.load(state, checkpoint_id=_local(dir_uri) or dir_uri, no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(
            f"{what}: dcp.load failed: {type(e).__name__}: {str(e).strip()[:500]}",
            hint="its keys must be those of the objects it is loaded into (model, optimizer, lr_scheduler)",
        ) from None
    model.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if lr_scheduler is not None:
        check_scheduler(state["lr_scheduler"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])


def remove_dcp(uri: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete the pointer ``uri`` and then, when swiftlog wrote it, its DCP directory (a crash in
    between leaves a directory no pointer names, never a listed checkpoint without its data). A
    missing pointer is success."""
    fs, path = _fs(uri, storage_options)
    if not fs.exists(path):
        return
    doc = read_pointer(uri, storage_options)
    fs.rm_file(path)
    if doc.get("owned"):
        dfs, dpath = _fs(doc["dcp"], storage_options)
        if dfs.exists(dpath):
            dfs.rm(dpath, recursive=True)
