"""Finding durable checkpoints under a checkpoint URL: the newest one of a stage, the newest common one.

A replacement restarts from the newest checkpoint of its stage (of every stage of its logging
group) at or below the survivors' iteration; a global rollback restarts every stage from the
newest iteration at which all of them have one. Checkpoints are written atomically (a temporary
name, then a rename; a DCP checkpoint's pointer once its save is complete), so a listed one is
complete.

Never: reads a checkpoint's bytes (names only).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import fsspec

from trainer_client.checkpoint import checkpoint_uri
from trainer_client.dcp_checkpoint import pointer_uri

__all__ = ["common_checkpoint", "latest_checkpoint", "mesh_common_checkpoint", "newest_common"]

_IT_RE = re.compile(r"it(\d{12})\.(pt|dcp\.json)$")


def _checkpoint_iterations(base: str, stage: int, storage_options: dict[str, Any] | None = None) -> dict[int, str]:
    """Iteration -> URI of ``stage``'s checkpoints under ``base``: torch files (``it*.pt``), and
    DCP checkpoints by their pointers (``it*.dcp.json``, written once the save is complete); a
    torch file wins where an iteration has both."""
    fs, path = fsspec.core.url_to_fs(base.rstrip("/") + f"/stage{stage:05d}", **(storage_options or {}))
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return {}
    out: dict[int, str] = {}
    for m in (_IT_RE.search(str(n)) for n in names):
        if m is not None:
            it = int(m.group(1))
            if m.group(2) == "pt":
                out[it] = checkpoint_uri(base, stage, it)
            else:
                out.setdefault(it, pointer_uri(base, stage, it))
    return out


def newest_common(
    base: str, stages: Sequence[int], at_most: int | None = None, storage_options: dict[str, Any] | None = None
) -> tuple[int, dict[int, str]] | None:
    """The newest iteration (<= ``at_most`` if given) at which every stage of ``stages`` has a
    checkpoint under ``base``, with each stage's URI; None when there is none."""
    per_stage = [_checkpoint_iterations(base, k, storage_options) for k in stages]
    common = (
        set.intersection(*({i for i in its if at_most is None or i <= at_most} for its in per_stage))
        if per_stage
        else set()
    )
    if not common:
        return None
    it = max(common)
    return it, {k: its[it] for k, its in zip(stages, per_stage, strict=True)}


def latest_checkpoint(
    base: str, stage: int, at_most: int, storage_options: dict[str, Any] | None = None
) -> tuple[int, str] | None:
    """(iteration, URI) of the newest checkpoint of ``stage`` under ``base`` with iteration <= ``at_most``.

    Checkpoints are written atomically (temporary name, rename), so a listed one is complete.
    """
    found = newest_common(base, [stage], at_most, storage_options)
    return (found[0], found[1][stage]) if found else None


def mesh_common_checkpoint(base: str, num_stages: int, dp_replicate: int) -> int | None:
    """The newest checkpoint every rank of a mesh of ``dp_replicate`` data-parallel pipelines has
    (each pipeline's are under ``{base}/dp{i}`` when there are several): where a global rollback
    restarts."""
    if dp_replicate == 1:
        return common_checkpoint(base, num_stages, 1 << 40)
    found = [common_checkpoint(f"{base.rstrip('/')}/dp{r}", num_stages, 1 << 40) for r in range(dp_replicate)]
    return None if any(c is None for c in found) else min(c for c in found if c is not None)


def common_checkpoint(
    base: str,
    num_stages: int,
    at_most: int,
    storage_options: dict[str, Any] | None = None,
) -> int | None:
    """The newest iteration <= ``at_most`` at which every stage has a checkpoint (global rollback)."""
    found = newest_common(base, range(num_stages), at_most, storage_options)
    return found[0] if found else None
